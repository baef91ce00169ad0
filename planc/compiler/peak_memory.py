"""Peak memory per rank for a workload (`planc explain --train/--serve --batch B --seq S`): what fits before launch.

An analytic model over the compiled plan's shapes (pure Python, milliseconds on a 61-layer model). Every term is
(rows) x (width) x (bytes), written from the tensors transformers' forward keeps and the ones planc's EP runtimes
allocate, and checked against rank 0 really running at full width (`tests/memory`, `bench/memory_grid.py`,
docs/memory.md). Numbers are for rank 0, the most any rank holds under balanced routing.

Training (one AdamW step), the peak is the largest of these moments:
- `loss backward`: parameters, AdamW state, every layer's saved activations and the loss's three fp32 [tokens,
  vocab] tensors (log-softmax kept for backward, its gradient, the gradient of the logits); gradients were set
  to None by the previous `zero_grad()`;
- `end of backward`: parameters, gradients, AdamW state, and backward's transient: the largest parameter's gradient
  twice more (the local gradient and the one accumulated into `.grad`), or under fsdp the root's gathered
  parameters and, per FSDP unit as planc wraps them (a layer, its EP experts over efsdp, an fp32 router), the
  largest unit's gathered parameters, unsharded gradients and reduce-scatter input with the rest of its layer;
- under fsdp, `lm_head backward (FSDP prefetch)`: the loss's gradients (two fp32 [tokens, vocab] and the logits'
  gradient in the compute dtype) while FSDP2 all-gathers the next unit (one unit's buffer);
- in a model with DeepSeek Sparse Attention's indexer, `forward, sparse attention indexer`: parameters, AdamW
  state, the activations the layers before an indexed layer keep, its attention's and its indexer's fp32 scores
  (`planc.compiler.indexer_memory`), which outgrow the loss at long sequences or batch > 1;
- `optimizer step`: parameters, gradients, AdamW state and the step's temporaries (`optimizer`, by default the step
  the plan leads torch to on CUDA; `planc.compiler.optimizer_step` says what foreach and for-loop hold).
On CUDA, torch's cuBLAS workspaces (`planc.compiler.devices.cuda_workspaces`) are added to every moment.
Serving (one prefill under `no_grad`, `logits_to_keep=1` as `generate` runs it): parameters, the KV cache of
every layer so far, the masks and residual streams the forward keeps, Mega MoE's symmetric buffer and the largest
layer's transient. What a family's code allocates beyond its shapes is `planc.compiler.family_memory`'s; what the
model runs and planc does not price is `unpriced`, said next to the verdict.

Tokens: a rank holds B x S tokens (the TP ranks of a replica share the batch). EP `all_to_all` moves
(token, expert) rows: a rank receives B*S/tp * top_k * capacity_factor rows, the balanced load (capacity_factor
1.0); the worst case, every routed row of the EP group landing on one rank, is reported next to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Optional

from planc.compiler import attention_memory, deepseek_v4_memory, indexer_memory, megamoe_buffers, ssm_memory
from planc.compiler import hyper_connection_memory
from planc.compiler.deepseek_v4_memory import HyperConnectionLayer
from planc.compiler.devices import cuda_workspaces
from planc.compiler.family_memory import FamilyMemory, family_memory
from planc.compiler.optimizer_step import OPTIMIZER_STEP, STEPS
from planc.compiler.train_memory import ITEMSIZE, TrainMemory, decoder_layers
from planc.compiler.units import human_bytes
from planc.spec.choices import ACTIVATION_CHECKPOINTING_MODES
from planc.spec.model import MegaMoe
from planc.spec.styles import SHARDED, STYLE

if TYPE_CHECKING:
    from planc.compiler.compiled import CompiledPlan
    from planc.compiler.walk import ModelWalk

# What the CUDA context, cuDNN and NCCL's communicators take outside PyTorch's allocator on each rank: about 0.5 GiB
# for the context and kernels on an H100/H200 (CUDA 12) plus NCCL's buffers (NCCL_BUFFSIZE 4 MiB per channel and
# peer). cuBLAS's workspaces are not in it: torch allocates them through its allocator (priced in the peak). 2 GiB
# is a deliberate round allowance from those published sizes, not a measurement on this machine (it has no GPU);
# `--reserve` overrides it.
DEFAULT_RESERVE = 2 * 2**30
FP32 = 4


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer as the model computes it on one rank."""

    attention: str  # gqa | mla
    mlp: str  # dense | moe
    q: int  # query width on this rank (heads x head dim)
    k: int  # key width on this rank
    v: int  # value width on this rank
    heads: int  # query heads on this rank
    cache: int  # bytes per token this layer's KV cache holds (both K and V)
    cache_kind: str
    window: Optional[int] = None  # sliding window: the cache keeps at most this many tokens
    q_lora: int = 0
    kv_lora: int = 0
    intermediate: int = 0  # dense MLP width on this rank
    shared: int = 0  # shared experts' width on this rank
    moe_intermediate: int = 0
    num_experts: int = 0
    top_k: int = 0
    local_experts: int = 0  # experts this rank holds (EP)
    dense_dispatch: bool = False  # every token runs every expert, pre-scaled (Llama 4: planc.runtime.ep.dense)
    megamoe: bool = False  # the experts run Mega MoE (planc.compiler.megamoe_buffers)
    attn_impl: str = "sdpa"  # what transformers runs (config._attn_implementation): sdpa | eager | flex_attention...
    sinks: bool = False  # a per-head sink logit joins the eager scores (gpt-oss)
    kv_heads: int = 0  # key/value heads on this rank (eager's repeat_kv copies them to `heads`)
    head_dim: int = 0
    linear: Optional[LinearAttention] = None  # a linear-attention layer (Qwen3-Next's gated delta rule)
    layer_type: str = "full_attention"  # the config's `layer_types` entry (DeepSeek-V4: its compressor kind)
    compress_rate: int = 0  # DeepSeek-V4: source tokens per compressed KV entry the layer appends to its keys
    all_slots: bool = False  # AllReduceEP: this rank's experts run over every token's top-k slots, in training too
    indexer_heads: int = 0  # DeepSeek Sparse Attention's indexer on this layer (planc.compiler.indexer_memory)
    relative_extent: int = 0  # distances a dense relative-position bias covers (family_memory's relative_position_bias)
    indexer_dim: int = 0
    indexer_rope: int = 0  # the indexer queries' rotated width (indexer_memory.indexer_rope)
    sdpa_math: bool = False  # sdpa runs its math path: fp32 S x S scores (planc.compiler.attention_memory)
    # attention sublayers the layer runs, each after its own input norm and before its own post-attention norm
    # (LongCat-Flash's two MLA sublayers per decoder layer); the module tree says (`sublayers`)
    attentions: int = 1
    # widths on this rank of the dense MLPs a MoE layer runs beside its experts (LongCat-Flash's `mlps`, one after
    # each attention sublayer; shared experts are not among them)
    mlps_beside: tuple[int, ...] = ()
    # hyper-connection streams around the layer (Qwen4-Exp, HY-V4: planc.compiler.hyper_connection_memory)
    stream_mixer: Optional[hyper_connection_memory.StreamMixer] = None
    # the width the routed experts run at, where a projection maps the hidden to it and back (Muse Spark's
    # `pre_expert_proj`/`post_expert_proj` to `moe_hidden_size`); 0: the hidden size
    expert_hidden: int = 0
    tp_experts: bool = False  # moe_tp_experts: this rank runs a slice of every expert over every token's slots


class LinearAttention(NamedTuple):
    """A gated-delta-rule layer on one rank: key/value heads and widths, the conv kernel."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    # what the layer runs (planc.compiler.family_memory's `linear_scan`): chunk | chunk_per_key | mamba (a Mamba
    # layer is d_inner value heads of width 1 with d_state keys) | mamba2 (a Mamba2 layer: its groups of B and C are
    # the key heads, d_state the key width, its heads and head_dim the values')
    scan: str = "chunk"
    chunk: int = 64  # tokens per chunk of the chunked scan (Mamba2's `chunk_size`; the torch chunk rules' 64)

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def state_bytes(self, a: int) -> int:
        """What the cache holds per sequence: the conv state (model dtype) and the fp32 recurrent state."""
        return self.conv_channels * self.conv_kernel * a + self.value_heads * self.key_dim * self.value_dim * FP32


@dataclass(frozen=True)
class PeakMemory:
    """`planc explain --train/--serve`: the peak per rank, its moment, and what is counted at it."""

    workload: str  # train | serve
    batch: int
    seq: int
    peak: int
    moment: str
    breakdown: tuple[tuple[str, int], ...]  # name -> bytes at the peak
    moments: tuple[tuple[str, int], ...]  # every moment considered -> bytes
    transients: tuple[tuple[str, int], ...]  # cause -> bytes, largest first
    kv_cache: tuple[tuple[str, int], ...] = ()  # layer kind -> bytes (serve)
    routed_rows: int = 0
    routed_rows_worst: int = 0
    worst_case_peak: int = 0
    capacity_factor: float = 1.0
    checkpointing: str = "none"
    notes: tuple[str, ...] = ()
    unpriced: tuple[str, ...] = ()  # what the family allocates that planc does not price: the verdict is not backed
    # the family is one the memory grid measured (family_memory's rows): its unpriced items are priced on the safe
    # side, so the peak errs high; an unmeasured family's may miss what its layers allocate, so it may be low and
    # explain gives no verdict (no fits, no largest batch) for it
    validated: bool = True
    device_memory: Optional[int] = None
    reserve: int = DEFAULT_RESERVE
    max_batch: Optional[int] = None
    max_seq: Optional[int] = None
    adamw_step: Optional[str] = None  # the AdamW step priced (train): planc.compiler.optimizer_step.STEPS

    @property
    def fits(self) -> Optional[bool]:
        """None without a device size, or for a family the grid has not validated (no verdict)."""
        if self.device_memory is None or not self.validated:
            return None
        return self.peak + self.reserve <= self.device_memory

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "batch": self.batch,
            "seq": self.seq,
            "peak_per_rank": self.peak,
            "peak_moment": self.moment,
            "breakdown": dict(self.breakdown),
            "moments": dict(self.moments),
            "transients": dict(self.transients),
            "kv_cache": dict(self.kv_cache),
            "activation_checkpointing": self.checkpointing,
            "routing": {
                "capacity_factor": self.capacity_factor,
                "rows_per_rank": self.routed_rows,
                "rows_per_rank_worst": self.routed_rows_worst,
                "peak_per_rank_worst": self.worst_case_peak,
            },
            "device_memory": self.device_memory,
            "reserve": self.reserve,
            "fits": self.fits,
            "max_batch": self.max_batch,
            "max_seq": self.max_seq,
            "adamw_step": self.adamw_step,
            "unpriced": list(self.unpriced),
            "validated": self.validated,
        }

    def render(self) -> str:
        what = "training step (AdamW)" if self.workload == "train" else "serving prefill"
        lines = [f"peak memory per rank, {what} at batch {self.batch} x seq {self.seq}:"]
        for name, n in self.breakdown:
            lines.append(f"  {name + ':':<34} {human_bytes(n, 2)}")
        lines.append(f"  {'peak:':<34} {human_bytes(self.peak, 2)} at {self.moment}")
        if self.transients:
            lines.append("  transients (the largest sets the peak's moment):")
            lines.extend(f"    {cause}: {human_bytes(n, 2)}" for cause, n in self.transients)
        if self.kv_cache:
            lines.append("  KV cache by layer kind:")
            lines.extend(f"    {kind}: {human_bytes(n, 2)}" for kind, n in self.kv_cache)
        if self.routed_rows:
            lines.append(
                f"  EP routing: {self.routed_rows} (token, expert) rows per rank and layer assumed (balanced, "
                f"capacity factor {self.capacity_factor:g}); worst case {self.routed_rows_worst} rows: peak "
                f"{human_bytes(self.worst_case_peak, 2)}"
            )
        if self.device_memory is not None:
            left = self.device_memory - self.reserve - self.peak
            verdict = "fits" if left >= 0 else "does NOT fit"
            verdict += f" ({'left' if left >= 0 else 'over by'} {human_bytes(abs(left), 2)})"
            flag = f" [not priced: {len(self.unpriced)} item(s) below; the peak errs high]" if self.unpriced else ""
            if not self.validated:
                verdict = ("no verdict [not validated: the memory grid has not measured this family, "
                           f"{len(self.unpriced)} item(s) below; the peak above may be low]")
                flag = ""
            lines.append(
                f"  device memory {human_bytes(self.device_memory, 1)} - reserve {human_bytes(self.reserve, 1)} "
                f"(CUDA context, NCCL): {verdict}" + flag
            )
            lines.append("  counts live tensors: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the default "
                         "allocator fragments: +16% measured, docs/memory.md)")
            if self.max_batch is not None:
                lines.append(f"  largest micro-batch that fits at seq {self.seq}: {self.max_batch}")
            if self.max_seq is not None:
                lines.append(f"  longest sequence that fits at batch {self.batch}: {self.max_seq}")
        lines.extend(f"  note: {n}" for n in self.notes)
        lines.extend(f"  not priced: {n}" for n in self.unpriced)
        return "\n".join(lines)


def _splits_output(style: str) -> bool:
    """The style leaves its module's output split over tp (colwise, packed or not): the widths after it are per
    rank."""
    row = STYLE.get(style)
    return row is not None and row.output == SHARDED


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The decoder's config: a multimodal model's `text_config` (its language model is what the plan prices)."""
    inner = config.get("text_config")
    return inner if "hidden_size" not in config and isinstance(inner, Mapping) else config


def _get(config: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        v = config.get(n)
        if v is not None:
            return v
    return default


def _layer_kinds(walk: ModelWalk) -> dict[str, tuple[bool, bool, bool]]:
    """Decoder layer path -> (MLA attention, MoE MLP, shared experts), from the module tree."""
    out: dict[str, list[bool]] = {}
    for fqn, m in walk.modules.items():
        parts = fqn.split(".")
        for i in range(len(parts) - 1, 0, -1):
            if parts[i].isdigit():
                layer = ".".join(parts[: i + 1])
                flags = out.setdefault(layer, [False, False, False])
                rest = parts[i + 1:]
                if rest and rest[-1] == "kv_a_proj_with_mqa":
                    flags[0] = True
                if m.experts is not None:
                    flags[1] = True
                if rest and rest[-1] in ("shared_experts", "shared_expert"):
                    flags[2] = True
                break
    top = {f for f in out if not any(f.startswith(g + ".") for g in out if g != f)}
    # a numbered list inside a layer (LongCat-Flash's `self_attn.0`, `self_attn.1`): its flags are the layer's
    for f, flags in out.items():
        if f not in top:
            owner = next((g for g in top if f.startswith(g + ".")), None)
            if owner is not None:
                out[owner] = [x or y for x, y in zip(out[owner], flags)]
    # a multimodal model's other numbered blocks (Qwen3-VL's vision blocks and mergers) do not run on text tokens:
    # only the items of the list holding the experts' layers are decoder layers
    decoder = decoder_layers(walk, [f for f, m in walk.modules.items() if m.experts is not None])
    if decoder:
        top &= decoder
    return {f: (v[0], v[1], v[2]) for f, v in out.items() if f in top}


def _text_config_object(walk: ModelWalk) -> Any:
    """The model's config object for its decoder: a multimodal config's text config (`get_text_config`), else itself."""
    config = walk.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def head_width(walk: ModelWalk, config: Mapping[str, Any]) -> int:
    """The width of the model's output head, the logits' last dimension: `lm_head`'s out-features (Inkling 2's spans
    `unpadded_vocab_size`), `vocab_size` where it is tied to the embedding (not a parameter of its own); a model
    without an `lm_head` (a token classifier: `score` over `config.num_labels`) scores with its last top-level module
    that holds a 2-D weight, transformers registering the head after the base model."""
    def width(fqn: str) -> Optional[int]:
        m = walk.modules.get(fqn)
        shapes = [walk.params[p].shape for p in (m.params if m is not None else ()) if p.endswith(".weight")]
        return int(shapes[0][0]) if shapes and len(shapes[0]) == 2 else None

    if "lm_head" in walk.modules:
        return width("lm_head") or int(config["vocab_size"])
    heads = [w for f in walk.modules if f and "." not in f for w in [width(f)] if w is not None]
    return heads[-1] if heads else int(config["vocab_size"])


def attention_implementation(walk: ModelWalk) -> str:
    """The attention transformers runs for this model (`config._attn_implementation`: sdpa by default, eager where the
    family supports nothing else, gpt-oss and DeepSeek-V4); a multimodal model's text config decides its decoder."""
    text = _text_config_object(walk)
    return str(getattr(text, "_attn_implementation", None) or getattr(walk.config, "_attn_implementation", None)
               or "sdpa")


# Layer types whose cache transformers keeps as a sliding window (after a prefill the layer still holds all S tokens'
# storage: `DynamicSlidingWindowLayer` trims at the next update)
# Unlimited-OCR's reference sliding window (`reference_sliding_attention`) keeps every prefill token for good and slides
# over decoded ones: a prefill holds all S tokens, as a sliding layer does
_WINDOWED = {"sliding_attention", "chunked_attention", "reference_sliding_attention"}
_LINEAR = {"linear_attention"}


def layer_shapes(compiled: CompiledPlan, walk: ModelWalk, config: Mapping[str, Any], itemsize: int) -> list[LayerShape]:
    """Every decoder layer's widths on rank 0 (TP splits heads and MLP widths when the plan shards them)."""
    tp = compiled.parallel.tp_size
    styles = {a.fqn: a.style for a in compiled.assignments}
    hidden = int(config["hidden_size"])
    # a config may compute its layer types (Jamba's property from attn_layer_period/offset): read the object too
    layer_types = config.get("layer_types") or list(getattr(_text_config_object(walk), "layer_types", None) or [])
    experts_by_layer = {e.fqn: e for e in compiled.experts}
    impl = attention_implementation(walk)
    megamoe = compiled.experts_implementation.megamoe
    sinks = {f.rsplit(".", 2)[0] for f in walk.params if f.endswith(".sinks")}
    fam = family_memory(walk.model_type)
    own_head_dims = _attention_head_dims(walk)
    own_kv_widths = _attention_kv_widths(walk)
    shapes = []
    for index, (layer, (mla, moe, shared)) in enumerate(sorted(_layer_kinds(walk).items(),
                                                               key=lambda kv: _layer_index(kv[0]))):
        attn_tp = any(f.startswith(layer + ".") and "attn" in f and _splits_output(s) for f, s in styles.items())
        split = tp if attn_tp else 1
        mlp_tp = tp if any(f.startswith(layer + ".mlp.") and _splits_output(s) for f, s in styles.items()) else 1
        kind = layer_types[index] if index < len(layer_types) else "full_attention"
        kind = dict(fam.layer_types).get(kind, kind)  # a family's own name for a kind priced here (Zaya's hybrid)
        experts = next((e for f, e in experts_by_layer.items() if f.startswith(layer + ".")), None)
        layer_cfg = layer_config(config, index)  # a heterogeneous config: the layer's own widths
        heads = int(_get(layer_cfg, "num_attention_heads", default=1))
        kv_heads = int(_get(layer_cfg, "num_key_value_heads", default=heads))
        head_dim = int(_get(layer_cfg, "head_dim", default=0) or hidden // heads)
        window = _get(layer_cfg, "sliding_window", "attention_chunk_size")
        linear = None
        h, kvh, d = heads // split, max(1, kv_heads // split), head_dim
        if mla:
            nope, rope = int(layer_cfg["qk_nope_head_dim"]), int(layer_cfg["qk_rope_head_dim"])
            vdim = int(layer_cfg["v_head_dim"])
            q, k, v = h * (nope + rope), h * (nope + rope), h * vdim
            # transformers caches the compressed latent and the rope key, [B, 1, S, kv_lora + rope], on every rank
            cache = (int(layer_cfg["kv_lora_rank"]) + rope) * itemsize
            cache_kind, kvh, d = "MLA latent (kv_lora_rank + rope)", h, nope + rope
        elif kind in _LINEAR and fam.linear_scan == "mamba":
            inner = int(_get(layer_cfg, "mamba_expand", default=2)) * hidden
            linear = LinearAttention(key_heads=0, value_heads=inner, key_dim=int(_get(layer_cfg, "mamba_d_state")),
                                     value_dim=1, conv_kernel=int(_get(layer_cfg, "mamba_d_conv", default=4)),
                                     scan="mamba")
            q = k = v = 0
            cache, cache_kind = 0, "linear attention (conv and recurrent state)"
        elif kind in _LINEAR and fam.linear_scan == "short_conv":
            linear = short_conv_layer(layer_cfg)
            q = k = v = 0
            cache, cache_kind = 0, "short convolution (conv state)"
        elif kind in _LINEAR and fam.linear_scan == "mamba2":
            linear = mamba2_layer(layer_cfg)
            q = k = v = 0
            cache, cache_kind = 0, "linear attention (conv and recurrent state)"
        elif kind in _LINEAR:
            linear = LinearAttention(
                key_heads=int(_get(layer_cfg, "linear_num_key_heads", "linear_num_heads", default=heads)),
                value_heads=int(_get(layer_cfg, "linear_num_value_heads", "linear_num_heads", default=heads)),
                key_dim=int(_get(layer_cfg, "linear_key_head_dim", "linear_head_dim", default=head_dim)),
                value_dim=int(_get(layer_cfg, "linear_value_head_dim", "linear_head_dim", default=head_dim)),
                conv_kernel=int(_get(layer_cfg, "linear_conv_kernel_dim", default=4)),
                scan=fam.linear_scan,
            )
            q = k = v = 0
            cache, cache_kind = 0, "linear attention (conv and recurrent state)"
        else:
            d = own_head_dims.get(layer) or d  # a layer's own head width (Gemma 4's full layers: 512)
            if own_kv_widths.get(layer):  # a layer's own key/value heads (Inkling's sliding layers: 16, its full 8)
                kvh = max(1, own_kv_widths[layer] // d // split)
            q, k, v = h * d, kvh * d, kvh * d
            cache = (k + v) * itemsize
            cache_kind = "sliding window" if kind in _WINDOWED and window else "full attention"
        inter = int(_get(layer_cfg, "intermediate_size", default=0) or 0) // mlp_tp
        moe_inter = experts.intermediate_size if experts is not None and experts.intermediate_size else 0
        if experts is not None and experts.mode == "tp":  # moe_tp_experts: each rank runs a slice of every expert
            moe_inter //= tp
        index_heads, index_dim = indexer_memory.indexer_shape(layer_cfg, kind, index)
        if index_heads:  # the indexer's keys are cached beside the attention's
            cache += indexer_memory.cache_bytes_per_token(index_dim, itemsize)
        n_shared = int(_get(layer_cfg, "n_shared_experts", "num_shared_experts", default=0) or 0)
        shared_w = (moe_inter * n_shared) // mlp_tp if shared else 0
        if shared and not shared_w:  # one shared expert of its own width (Qwen3-Next, Llama 4)
            shared_w = int(_get(layer_cfg, "shared_expert_intermediate_size", "shared_intermediate_size",
                                    "intermediate_size", default=0) or 0)
            shared_w //= mlp_tp
        shapes.append(LayerShape(
            attention="mla" if mla else "linear" if linear else "gqa", mlp="moe" if moe else "dense", q=q, k=k, v=v,
            heads=h, cache=cache, cache_kind=cache_kind, window=int(window) if cache_kind == "sliding window" else None,
            q_lora=int(_get(layer_cfg, "q_lora_rank", default=0) or 0) if mla else 0,
            kv_lora=int(_get(layer_cfg, "kv_lora_rank", default=0) or 0) if mla else 0,
            intermediate=inter, shared=shared_w, moe_intermediate=moe_inter,
            num_experts=experts.num_experts if experts is not None else 0,
            local_experts=experts.num_local_experts if experts is not None else 0,
            dense_dispatch=experts is not None and experts.dispatch == "dense",
            megamoe=experts is not None and megamoe,
            top_k=(experts.top_k or _top_k(walk, layer_cfg)) if experts is not None else 0,
            attn_impl=impl, sinks=layer in sinks, kv_heads=kvh, head_dim=d, linear=linear, layer_type=kind,
            compress_rate=int((layer_cfg.get("compress_rates") or {}).get(kind) or 0),
            all_slots=experts is not None and experts.strategy is not None and experts.strategy.name == "all_reduce",
            indexer_heads=index_heads, indexer_dim=index_dim,
            indexer_rope=indexer_memory.indexer_rope(layer_cfg) if index_heads else 0,
            relative_extent=relative_extent(layer_cfg, kind) if fam.relative_position_bias and not linear else 0,
            stream_mixer=hyper_connection_memory.stream_mixer(layer_cfg),
            expert_hidden=int(_get(layer_cfg, "moe_hidden_size", default=0) or 0) if moe else 0,
            tp_experts=experts is not None and experts.mode == "tp",
        ))
        attentions, beside = sublayers(walk, layer, styles, tp)
        if attentions > 1 or beside:
            shapes[-1] = replace(shapes[-1], attentions=max(attentions, 1), cache=shapes[-1].cache * max(attentions, 1),
                                 mlps_beside=beside if moe else ())
        if fam.mixer_blocks:
            shapes[-1] = _one_mixer(shapes[-1], kind)
    return shapes


def sublayers(walk: ModelWalk, layer: str, styles: Mapping[str, str], tp: int) -> tuple[int, tuple[int, ...]]:
    """(attention modules, widths on this rank of the dense MLPs outside the experts and shared experts) of one
    decoder layer, read from its modules: an attention is a module with an `o_proj`, an MLP one with a `down_proj`
    and a `gate_proj`, `up_proj` or `gate_up_proj` (its width the down projection's input, split over tp where the
    MLP's projections split their output). LongCat-Flash's layer is (2, (ffn / tp, ffn / tp)) beside its MoE; a
    common layer (1, ()), or (1, (intermediate,)) if dense."""
    inside = set(f for f in walk.modules if f.startswith(layer + "."))
    experts = [f for f in inside if walk.modules[f].experts is not None]
    attentions = {f.rpartition(".")[0] for f in inside if f.endswith(".o_proj")}
    widths = []
    for mlp in sorted({f.rpartition(".")[0] for f in inside if f.endswith(".down_proj")}):
        if not any(f"{mlp}.{up}" in inside for up in ("gate_proj", "up_proj", "gate_up_proj")):
            continue  # a projection named so outside an MLP (Zaya's router)
        if "shared_expert" in mlp or any(mlp == e or mlp.startswith(e + ".") for e in experts):
            continue
        weight = walk.params.get(mlp + ".down_proj.weight")
        if weight is None or len(weight.shape) != 2:
            continue
        split = tp if any(f.startswith(mlp + ".") and _splits_output(st) for f, st in styles.items()) else 1
        widths.append(weight.shape[1] // split)
    return len(attentions), tuple(widths)


_MLP_MIXERS = {"moe", "mlp"}  # the layer types of a one-mixer block that run an MLP (Nemotron-H's `mlp`, `moe`)


def _one_mixer(s: LayerShape, kind: str) -> LayerShape:
    """A block that runs one mixer, as its layer type says (planc.compiler.family_memory's `mixer_blocks`): an MLP
    or MoE block has no attention (and no cache), an attention or linear-attention block no MLP."""
    if kind in _MLP_MIXERS:
        return replace(s, attention="none", q=0, k=0, v=0, heads=0, cache=0, cache_kind="none", window=None,
                       mlp="moe" if kind == "moe" else "dense")
    return replace(s, mlp="none", intermediate=0, shared=0, moe_intermediate=0, num_experts=0, top_k=0,
                   local_experts=0)


def mamba2_layer(config: Mapping[str, Any]) -> LinearAttention:
    """A Mamba2 mixer's widths from its config (Granite MoE hybrid's `mamba_*` names or Nemotron-H's): it is not
    split by TP (`planc init` leaves the mixer whole)."""
    hidden = int(config["hidden_size"])
    heads = int(_get(config, "mamba_n_heads", "mamba_num_heads"))
    return LinearAttention(
        key_heads=int(_get(config, "mamba_n_groups", "n_groups", default=1)), value_heads=heads,
        key_dim=int(_get(config, "mamba_d_state", "ssm_state_size")),
        value_dim=int(_get(config, "mamba_d_head", "mamba_head_dim",
                           default=int(_get(config, "mamba_expand", "expand", default=2)) * hidden // heads)),
        conv_kernel=int(_get(config, "mamba_d_conv", "conv_kernel", default=4)), scan="mamba2",
        chunk=int(_get(config, "mamba_chunk_size", "chunk_size", default=256)),
    )


def short_conv_layer(config: Mapping[str, Any]) -> LinearAttention:
    """A gated short-convolution layer (LFM2's `ShortConv`: `in_proj` to B, C, x, the depthwise causal conv of B * x
    over `conv_L_cache` tokens, C times its output, `out_proj`), as a linear attention of `hidden` value channels of
    width 1 and no recurrent state: its cache is the conv state alone. `planc init` leaves it whole (no TP)."""
    return LinearAttention(key_heads=0, value_heads=int(config["hidden_size"]), key_dim=0, value_dim=1,
                           conv_kernel=int(_get(config, "conv_L_cache", default=3)), scan="short_conv")


def _mamba2_widths(lin: LinearAttention) -> dict[str, int]:
    """A Mamba2 layer's widths as planc.compiler.ssm_memory names them (`mamba2_layer` stores them as a linear
    attention's: B/C groups as key heads, d_state as the key width)."""
    return dict(heads=lin.value_heads, head_dim=lin.value_dim, d_state=lin.key_dim, groups=lin.key_heads,
                chunk=lin.chunk)


def linear_prefill(s: LayerShape, a: int, batch: int, seq: int) -> int:
    """Bytes a linear-attention layer's prefill allocates at its peak, without its kernels."""
    lin = s.linear
    if lin is None:
        return 0
    if lin.scan == "mamba2":
        return ssm_memory.mamba2_prefill_bytes(**_mamba2_widths(lin), batch=batch, seq=seq, a=a)
    return batch * seq * _linear_work(s, a)


def linear_saved(s: LayerShape, a: int, batch: int, seq: int) -> int:
    """Bytes a linear-attention layer's scan keeps for backward, without its kernels: Mamba2's from its code
    (planc.compiler.ssm_memory); the chunk rules' fp32 intermediates and their per-chunk products, about twice their
    forward work (read off the grid's Qwen3-Next training point, docs/memory.md)."""
    lin = s.linear
    if lin is None:
        return 0
    if lin.scan == "mamba2":
        return ssm_memory.mamba2_saved_bytes(**_mamba2_widths(lin), batch=batch, seq=seq, a=a)
    if lin.scan == "short_conv":
        # what the products and projections read in backward: in_proj's B, C, x (one [tokens, 3 x hidden]), B * x (the
        # conv's input), the conv's output (C times it) and y (out_proj's input), all in the model dtype
        return batch * seq * SHORT_CONV_WIDTHS * a * lin.value_heads
    if lin.scan == "chunk_per_key":
        # `chunk_kimi_delta_attention` keeps its three per-key chunk tensors (the decay mask, `k_beta * key * decay`
        # and every chunk's `q_i * k_i * decay`), and about 34 fp32 [tokens, heads, key_dim]: the fp32 casts and
        # l2 norms, the padded and beta-weighted copies, the cumulative decay, the per-chunk inter/intra terms and
        # state updates, the forget gate's and the gated output norm's fp32 work (Ling's hybrid layer at 1 x 256
        # tokens kept 919 MiB, the rule 920)
        per_key = 3 * lin.value_heads * CHUNK * lin.key_dim
        return batch * seq * (FP32 * (34 * lin.value_heads * lin.key_dim + per_key) + _linear_io(lin, a))
    return 2 * batch * seq * _linear_work(s, a)


def relative_extent(config: Mapping[str, Any], layer_type: str) -> int:
    """The distances a layer's relative-position bias covers: Inkling's sliding layers (`hybrid_sliding`) their window,
    the others `rel_extent`."""
    sliding = layer_type.endswith("sliding") or layer_type in _WINDOWED
    return int(_get(config, "sliding_window_size", "sliding_window") if sliding else _get(config, "rel_extent"))


def relative_bias_bytes(s: LayerShape, batch: int, seq: int, a: int) -> int:
    """A dense relative-position bias in a prefill: the [B, heads, S, extent] logits, their gather to [B, heads, S, S]
    and its masked copy, at once, beside the [S, S] int64 distances, their clamp (the gather's index, expanded over
    the batch and heads as a view) and the boolean out-of-range mask the masked fill reads."""
    if not s.relative_extent:
        return 0
    return batch * s.heads * seq * (s.relative_extent + 2 * seq) * a + seq * seq * (2 * 8 + 1)


def relative_bias_held(s: LayerShape, batch: int, seq: int, a: int) -> int:
    """What a dense relative-position bias holds once it has returned (Inkling's and Inkling 2's attention forward
    binds it as `position_bias` through the kernel): the masked [B, heads, S, S] bias in the model dtype and the
    [S, S] int64 distances the model built for the layer's kind. Its logits, gather index and out-of-range mask are
    freed on return: eager's S x S scores come after them (`relative_bias_bytes` is its own moment)."""
    if not s.relative_extent:
        return 0
    return batch * s.heads * seq * seq * a + seq * seq * 8


def residual_blocks(config: Mapping[str, Any], layers: int) -> int:
    """The block states a block attention residual has stacked by the last layer (Inkling 2's text model: the layer
    input of every `n_layers_per_attn_res_block`-th layer, from the first)."""
    per_block = int(_get(config, "n_layers_per_attn_res_block", default=1) or 1)
    return -(-layers // per_block)


def layer_config(config: Mapping[str, Any], index: int) -> Mapping[str, Any]:
    """Layer `index`'s config: the model's with the layer's own values where the config is heterogeneous
    (transformers' `per_layer_config`, keyed by the layer's index: dots.llm3's sliding layers run 64 heads of
    192 + 64 over a 1024 latent where its indexed layers run 128 of 128 + 64 over 512)."""
    own = next((v for k, v in (config.get("per_layer_config") or {}).items()
                if str(k).isdigit() and int(k) == index), None)
    return {**config, **own} if own else config


def _attention_head_dims(walk: ModelWalk) -> dict[str, int]:
    """Layer path -> the head width its attention module computes with (the module's `head_dim`), where a family
    sets it per layer (Gemma 4's `per_layer_config`); a layer whose module does not say is absent."""
    return {fqn.rpartition(".")[0]: m.head_dims[0] for fqn, m in walk.modules.items() if m.head_dims and m.head_dims[0]}


def _attention_kv_widths(walk: ModelWalk) -> dict[str, int]:
    """Layer path -> the width of its attention's `k_proj` (key heads x head width, the whole model's), where a layer
    type has key heads of its own (Inkling's `swa_num_key_value_heads`): the config's `num_key_value_heads` names only
    one kind. Read from the parameter's shape; a layer without a `k_proj` weight is absent."""
    out = {}
    for fqn, m in walk.modules.items():
        if m.head_dims:
            weight = walk.params.get(f"{fqn}.k_proj.weight")
            if weight is not None and len(weight.shape) == 2:
                out[fqn.rpartition(".")[0]] = weight.shape[0]
    return out


def _top_k(walk: ModelWalk, config: Mapping[str, Any]) -> int:
    """Experts per token from the decoder's config: its object first, whose `attribute_map` resolves a family's own
    name (ERNIE 4.5's `moe_k`), which the config's dict does not carry."""
    value = getattr(_text_config_object(walk), "num_experts_per_tok", None)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return int(_get(config, "num_experts_per_tok", default=1))


def _layer_index(fqn: str) -> tuple[int, ...]:
    return tuple(int(p) for p in fqn.split(".") if p.isdigit())


def _norm(width: int, a: int) -> int:
    """A transformers RMSNorm in a 16-bit model: the fp32 upcast and the cast back (kept for backward), per token."""
    return (FP32 + a) * width + FP32


def eager_scores(s: LayerShape, batch: int, seq: int, a: int) -> int:
    """One [B, heads, S, S] score tensor of eager attention (S + 1 columns with a sink), in the model dtype; 0 for
    kernels that never materialise the scores (sdpa's flash and efficient paths, flex, flash-attention)."""
    if s.attn_impl != "eager" or s.attention in ("linear", "none"):
        return 0
    compressed = seq // s.compress_rate if s.compress_rate else 0  # DeepSeek-V4's compressed entries join the keys
    return batch * s.heads * seq * (seq + compressed + (1 if s.sinks else 0)) * a


def _repeat_kv(s: LayerShape, tokens: int, a: int) -> int:
    """eager's repeat_kv: K and V copied to every query head (nothing when there are as many K/V heads)."""
    if s.attn_impl != "eager" or s.kv_heads >= s.heads or s.attention != "gqa":
        return 0
    return 2 * tokens * s.heads * s.head_dim * a


SHORT_CONV_WIDTHS = 6  # [tokens, hidden] tensors a short-convolution layer holds at once (and keeps for backward)
CHUNK = 64  # the chunk length of transformers' torch chunk rules (gated delta rule, KDA)


def _linear_io(lin: LinearAttention, a: int) -> int:
    """Per token, a linear-attention layer's projections and conv in the model dtype."""
    return a * (2 * lin.conv_channels + 2 * lin.value_heads * lin.value_dim)


def _linear_work(s: LayerShape, a: int) -> int:
    """Bytes per token of a gated-delta-rule layer's prefill without the fla kernels (transformers'
    `torch_chunk_gated_delta_rule`): fp32 q, k, v, their beta-weighted and padded copies and the per-chunk outputs
    at the value heads (~10 [tokens, value heads, key dim]), three [64 x 64] chunk matrices per head and token, and
    the projections and conv in the model dtype."""
    lin = s.linear
    if lin is None:
        return 0
    if lin.scan == "short_conv":
        # at out_proj: in_proj's [tokens, 3 x hidden] (B, C and x are views of it), the conv's output, C times it and
        # its contiguous copy (y), in the model dtype; B * x is freed once the conv has read it
        return SHORT_CONV_WIDTHS * a * lin.value_heads
    io = _linear_io(lin, a)
    if lin.scan == "mamba":
        # the slow path's discretized A, B and B*u (three fp32 [tokens, d_inner, d_state]) and about ten
        # [tokens, d_inner] in the model dtype: in_proj's hidden and gate, the conv and its activation, the time step
        # and its softplus, the per-token scan outputs and their stack, the D residual, the gated output
        return FP32 * 3 * lin.value_heads * lin.key_dim + a * 10 * lin.value_heads
    # three chunk matrices per head; with a per-key decay (`torch_chunk_kda`) each carries the key width: the decay
    # mask and the two products of `-(k_beta * key * decay_mask).sum(-1)` are live at once
    chunk = 3 * lin.value_heads * CHUNK * (lin.key_dim if lin.scan == "chunk_per_key" else 1)
    return FP32 * (10 * lin.value_heads * lin.key_dim + chunk) + io


def layer_saved(s: LayerShape, hidden: int, a: int, tokens: int, rows: int, tp: int, fam: FamilyMemory,
                batch: int) -> int:
    """Bytes one layer keeps for backward at `tokens` tokens (`rows` routed rows received, MoE layers)."""
    t = tokens
    seq = t // max(batch, 1)
    # attention: input norm + its output (the projections' input); a gated residual's mixer in the norm's place
    mixer = s.stream_mixer
    norm = hyper_connection_memory.mixer_saved(mixer, hidden, a) if mixer and mixer.replaces_norms else _norm(hidden, a)
    n = t * (norm + a * hidden)
    if s.attention == "mla":
        # q_a -> norm -> q_b, kv_a -> norm -> kv_b, the rope'd q/k, sdpa's q, k, v, out and logsumexp
        n += t * (a * s.q_lora + _norm(s.q_lora, a) + a * s.q_lora)
        n += t * (a * (s.kv_lora + 64) + _norm(s.kv_lora, a) + a * s.kv_lora)
        if s.sdpa_math:  # its fp32 q, k and v (attention_memory.sdpa_math_kept) and the output, twice
            n += t * attention_memory.mla_math_kept(s, a)
        elif s.attn_impl != "sdpa":
            n += t * (a * (3 * s.q + 3 * s.k + s.v + 2 * s.v) + FP32 * s.heads)
        else:
            n += t * attention_memory.mla_efficient_kept(s, a)
        if s.attn_impl == "eager":  # the probabilities the output matmul keeps (HY-V4: with a sink), the max's indices
            elements = eager_scores(s, batch, seq, 1)
            n += elements * a + attention_memory.eager_kept_fp32(elements, t, s, fam) + (t * 8 * s.heads if s.sinks else 0)
    elif s.attention == "none":  # a one-mixer MLP block: its norm and the mixer's input only
        pass
    elif s.attention == "linear":
        n += linear_saved(s, a, batch, seq)
    elif s.attn_impl == "eager":
        # q, k, v after rotary, the probabilities the output matmul keeps, K and V repeated to every head, the
        # argmax indices of the sink's max subtraction (int64 per head and token)
        elements = eager_scores(s, batch, seq, 1)
        n += t * a * (2 * s.q + 4 * s.k) + elements * a + _repeat_kv(s, t, a)
        n += attention_memory.eager_kept_fp32(elements, t, s, fam)
        n += t * 8 * s.heads if s.sinks or fam.eager_max_subtracted else t * FP32 * s.heads * seq
    else:
        n += t * (a * (2 * s.q + 4 * s.k) + FP32 * s.heads)
        n += attention_memory.sdpa_repeated_kv(s, batch, seq, a)
    if s.sdpa_math:
        n += attention_memory.sdpa_math_kept(s, batch, seq)
    if fam.full_width_qk_norm or fam.per_head_qk_norm_kept:  # the norms' fp32 upcast and cast back
        # (the fp32 normalized states in place of the cast where the weight multiplies them: qk_norm_weight_fp32)
        n += t * (FP32 + (FP32 if fam.qk_norm_weight_fp32 else a)) * (s.q + s.k)
    residual = 2 * t * hidden * (FP32 + a) if fam.residual_fp32 else 0
    if fam.residual_short_conv and s.attention not in ("linear", "none"):  # each conv's fp32 input, for its weight
        n += t * FP32 * (2 * hidden + s.k + s.v)
    if fam.complex_rope_fp32 and s.attention != "linear":
        n += t * FP32 * (s.q + s.k)
    if fam.qk_norm_fp32 and s.attention not in ("linear", "none"):
        n += t * qk_norm_fp32_kept(s)
    n += indexer_memory.saved_mask_bytes(batch, seq, s.indexer_heads)
    n = n * s.attentions + residual  # each attention sublayer keeps as much (LongCat-Flash's two)
    # MLP: its input norm + output (a one-mixer block has one norm, counted above), one per attention sublayer
    if s.mlp != "none" and s.attention != "none":
        n += t * (norm + a * hidden) * s.attentions
        n += t * family_norms_kept(fam, hidden, a)
    if mixer is not None:  # each sublayer's mixer (beside its norm) and its output, spread over the streams
        per_sublayer = hyper_connection_memory.output_saved(mixer, hidden, a)
        if not mixer.replaces_norms:
            per_sublayer += hyper_connection_memory.mixer_saved(mixer, hidden, a)
        n += t * per_sublayer * ((s.attentions if s.attention != "none" else 0) + (1 if s.mlp != "none" else 0))
    if s.mlp == "none":
        pass
    elif s.mlp == "dense":
        n += t * 4 * a * s.intermediate + t * swiglu_fp32_kept(fam, s.intermediate)
        n += t * clamped_gate_kept(fam, s.intermediate, a)
    else:
        e, k = s.num_experts, s.top_k
        n += t * (FP32 * e + 8 * k + FP32 * k + FP32)  # router softmax, top-k ids and weights
        if fam.router_input_fp32:
            n += t * FP32 * hidden
        # the tokens whose weighted expert outputs this rank keeps: every token where it runs every token's slots
        # (AllReduceEP, or a slice of every expert under moe_tp_experts), else its 1/tp share
        per_rank = t if s.all_slots or s.tp_experts else -(-t // tp)
        if s.dense_dispatch:  # every token to every expert: the repeated input and its weighted copy
            n += 2 * e * t * a * hidden
            rows = max(rows, s.local_experts * per_rank)
        width = s.expert_hidden or hidden
        n += rows * a * (width + 4 * s.moe_intermediate) + per_rank * k * a * width
        if fam.expert_output_norm_fp32:  # the norm's fp32 input, normalized rows and weight it multiplies by
            n += rows * 3 * FP32 * width
        if width != hidden:  # the projection to the experts' width: its output's norm, the experts' in- and output
            n += t * (_norm(width, a) + 2 * a * width)
        n += t * 4 * a * s.shared
        n += rows * swiglu_fp32_kept(fam, s.moe_intermediate) + t * swiglu_fp32_kept(fam, s.shared)
        n += rows * clamped_gate_kept(fam, s.moe_intermediate, a) + t * clamped_gate_kept(fam, s.shared, a)
        # the dense MLPs beside the experts (LongCat-Flash's): gate, up, activation and product, like a dense layer's
        n += sum(t * (4 * a * w + swiglu_fp32_kept(fam, w) + clamped_gate_kept(fam, w, a)) for w in s.mlps_beside)
    return n


def qk_norm_fp32_kept(s: LayerShape) -> int:
    """Bytes per token training keeps where q_norm/k_norm per head compute in fp32 to the scale (family_memory's
    `qk_norm_fp32`: `x.float()`, normalized, times `1 + weight.float()`, cast back): the fp32 input the square reads
    and the fp32 normalized states the weight's product reads, of q and of k."""
    return 2 * FP32 * (s.q + s.k)


def clamped_gate_kept(fam: FamilyMemory, width: int, a: int) -> int:
    """Bytes per row training keeps beyond SwiGLU's four [rows, width] where the gate is GPT-OSS's clamped one
    (family_memory's `clamped_swiglu`): the clamps read the gate/up output (two widths), then the clamped gate, the
    sigmoid, `up + 1`, the GLU and the product down_proj reads: seven widths in place of four."""
    return 3 * a * width if fam.clamped_swiglu else 0


def family_norms_kept(fam: FamilyMemory, hidden: int, a: int) -> int:
    """Bytes per token a layer's norms keep beyond the input and MLP norms `layer_saved` counts: a sandwich layer's
    two more norms over the hidden (after the attention and after the MLP), and, where the norm's weight multiplies
    the fp32 normalized states (`(weight * x).to(dtype)`), that fp32 product's input in place of the model dtype's,
    in each norm."""
    norms = 2 + (2 if fam.sandwich_norms else 0)
    extra = 2 * (_norm(hidden, a) + a * hidden) if fam.sandwich_norms else 0
    return extra + (norms * (FP32 - a) * hidden if fam.norm_weight_fp32 else 0)


def swiglu_fp32_kept(fam: FamilyMemory, width: int) -> int:
    """Bytes per row training keeps beyond the model dtype's gate/up/activation where the family evaluates SwiGLU in
    fp32 (`act_fn(gate.float()) * up.float()`): the fp32 gate the activation's backward reads, the fp32 activation
    and up the product's backward reads."""
    return 3 * FP32 * width if fam.swiglu_fp32 else 0


def softcapped_logits_kept(config: Mapping[str, Any], a: int, in_fp32: bool = True) -> int:
    """Bytes per (token, vocab entry) a soft-capped head adds to training's loss (`final_logit_softcapping`:
    `tanh(logits.float() / cap) * cap`, as Gemma 2-4, Beam and Muse Spark run it): tanh's fp32 output, kept for its
    backward, and the logits the forward returns in fp32 instead of the model dtype."""
    if not _get(config, "final_logit_softcapping"):
        return 0
    # a family whose soft-capping runs in the model dtype (family_memory's `logit_softcap_fp32` off: Mistral Large 4's
    # `tanh(logits / cap) * cap` on the model-dtype logits): tanh's output in the model dtype, the logits unchanged
    return 2 * FP32 - a if in_fp32 else a


def routed_rows(tokens: int, tp: int, top_k: int, capacity_factor: float) -> int:
    return math.ceil(-(-tokens // tp) * top_k * capacity_factor)


def peak_memory(
    compiled: CompiledPlan,
    walk: ModelWalk,
    config: Mapping[str, Any],
    train: Optional[TrainMemory],
    *,
    workload: str,
    batch: int,
    seq: int,
    capacity_factor: float = 1.0,
    device_memory: Optional[int] = None,
    reserve: int = DEFAULT_RESERVE,
    search: Optional[str] = None,
    optimizer: Optional[str] = None,
    device_type: str = "cuda",
    capability: Optional[tuple[int, int]] = None,
) -> PeakMemory:
    """The peak for `workload` ("train" needs `train`, the held model states) at `batch` x `seq`; with
    `device_memory`, the largest batch (`search="batch"`) or sequence (`search="seq"`) that fits. `optimizer`: how
    AdamW steps (`planc.compiler.optimizer_step.STEPS`); None: the step torch takes on `device_type` (on CUDA the one
    the plan leads it to, on CPU the for-loop). On `cuda` the cuBLAS workspaces of a card of `capability` (None:
    not known, the larger sm_90 rule) count too (`planc.compiler.devices.cuda_workspaces`)."""
    config = text_config(config)
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device_type {device_type!r}: one of {', '.join(DEVICE_TYPES)}")
    if optimizer is None and device_type == "cpu":
        optimizer = "for-loop"  # torch has no foreach kernels on CPU
    if optimizer is None:
        optimizer = train.step.step if train is not None and train.step is not None else "foreach"
    if optimizer not in STEPS:
        raise ValueError(f"optimizer {optimizer!r}: one of {', '.join(STEPS)}")
    known: dict[int, list[LayerShape]] = {}

    def shapes_of(itemsize: int) -> list[LayerShape]:  # once per search, not once per batch it tries
        if itemsize not in known:
            known[itemsize] = attention_memory.with_sdpa_math(layer_shapes(compiled, walk, config, itemsize),
                                                              device_type)
        return known[itemsize]
    workspaces = cuda_workspaces(capability, workload) if device_type == "cuda" else 0

    def peak_at(b: int, s: int) -> PeakMemory:
        return _peak(compiled, walk, config, train, workload, b, s, capacity_factor, optimizer, shapes_of, workspaces)

    best = peak_at(batch, seq)
    max_batch = max_seq = None
    if device_memory is not None and best.validated:  # no largest batch where no verdict is given
        budget = device_memory - reserve
        if search in ("batch", None):
            max_batch = _largest(lambda b: peak_at(b, seq).peak, budget, 1 << 20)
        if search == "seq":
            limit = int(_get(config, "max_position_embeddings", default=1 << 20) or 1 << 20)
            max_seq = _largest(lambda s: peak_at(batch, s).peak, budget, max(limit, 1))
    return replace(best, device_memory=device_memory, reserve=reserve, max_batch=max_batch, max_seq=max_seq,
                   adamw_step=optimizer if workload == "train" else None)


def _largest(peak_at: Callable[[int], int], budget: int, limit: int) -> int:
    """The largest n in [1, limit] with peak_at(n) <= budget (peaks grow with n), 0 when even 1 does not fit."""
    if peak_at(1) > budget:
        return 0
    lo, hi = 1, 2
    while hi <= limit and peak_at(hi) <= budget:
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if peak_at(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


class _Moment(NamedTuple):
    """The peak moment of one workload: its name, bytes, what is counted, the transients, the KV cache."""

    moment: str
    total: int
    breakdown: list[tuple[str, int]]
    transients: list[tuple[str, int]]
    kv: list[tuple[str, int]]
    moments: list[tuple[str, int]]


def _peak(compiled: CompiledPlan, walk: ModelWalk, config: Mapping[str, Any], train: Optional[TrainMemory],
          workload: str, batch: int, seq: int, capacity_factor: float, optimizer: str,
          shapes_of: Callable[[int], list[LayerShape]], workspaces: int = 0) -> PeakMemory:
    p = compiled.parallel
    tp, ep = p.tp_size, p.ep_size
    dtypes = dict(compiled.bytes_per_rank_by_dtype)
    dtype = max(dtypes, key=lambda d: dtypes[d]) if dtypes else "bfloat16"
    if train is not None and train.param_dtype:
        dtype = train.param_dtype
    a = ITEMSIZE.get(dtype, 2)
    hidden = int(config["hidden_size"])
    vocab = head_width(walk, config)
    shapes = shapes_of(a)
    tokens = batch * seq
    top_k = max((s.top_k for s in shapes), default=0)
    rows = routed_rows(tokens, tp, top_k, capacity_factor) if ep > 1 else tokens * top_k
    worst_rows = min(rows * ep, ep * -(-tokens // tp) * top_k) if ep > 1 else rows
    ckpt = compiled.training.activation_checkpointing if compiled.training is not None else "none"
    fam = family_memory(walk.model_type)
    hc = deepseek_v4_memory.hyper_connections(config)
    notes = []
    unpriced = list(fam.unpriced) + unpriced_features(compiled, walk, config, shapes)
    # serving with EP over the TP group runs all_reduce (every rank, every slot: no routing assumption); else the
    # all_to_all moves the routed rows and the balanced-load assumption applies
    routed = workload == "train" or ep > tp
    if workload == "train" and any(s.all_slots for s in shapes):  # AllReduceEP: no routing assumption
        routed = False
        notes.append("EP all_reduce: each rank runs its experts over every token's top-k slots, in training too, "
                     "whatever the routing")
    if workload == "train":
        if train is None:
            raise ValueError("peak_memory: a training workload needs the model states (train_memory)")
        softcap = softcapped_logits_kept(config, a, fam.logit_softcap_fp32) * batch * seq * vocab
        best = _train_peak(train, shapes, hidden, vocab, a, batch, seq, rows, tp, ckpt, fam, optimizer, hc, softcap)
        worst = _train_peak(train, shapes, hidden, vocab, a, batch, seq, worst_rows, tp, ckpt, fam, optimizer, hc,
                            softcap)
    else:
        params = compiled.bytes_per_rank - _fp4_saving(compiled, shapes, hidden, a)
        buf, work, mm_notes, mm_unpriced = _megamoe(compiled.experts_settings.megamoe, shapes, hidden, tokens, ep)
        notes.extend(mm_notes)
        unpriced.extend(mm_unpriced)
        streams = hc.streams if hc is not None else 1
        blocks = residual_blocks(config, len(shapes)) if fam.block_residual_inputs else 0
        best = _serve_peak(params, shapes, hidden, vocab, a, batch, seq, rows, tp, ep, fam, (buf, work), streams,
                           blocks)
        worst = _serve_peak(params, shapes, hidden, vocab, a, batch, seq, worst_rows, tp, ep, fam, (buf, work),
                            streams, blocks)
        notes.append("KV cache as transformers' DynamicCache holds it after prefill (no paged or quantized cache)")
        if top_k and not routed:
            notes.append("EP at inference over the TP group runs all_reduce: each rank runs its experts over every "
                         "token's top-k slots, whatever the routing")
    if workspaces:  # held from the first matmul of each thread to the end: at every moment
        best = _with_workspaces(best, workspaces)
        worst = _with_workspaces(worst, workspaces)
    moment, total, breakdown, transients, kv, moments = best
    return PeakMemory(
        workload=workload, batch=batch, seq=seq, peak=total, moment=moment, breakdown=tuple(breakdown),
        moments=tuple(moments), transients=tuple(sorted(transients, key=lambda kv: -kv[1])),
        kv_cache=tuple(kv), routed_rows=rows if top_k and routed else 0,
        routed_rows_worst=worst_rows if top_k and routed else 0,
        worst_case_peak=worst[1], capacity_factor=capacity_factor, checkpointing=ckpt, notes=tuple(notes),
        unpriced=tuple(unpriced), validated=fam.measured,
    )


WORKSPACES = "cuBLAS workspaces (CUDA)"
# where the workload runs: `cuda` prices torch's CUDA default AdamW step and cuBLAS workspaces, `cpu` (the CPU grid
# and `planc verify --memory`, which run on CPU) the for-loop step and no workspaces
DEVICE_TYPES = ("cuda", "cpu")


def _with_workspaces(m: _Moment, workspaces: int) -> _Moment:
    """The moment with the cuBLAS workspaces added to its total, its breakdown and every moment considered."""
    return m._replace(total=m.total + workspaces, breakdown=[*m.breakdown, (WORKSPACES, workspaces)],
                      moments=[(name, n + workspaces) for name, n in m.moments])


# what the model prices: attention kernels (flash-attention and flex never hold the S x S scores, priced as sdpa),
# and the layer types whose cache it knows
_PRICED_ATTENTION = {"sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3", "paged_attention"}
_PRICED_LAYER_TYPES = {"full_attention", "linear_attention", indexer_memory.INDEXED, *_WINDOWED}


def unpriced_features(compiled: CompiledPlan, walk: ModelWalk, config: Mapping[str, Any],
                      shapes: list[LayerShape]) -> list[str]:
    """What this model runs that the peak does not price, each with what planc counts in its place (on the high
    side): an attention kernel it does not know, a layer type whose cache it does not know."""
    out = []
    impl = shapes[0].attn_impl if shapes else "sdpa"
    if impl not in _PRICED_ATTENTION:
        out.append(f"attention implementation `{impl}` (priced as eager: S x S scores in the model dtype)")
    own = dict(family_memory(walk.model_type).layer_types)
    types = {own.get(t, t) for t in config.get("layer_types") or []}
    if deepseek_v4_memory.hyper_connections(config) is not None:
        if deepseek_v4_memory.CSA in types:
            out.append("DeepSeek-V4's compressed sparse attention layers (CSA compressor, Lightning indexer's fp32 "
                       "scores): priced from transformers' code in training and as eager S x S scores and a "
                       "full-attention cache in a prefill, not measured (the grid's layers are HCA)")
        types -= {deepseek_v4_memory.CSA, deepseek_v4_memory.HCA}
    passes, first = int(config.get("loop_num_passes") or 1), config.get("loop_layer_index_start")
    if passes > 1 and first is not None and int(first) < int(config.get("num_hidden_layers") or 0):
        out.append(f"looped layers (from layer {first}, run {passes} times: a KV cache and conv states per pass, "
                   "an fp32 loop gate): priced as one pass")
    odd = sorted(t for t in types if t not in _PRICED_LAYER_TYPES)
    if odd:
        out.append(f"layer types {', '.join(odd)}: their caches and kernels are priced as full attention, with an fp32 "
                   "copy of q/k/v and of both residual branches in a prefill (on the safe side)")
    return out


def _train_peak(train: TrainMemory, shapes: list[LayerShape], hidden: int, vocab: int, a: int, batch: int, seq: int,
                rows: int, tp: int, ckpt: str, fam: FamilyMemory, optimizer: str,
                hc: Optional[HyperConnectionLayer] = None, softcap: int = 0) -> _Moment:
    recomputes = ACTIVATION_CHECKPOINTING_MODES[ckpt].recomputes_layers
    params, grads, optim = train.parameter_bytes, train.gradients, train.optimizer
    tokens = batch * seq

    def rows_of(s: LayerShape) -> int:  # AllReduceEP runs every slot on every rank, else the routed rows
        return 0 if s.mlp != "moe" else tokens * s.top_k if s.all_slots else rows

    mixer = next((s.stream_mixer for s in shapes if s.stream_mixer is not None), None)
    if mixer is not None:  # streams around the common layer (HY-V4): priced with it, not as DeepSeek-V4's layer
        hc = None
    if hc is not None:  # DeepSeek-V4's layer (planc.compiler.deepseek_v4_memory)
        saved_layers = [deepseek_v4_memory.layer_saved(
            hc, layer_type=s.layer_type, compress_rate=s.compress_rate, hidden=hidden, a=a, tokens=tokens, seq=seq,
            heads=s.heads, head_dim=s.head_dim, rows=rows_of(s), moe_intermediate=s.moe_intermediate,
            shared=s.shared, experts=s.num_experts)
            # a hyper-connection layer whose mixer is linear attention (GLM-5-Next) keeps its scan's work too
            + linear_saved(s, a, batch, seq) for s in shapes]
        head = deepseek_v4_memory.head_saved(hc, hidden, a, tokens)
    else:
        saved_layers = [layer_saved(s, hidden, a, tokens, rows_of(s), tp, fam, batch) for s in shapes]
        head = tokens * (_norm(hidden, a) + a * hidden)  # final norm + lm_head input
        if mixer is not None:  # the final mixer, in the final norm's place (a gated residual) or before it
            head += tokens * hyper_connection_memory.mixer_saved(mixer, hidden, a)
            head -= tokens * _norm(hidden, a) if mixer.replaces_norms else 0
        head += tokens * (FP32 - a) * hidden if fam.norm_weight_fp32 else 0  # its fp32 product with the weight
    if recomputes:
        # each layer's input (DeepSeek-V4: its hyper-connection streams); the rest is recomputed in backward
        kept = tokens * a * hidden * (hc.streams if hc is not None else mixer.streams if mixer else 1) * len(shapes)
        recompute = max(saved_layers, default=0)
    else:
        kept, recompute = sum(saved_layers), 0
    # log-softmax (kept), its gradient, the logits' gradient: fp32 [tokens, vocab]; a soft-capped head's fp32 chain
    loss = 3 * FP32 * tokens * vocab + softcap
    fsdp = train.shards
    gathered = (train.gathered_root + train.gathered_layer) if fsdp else 0
    if fsdp:
        prefetch, backward = _fsdp_backward(train)
    else:
        # two more copies of the largest parameter's gradient (the gradient on the local shard and its copy being
        # accumulated into `.grad`: what the CPU grid measures, docs/memory.md)
        prefetch = 0
        backward = 2 * train.largest_tensor
    moments = {
        "loss backward (fp32 logits and loss)": params + optim + kept + head + loss + gathered,
        # a layer recomputed in backward (activation checkpointing): every gradient but the input embedding's, which
        # backward reaches after the first layer
        "end of backward": params + grads + optim + max(backward, recompute - train.embedding_gradient),
        OPTIMIZER_STEP: params + grads + optim + foreach_copy(train, optimizer),
    }
    if not recomputes:
        linear_backward = _linear_backward(shapes, saved_layers, hidden, a, batch, seq)
        if linear_backward:  # every gradient but the embedding's counted (the layer's own are not computed yet)
            moments[LINEAR_BACKWARD] = params + optim + grads - train.embedding_gradient + linear_backward
    # the indexer's scores in an indexed layer's forward (in backward's recompute under activation checkpointing,
    # every gradient but the embedding's counted)
    indexed_before, indexed_work = _indexer_forward(shapes, saved_layers, hidden, a, batch, seq, tp, fam,
                                                    kept if recomputes else 0)
    indexed_grads = grads - train.embedding_gradient if recomputes else 0
    if indexed_work:
        moments[INDEXER_FORWARD] = params + optim + indexed_grads + gathered + indexed_before + indexed_work
    if fsdp:
        # lm_head's backward: the gradients of the log-softmax and of the logits (fp32) and the logits' gradient cast
        # to the compute dtype, while FSDP2 all-gathers the next unit to run backward (its buffer: one unit)
        moments[LAST_LAYER_BACKWARD] = (params + optim + kept + head + (2 * FP32 + a) * tokens * vocab + softcap + gathered
                                        + prefetch)
    moment = max(moments, key=lambda m: moments[m])
    forward_side = moment in ("loss backward (fp32 logits and loss)", LAST_LAYER_BACKWARD)
    if moment == INDEXER_FORWARD:  # the activations so far, the gradients only in a recompute
        breakdown = [("parameters", params), ("gradients", indexed_grads), ("optimizer state", optim),
                     ("activations kept for backward", indexed_before),
                     ("transient at the peak", gathered + indexed_work)]
        transients = [(INDEXER_FORWARD, indexed_work), ("fp32 logits and loss", loss)]
        return _Moment(moment, moments[moment], breakdown, transients, [], list(moments.items()))
    breakdown = [("parameters", params), ("gradients", 0 if forward_side else grads),
                 ("optimizer state", optim),
                 ("activations kept for backward", kept + head if forward_side else 0)]
    transients = [("fp32 logits and loss", loss)]
    if LINEAR_BACKWARD in moments:
        transients.append((f"{LINEAR_BACKWARD}: the activations still kept and the scan's backward",
                           moments[LINEAR_BACKWARD] - params - optim - grads))
    if indexed_work:
        transients.append((INDEXER_FORWARD, indexed_work))
    if optimizer != "fused":
        transients.append((f"AdamW {optimizer} step: exp_avg_sq's square root", foreach_copy(train, optimizer)))
    if fsdp:
        transients.append(("FSDP all-gathered root and layer", gathered))
    if recomputes:
        transients.append(("one layer recomputed (activation checkpointing)", recompute))
    if fsdp:
        transients.append(("FSDP lm_head backward: logits' gradients and one unit's all-gather prefetched",
                           moments[LAST_LAYER_BACKWARD] - params - optim - kept - head))
        transients.append(("FSDP backward: root, the largest unit gathered, its gradients and a reduce-scatter, "
                           "the rest of its layer", backward))
    else:
        transients.append(("the largest parameter's gradient, computed then accumulated", backward))
    at = moments[moment] - params - optim - (kept + head if forward_side else grads)
    breakdown.append(("transient at the peak", at))
    return _Moment(moment, moments[moment], breakdown, transients, [], list(moments.items()))


LAST_LAYER_BACKWARD = "lm_head backward (FSDP prefetch)"
INDEXER_FORWARD = "forward, sparse attention indexer (fp32 scores)"


def _indexer_forward(shapes: list[LayerShape], saved: list[int], hidden: int, a: int, batch: int, seq: int, tp: int,
                     fam: FamilyMemory, inputs: int) -> tuple[int, int]:
    """An indexed layer's forward in training: (the activations the layers before it keep, or `inputs`, every
    layer's input, under activation checkpointing; its own attention's kept activations and its indexer's peak). The
    indexer runs without grad, as in a prefill (planc.compiler.indexer_memory): at long sequences or batch > 1 its
    fp32 scores and broadcast keys outgrow the loss's fp32 logits. The attention's kept activations are counted whole
    (its output too, computed after the indexer: on the high side). The largest over the indexed layers; (0, 0)
    without one."""
    worst = (0, 0)
    for i, s in enumerate(shapes):
        if not s.indexer_heads:
            continue
        before = inputs if inputs else sum(saved[:i])
        own = layer_saved(replace(s, mlp="none"), hidden, a, batch * seq, 0, tp, fam, batch)
        work = own + indexer_memory.prefill_bytes(batch, seq, s.indexer_heads, s.indexer_dim, a, s.indexer_rope,
                                                  fam.indexer_rope_fp32)
        worst = max(worst, (before, work), key=sum)
    return worst
LINEAR_BACKWARD = "linear attention backward (Mamba2's gated norm, KDA's decay mask)"


def _linear_backward(shapes: list[LayerShape], saved: list[int], hidden: int, a: int, batch: int, seq: int) -> int:
    """Backward in a linear-attention layer, beyond the parameters, AdamW state and the gradients of the layers after
    it: the activations the layers before it keep, its own input norm's and scan's (its MLP has run backward and
    freed its part), and the scan's backward. A Mamba2 mixer at its gated norm: four fp32 `[tokens, d_inner]`, less
    the gradient of its `in_proj`, not computed yet (the grid's Granite MoE hybrid training peak). Kimi Delta
    Attention (`torch_chunk_kda`) at the backward of `k_beta * key * decay_mask`: the gradients of both factors, two
    per-key chunk tensors more, while both factors and `decay_mask`'s gradient summed over the chunks (accumulated
    in place) are held: the three per-key tensors kept count the product's factors and the chunks' `q_i * k_i`,
    freed by then, whose place the summed gradient takes. The largest over the model's layers; 0 without one."""
    worst, tokens = 0, batch * seq
    for i, s in enumerate(shapes):
        lin = s.linear
        if lin is None or lin.scan not in ("mamba2", "chunk_per_key"):
            continue
        own = tokens * (_norm(hidden, a) + a * hidden) + linear_saved(s, a, batch, seq)
        if lin.scan == "mamba2":
            inner = lin.value_heads * lin.value_dim
            conv = inner + 2 * lin.key_heads * lin.key_dim
            work = 4 * FP32 * tokens * inner - hidden * (inner + conv + lin.value_heads) * a
        else:
            work = 2 * FP32 * tokens * lin.value_heads * CHUNK * lin.key_dim
        worst = max(worst, sum(saved[:i]) + own + work)
    return worst


def foreach_copy(train: TrainMemory, optimizer: str) -> int:
    """AdamW's temporaries at its step (planc.compiler.optimizer_step says what torch allocates): foreach a copy of
    exp_avg_sq for each (device, dtype) group, the previous group's still bound; for-loop two copies of one
    parameter's, the previous parameter's quotient still bound; fused none."""
    if optimizer == "foreach":
        return train.foreach_step
    return train.for_loop_step if optimizer == "for-loop" else 0


def _fsdp_backward(train: TrainMemory) -> tuple[int, int]:
    """FSDP2's units in backward (planc.runtime.data_parallel wraps them): (the all-gather buffer of the unit
    prefetched while the one before it runs: the largest unit, backward's transient at the largest unit). A unit in
    backward holds its gathered parameters, its unsharded gradients and the reduce-scatter input of one unit (the
    largest), inside its layer's other units, still gathered; the root stays gathered from forward to the end.
    A layer of one unit (Mixtral) is three copies of it; a layer split into an attention unit, an EP experts unit
    over efsdp and an fp32 router unit (DeepSeek-V3) is three copies of its experts only."""
    if not train.units:  # no decoder layer found: the whole largest layer as one unit
        return train.gathered_layer, train.gathered_root + 3 * train.gathered_layer
    name, layer, largest = max(train.units, key=lambda u: u[2])
    rest = sum(n for u, lay, n in train.units if lay == layer and u != name)
    # an EP experts unit whose experts do not split evenly over efsdp: FSDP2 pads dim 0 and all-gathers into a buffer
    # of the padded rows, which the prefetch holds (Qwen3-VL-MoE, 15 experts over 2: 16/15 units, FSDPMemTracker's
    # ALL_GATHER at its fsdp peak). Where a rank holds less than one expert (Mixtral: 1 expert per EP rank over 2)
    # the unit copied out of it is live at the peak too (Mixtral: ALL_GATHER 2 units and one more UNSHARDED_PARAM)
    efsdp, local = max(train.efsdp_size, 1), train.local_experts
    if name != layer and train.experts_sharded and local % efsdp != 0:
        prefetch = largest * (-(-local // efsdp) * efsdp) // local + (largest if local < efsdp else 0)
    else:
        prefetch = largest
    return prefetch, train.gathered_root + 3 * largest + rest


def _masks(shapes: list[LayerShape], batch: int, seq: int, a: int) -> int:
    """The attention masks a forward builds once per layer type and keeps to its end: eager's [B, 1, S, S] in the
    model dtype; sdpa's boolean one for a sliding window the prefill outgrows, or for a model's indexer (full causal
    layers need none otherwise)."""
    out = 0
    for kind in {(s.attn_impl, s.cache_kind, s.window) for s in shapes if s.attention not in ("linear", "none")}:
        impl, cache_kind, window = kind
        if impl == "eager":
            out += batch * seq * seq * a
        elif cache_kind == "sliding window" and window is not None and seq >= window:
            out += batch * seq * seq
    if any(s.layer_type == indexer_memory.INDEXED and s.attn_impl == "sdpa" for s in shapes):
        out += indexer_memory.causal_mask_bytes(batch, seq)
    return out


def _fp4_saving(compiled: CompiledPlan, shapes: list[LayerShape], hidden: int, a: int) -> int:
    """Bytes the Mega MoE experts shed when the plan quantizes them to FP4 at apply (`megamoe.quantize: fp4`): the
    compiled plan counts them in the model dtype."""
    settings = compiled.experts_settings.megamoe
    if settings is None or settings.quantize != "fp4":
        return 0
    return sum(s.local_experts * 3 * hidden * s.moe_intermediate * a
               - megamoe_buffers.fp4_experts_bytes(s.local_experts, hidden, s.moe_intermediate)
               for s in shapes if s.megamoe)


def _megamoe(settings: Any, shapes: list[LayerShape], hidden: int, tokens: int,
             ep: int) -> tuple[int, int, list[str], list[str]]:
    """(the symmetric buffer every Mega MoE layer shares, one layer's work, notes, what is not priced) at `tokens`
    per rank; `auto` picks its backend by device, so both are priced and the larger counts."""
    moe = next((s for s in shapes if s.megamoe), None)
    if moe is None:
        return 0, 0, [], []
    backend = settings.backend if settings is not None else "auto"
    limit = settings.max_tokens_per_rank if settings is not None else None
    # MegaMoeEP hands each rank of the EP group (which shares the batch) its equal slice, ceil(T / ep) tokens
    # (planc.runtime.ep.megamoe); the slices' outputs are all-gathered back to T rows
    per_rank = -(-tokens // max(ep, 1))
    cap = megamoe_buffers.capacity(per_rank, limit)
    rows = per_rank if ep == 1 else min(megamoe_buffers.capacity(per_rank, None), cap)
    k, inter, local = moe.top_k, moe.moe_intermediate, moe.local_experts
    layers = sum(1 for s in shapes if s.megamoe)
    # Triton on Hopper may take its FP8 path (`experts.megamoe.math: auto`): priced where it may
    fp8 = (settings or MegaMoe()).math_row.fp8_layout
    deep = megamoe_buffers.deepgemm_symmetric_bytes(ep, moe.num_experts, cap, k, hidden, inter)
    ref = megamoe_buffers.reference_buffer_bytes(cap, k, hidden)
    # the Triton backend's buffer, and every layer's FP8-path layout of its experts (kept once made)
    triton = ref + (layers * megamoe_buffers.triton_fp8_layout_bytes(local, hidden, inter) if fp8 else 0)
    # a batch runs one path or the other: the larger work
    work = max(megamoe_buffers.triton_layer_bytes(ep, rows, local, k, hidden, inter, fp8=path)
               for path in ((False, True) if fp8 else (False,)))
    out = 2 * tokens * hidden * 2  # the layer's output and the combined rows (deep_gemm's own work is in its buffer)
    if backend == "deep_gemm":
        buf, work = deep, out
    elif backend == "auto":
        buf, work = max(deep, triton), max(work, out)
    elif backend == "reference":  # every layer's dequantized experts and the reference's per-slot work
        buf = ref + layers * megamoe_buffers.reference_experts_bytes(local, hidden, inter)
        work = megamoe_buffers.reference_layer_bytes(ep, rows, k, hidden, inter)
    else:
        buf = triton
    notes = [f"Mega MoE ({backend}): the symmetric buffer for {cap} tokens per rank"
             + (" (`max_tokens_per_rank` of the plan)" if limit is not None and per_rank <= limit else
                " (the next power of two: the batch exceeds the plan's `max_tokens_per_rank`)" if limit else "")
             + (", the larger of deep_gemm's and triton's (`auto` picks by device)" if backend == "auto" else "")]
    if fp8 and backend in ("triton", "auto"):
        notes.append("Mega MoE (triton): each layer's FP8-path layout of its experts, which Hopper makes once a batch "
                     "takes that path (`experts.megamoe.math: bf16` keeps one layout), and that path's work")
    unpriced = [] if backend == "reference" else [
        "Mega MoE's deep_gemm and Triton buffers: priced from DeepGEMM's sizing rule and planc's Triton buffer and "
        "layer work, not measured (the grid measures the reference backend)"]
    return buf, work, notes, unpriced


def _serve_peak(params: int, shapes: list[LayerShape], hidden: int, vocab: int, a: int, batch: int, seq: int,
                rows: int, tp: int, ep: int, fam: FamilyMemory, megamoe: tuple[int, int] = (0, 0),
                streams: int = 1, blocks: int = 0) -> _Moment:
    tokens = batch * seq
    symmetric, megamoe_work = megamoe
    kv: dict[str, int] = {}
    for s in shapes:
        # a sliding or chunked layer still holds all S tokens after the prefill (trimmed at the next update)
        held = s.linear.state_bytes(a) * batch if s.linear else batch * seq * s.cache
        if s.attention != "none":  # a one-mixer MLP block holds no cache
            kv[s.cache_kind] = kv.get(s.cache_kind, 0) + held
    cache = sum(kv.values())
    masks = _masks(shapes, batch, seq, a)
    if fam.residual_fp32:  # the residual stream in fp32 rather than the model dtype, through the forward
        masks += tokens * hidden * (FP32 - a)
    if fam.fp32_stream:  # the embedding output, the layer's input and its residual: fp32 rather than the model dtype
        masks += 3 * tokens * hidden * (FP32 - a)
    # a block attention residual (family_memory's block_residual_inputs): the stacked block states, alive through the
    # forward, and what a layer holds through its MLP beyond the model-dtype input, residual and MLP input priced
    # below: its fp32 attention-input mixes, its residual in fp32 and the MLP's fp32 mix
    masks += tokens * hidden * a * blocks
    block_mlp = tokens * hidden * (fam.block_residual_inputs * FP32 + 2 * FP32 - a) if fam.block_residual_inputs else 0
    transients = []
    if streams > 1:
        # hyper-connection streams [tokens, streams, hidden] in the model dtype (DeepSeek-V4, HY-V4): a layer's input,
        # which the decoder loop still holds, and the attention's post-mixed residual live through its MLP
        masks += 2 * tokens * a * streams * hidden
        # a mixer flattens the streams to fp32 and squares them for its norm (HY-V4's `input_norm`), then weights them
        # in fp32 (`pre * streams`): two fp32 copies besides the streams, a transient of its own
        transients.append(("hyper-connection mixer (fp32 streams)", 2 * tokens * FP32 * streams * hidden))
    for s in shapes:
        # the decoder layer binds what its attention returns (`hidden_states, _ = self.self_attn(...)`) until it
        # returns: eager's attention weights, one [B, heads, S, S(+1)] in the model dtype (gpt-oss's and MiMo's a view
        # of their softmax, Flint's and the privacy filter's its cast), alive through the layer's MLP
        kept_weights = eager_scores(s, batch, seq, a)
        if s.mlp == "moe":
            # all_reduce EP at inference: every rank runs its experts over all tokens' top-k slots: the slots'
            # gathered rows, the gate/up output and its masked copy (off-rank slots zeroed), the ids
            slots = rows if ep > tp else tokens * s.top_k  # ep > tp: all_to_all brings the routed rows
            # two stages, the larger counts: gate/up (the gathered rows, the gate/up output and its masked copy)
            # and the output (the rows again, the down output, both weighted in the routing weights' dtype: fp32
            # where the router keeps fp32 weights, planc.compiler.family_memory)
            weight = FP32 if fam.routing_weights_fp32 else a
            width = s.expert_hidden or hidden  # the rows the experts run on
            # a norm over each row's expert output in fp32 (family_memory's expert_output_norm_fp32): three fp32
            # rows at once beside the gathered input rows and the down output in the model dtype
            normed = (2 * a + 3 * FP32) * width if fam.expert_output_norm_fp32 else 0
            # an fp32 `_apply_gate` (family_memory's expert_gate_fp32): the gathered rows and the gate/up output in
            # the model dtype beside its fp32 [rows, moe_intermediate] tensors
            gate = (a * (width + 2 * s.moe_intermediate) + fam.expert_gate_fp32 * FP32 * s.moe_intermediate
                    if fam.expert_gate_fp32 else 0)
            if s.megamoe:
                work = megamoe_work
            elif s.dense_dispatch:
                # every token to every expert: the weighted [experts x tokens, hidden] input and the experts' output
                # of the same size; this rank's experts run on their tokens: the gathered rows, gate/up, its
                # masked copy, the activation, the down output
                work = 2 * tokens * s.num_experts * a * hidden
                work += tokens * s.local_experts * a * (2 * hidden + 5 * s.moe_intermediate)
            else:
                work = slots * max(a * (width + 4 * s.moe_intermediate), 2 * (a + weight) * width, normed, gate)
            if width != hidden:  # the experts' input at their own width, beside the MLP's input the layer holds
                work += tokens * a * width
            work += tokens * 8 * s.top_k * 3
            cause = "Mega MoE layer" if s.megamoe else "EP experts (all_reduce dispatch buffers)"
            transients.append((cause, work + tokens * a * hidden * 3 + kept_weights + block_mlp))
        elif s.mlp == "dense":
            transients.append(("dense MLP", tokens * a * (3 * s.intermediate + 3 * hidden) + kept_weights + block_mlp))
        if fam.residual_short_conv:
            # a residual branch's fp32 short convolution: its upcast, the conv's output and their sum, beside the
            # branch's output and the residual stream in the model dtype
            transients.append(("short convolution (fp32)", tokens * hidden * (3 * FP32 + 3 * a)))
        if s.linear is not None:
            attn = linear_prefill(s, a, batch, seq) + tokens * a * 3 * hidden
            what = {"mamba": "selective scan, fp32 states", "chunk_per_key": "delta rule, per-key decay, fp32 chunks",
                    "short_conv": "short convolution",
                    "mamba2": "Mamba2 chunked scan, fp32 chunks"}.get(s.linear.scan, "gated delta rule, fp32 chunks")
            transients.append((f"linear attention ({what})", attn))
            continue
        if s.attention == "none":
            continue
        if s.attention == "mla" and s.sdpa_math:
            attn = tokens * (attention_memory.mla_math_held(s, a) + a * 3 * hidden)
        else:
            attn = tokens * (a * (2 * s.q + 3 * s.k + 2 * s.v) + a * 3 * hidden)
        # a block attention residual's fp32 mixes feeding the attention (Inkling 2's full layers: query, key and value
        # each their own), each with its own norm's model-dtype output, alive through it (family_memory)
        attn += tokens * hidden * fam.block_residual_inputs * (FP32 + a)
        if s.layer_type not in _PRICED_LAYER_TYPES and s.attention != "linear":
            # a layer type planc does not know (flagged): on the safe side, an fp32 copy of its q/k/v and of both
            # residual branches (what Inkling's fp32 short convolutions on keys, values and the residuals hold)
            attn += tokens * FP32 * (s.q + s.k + s.v + 2 * hidden)
        if fam.full_width_qk_norm:
            attn += tokens * (FP32 + a) * (s.q + s.k)
        if fam.qk_norm_fp32:
            attn += tokens * 2 * FP32 * s.q
        if fam.complex_rope_fp32:
            attn += tokens * 2 * FP32 * (s.q + s.k)
        # eager builds its scores after the bias has returned: the bias's own peak is a moment before them
        bias = relative_bias_bytes(s, batch, seq, a)
        if eager_scores(s, batch, seq, 1) and bias:
            transients.append(("relative-position bias (dense logits, gather)", attn + bias))
            bias = relative_bias_held(s, batch, seq, a)
        attn += bias
        # an indexed layer's attention reads the picks as masks, built once its indexer has returned
        picks = (indexer_memory.attention_mask_bytes(batch, seq, a, s.attn_impl, s.sdpa_math)
                 if s.layer_type == indexer_memory.INDEXED else 0)
        elements = eager_scores(s, batch, seq, 1)
        if elements:
            # the family's [B, h, S, S(+1)] score tensors at once (gpt-oss: scores x scale + mask, the sink column
            # joined, the max subtracted, softmax: three in the model dtype); K and V repeated to every head
            transients.append(("eager attention (S x S scores)", attention_memory.eager_prefill(elements, a, fam)
                               + _repeat_kv(s, tokens, a) + attn + picks))
        elif s.sdpa_math:
            transients.append(("sdpa math path (fp32 S x S scores)",
                               attention_memory.sdpa_math_prefill(s, batch, seq) + attn + picks))
        else:
            repeated_kv = attention_memory.sdpa_repeated_kv(s, batch, seq, a)
            transients.append(("attention workspace", attn + picks + repeated_kv))
        if s.indexer_heads:
            # the indexer runs inside the attention, once its q/k/v are projected (the attention's workspace alive),
            # and its scores are freed before the attention's own: a transient beside the attention's, not on top
            transients.append(("sparse attention indexer (fp32 scores)",
                               indexer_memory.prefill_bytes(batch, seq, s.indexer_heads, s.indexer_dim, a,
                                                            s.indexer_rope, fam.indexer_rope_fp32) + attn))
    transients.append(("logits (last token)", batch * vocab * (a + FP32) * 2))
    worst = max(transients, key=lambda kv: kv[1]) if transients else ("none", 0)
    dedup: dict[str, int] = {}
    for cause, n in transients:
        dedup[cause] = max(dedup.get(cause, 0), n)
    if masks:
        dedup["attention masks and residual streams (alive through the forward)"] = masks
    total = params + cache + masks + worst[1] + symmetric
    breakdown = [("parameters", params), ("KV cache", cache), ("transient at the peak", worst[1] + masks)]
    if symmetric:
        breakdown.append(("Mega MoE symmetric buffer", symmetric))
    moment = f"prefill, last layer ({worst[0]})"
    return _Moment(moment, total, breakdown, list(dedup.items()), sorted(kv.items(), key=lambda kv: -kv[1]),
                   [(moment, total)])


__all__ = ["DEFAULT_RESERVE", "PeakMemory", "layer_saved", "layer_shapes", "peak_memory"]
