"""Training memory per rank: parameters, gradients and AdamW state at the plan's sizes and `data_parallel` mode.

What one rank holds after `optimizer.step()` and before `zero_grad()` (what `planc explain --train` prints), as
torch holds it once `planc.load`/`planc.apply` installed the plan (`planc.runtime.data_parallel`):

- parameters: the TP/EP shard of each (the placement of its style, `shard_divisor`: the compiler's byte
  accounting). `replicate` keeps that shard whole on every dp replica. `fsdp` (FSDP2 `fully_shard`) splits dim 0
  of that local tensor once more over the unit's mesh: `dp` for dense parameters and the root, `efsdp`
  (world / ep_size: the ranks holding the same experts) for an experts module sharded by EP. Rank 0 holds
  ceil(rows / n) rows, the most any rank holds (torch.chunk's split; FSDP2 pads the rest to that size).
- gradients: one per parameter, its local size and dtype (FSDP2 reduce-scatters in `reduce_dtype`, then keeps the
  sharded gradient in the parameter's dtype).
- AdamW state: `exp_avg` and `exp_avg_sq` like the parameter (dtype included), and `step`, a float32 scalar per
  parameter (torch's default, `capturable=False`).
- experts whose EP strategy is inference-only (Mega MoE): their parameters are held, they get no gradient and no
  AdamW state (`frozen`).
- a multimodal model's other towers (Qwen3-VL's vision blocks and mergers: the siblings of the language model that
  holds the decoder layers): a text batch never runs them, so they are held without gradients or AdamW state
  (`text_unreached`; AdamW skips a parameter whose gradient is None).
- a sparse attention's indexer (DeepSeek Sparse Attention's in DeepSeek-V3.2, GLM-5, HY-V4, Mistral Large 4 and
  others, under `torch.no_grad()`; Qwen4-Exp's QSA indexer): it returns token indices only, so backward never reaches
  its parameters: held without gradients or AdamW state (`index_only`).
- mixed precision (`fsdp` only): the sharded parameters, gradients and AdamW state stay in the model's dtype (the
  fp32 master copy); FSDP2 casts a unit's parameters to `param_dtype` when it all-gathers them for forward and
  backward and frees them when it reshards (after forward for every layer but the last; after backward for all,
  the root included). Those copies exist only while units run: `gathered` reports them (the root's, the largest
  layer's, and every unit inside the layers: the layer, its EP experts module, a module kept in another dtype),
  outside the held total.

Pure Python over the compiler's model walk, like every byte count of the compiler.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Optional

from planc.compiler.accounting import shard_divisor
from planc.compiler.optimizer_step import AdamWStep, adamw_step, for_loop_temporaries, foreach_temporaries
from planc.compiler.units import human_bytes
from planc.spec.choices import DATA_PARALLEL_MODES
from planc.spec.styles import STYLE

if TYPE_CHECKING:
    from planc.compiler.compiled import CompiledPlan
    from planc.compiler.walk import ModelWalk

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
STEP_BYTES = 4  # AdamW's `step`: a float32 scalar tensor per parameter
_LAYER = re.compile(r"^(?P<list>.+)\.(?P<index>\d+)$")


@dataclass(frozen=True)
class TrainMemory:
    """Bytes one rank holds while training (the most any rank holds): `planc explain --train`."""

    data_parallel: str  # replicate | fsdp
    dp_size: int
    efsdp_size: int  # ranks holding the same experts (world / ep_size): the experts' FSDP mesh
    parameters: tuple[tuple[str, int], ...]  # (dtype, bytes) largest first
    gradients: int
    optimizer: int  # AdamW: exp_avg + exp_avg_sq + step
    tensors: int  # parameters that get a gradient and AdamW state
    experts_sharded: bool = False  # EP-sharded experts modules, FSDP units of their own over efsdp
    local_experts: int = 0  # fsdp: the fewest experts a rank holds after EP (dim 0 FSDP2 splits over efsdp)
    param_dtype: Optional[str] = None  # fsdp mixed precision
    reduce_dtype: Optional[str] = None
    gathered_root: int = 0  # fsdp: the root unit's parameters all-gathered (param_dtype), forward to backward
    gathered_layer: int = 0  # fsdp: the largest decoder layer's (all its units), while it runs
    # fsdp: every FSDP unit planc wraps inside the decoder layers, in parameter order: (unit path, its decoder layer,
    # bytes all-gathered). A layer is one unit over dp, plus its EP experts module over efsdp and each module kept in
    # another dtype (the fp32 router) as units of their own (planc.runtime.data_parallel wraps them so).
    units: tuple[tuple[str, str, int], ...] = ()
    frozen: int = 0  # parameter bytes of inference-only experts: held, without gradients or AdamW state
    text_unreached: int = 0  # parameter bytes a text batch does not run (a vision tower): no gradient or AdamW state
    index_only: int = 0  # parameter bytes of sparse attention indexers (token indices out): no gradient or AdamW state
    # the input embedding's gradient (untied): backward reaches it last, after every layer (recomputed ones too)
    embedding_gradient: int = 0
    largest_tensor: int = 0  # the most bytes one parameter holds on this rank (its gradient's transient copy)
    step: Optional[AdamWStep] = None  # the AdamW step torch takes on CUDA (planc.compiler.optimizer_step)
    for_loop_step: int = 0  # what the for-loop AdamW step holds beyond the states (planc.compiler.optimizer_step)
    foreach_step: int = 0  # what the foreach AdamW step holds beyond the states

    @property
    def parameter_bytes(self) -> int:
        return sum(n for _, n in self.parameters)

    @property
    def total(self) -> int:
        return self.parameter_bytes + self.gradients + self.optimizer

    @property
    def shards(self) -> bool:
        """Whether the mode shards parameters over the replicas (its row in planc.spec.choices)."""
        return DATA_PARALLEL_MODES[self.data_parallel].shards_parameters

    def to_json(self) -> dict[str, Any]:
        return {
            "data_parallel": self.data_parallel,
            "dp_size": self.dp_size,
            "efsdp_size": self.efsdp_size,
            "mixed_precision": (
                {"param_dtype": self.param_dtype, "reduce_dtype": self.reduce_dtype} if self.param_dtype else None
            ),
            "parameters_per_rank": self.parameter_bytes,
            "parameters_by_dtype": dict(self.parameters),
            "gradients_per_rank": self.gradients,
            "optimizer_per_rank": self.optimizer,
            "total_per_rank": self.total,
            "tensors": self.tensors,
            "inference_only_parameters_per_rank": self.frozen,
            "text_unreached_parameters_per_rank": self.text_unreached,
            "indexer_parameters_per_rank": self.index_only,
            "gathered_root": self.gathered_root if self.shards else None,
            "gathered_layer": self.gathered_layer if self.shards else None,
            "gathered_unit": max((n for _, _, n in self.units), default=0) if self.shards else None,
            "gathered_units": {u: n for u, _, n in self.units} if self.shards else None,
            "adamw_step": self.step.to_json() if self.step is not None else None,
        }

    def render(self) -> str:
        how = f"{self.data_parallel} over dp_size={self.dp_size}"
        if self.shards and self.experts_sharded:
            how += f" (EP experts over efsdp={self.efsdp_size})"
            if self.param_dtype:
                how += f", mixed precision {self.param_dtype} (reduce in {self.reduce_dtype})"
        parts = ", ".join(f"{dtype} {human_bytes(n, 1)}" for dtype, n in self.parameters)
        lines = [
            f"training memory ({how}; AdamW), per rank after a step:",
            f"  parameters:      {human_bytes(self.parameter_bytes, 2)} ({parts})",
            f"  gradients:       {human_bytes(self.gradients, 2)}",
            f"  AdamW state:     {human_bytes(self.optimizer, 2)} (exp_avg, exp_avg_sq, step; {self.tensors} tensors)",
            f"  total:           {human_bytes(self.total, 2)}",
        ]
        if self.step is not None:
            lines.append(f"  AdamW step on CUDA: {self.step.step} ({self.step.why})")
        if self.frozen:
            lines.append(
                f"  note: {human_bytes(self.frozen, 2)} of the parameters are experts of an inference-only EP strategy "
                "(Mega MoE): held, without gradients or AdamW state"
            )
        if self.text_unreached:
            lines.append(
                f"  note: {human_bytes(self.text_unreached, 2)} of the parameters are outside the language model (a "
                "vision tower) that a text batch does not run: held, without gradients or AdamW state"
            )
        if self.index_only:
            lines.append(
                f"  note: {human_bytes(self.index_only, 2)} of the parameters are sparse attention indexers, which "
                "return token indices only: held, without gradients or AdamW state"
            )
        if self.shards:
            dtype = self.param_dtype or "the parameters' dtype"
            lines.append(
                f"  all-gathered while units run ({dtype}, not in the total): root {human_bytes(self.gathered_root, 1)}"
                f" from forward to backward, largest layer {human_bytes(self.gathered_layer, 1)}"
            )
            if self.experts_sharded and 0 < self.local_experts < self.efsdp_size:
                lines.append(
                    f"  note: FSDP2 splits dim 0 of the experts' tensors, {self.local_experts} expert(s) per EP rank, "
                    f"over efsdp={self.efsdp_size} ranks: it pads, so every rank holds a whole expert's bytes. The "
                    "split is even when the model has at least as many experts as the world has ranks"
                )
        return "\n".join(lines)


def _local_shape(
    shape: tuple[int, ...], style: Optional[str], tp: int, ep: int, rows: Optional[int]
) -> tuple[int, ...]:
    """The shape rank 0 holds after TP/EP sharding (`rows`: an expert tensor cut to its experts with weights)."""
    dims = list(shape)
    spec = STYLE.get(style) if style is not None else None
    if spec is None:
        return tuple(dims)
    if rows is not None and spec.mesh == "ep":
        dims[0] = rows
    dim = spec.placement(len(dims))
    div = shard_divisor(style, tuple(dims), tp, ep)
    if div > 1 and dim is not None:
        dims[dim] = -(-dims[dim] // div)
    return tuple(dims)


def decoder_layers(walk: ModelWalk, experts_fqns: Iterable[str]) -> set[str]:
    """Paths of the decoder layers: every item of each list holding an experts module's layer (as
    `planc.runtime.data_parallel.decoder_layers` wraps them)."""
    lists = set()
    for fqn in experts_fqns:
        parts = fqn.split(".")
        for i in range(len(parts) - 1, 0, -1):
            parent = ".".join(parts[:i])
            module = walk.modules.get(parent)
            if parts[i].isdigit() and module is not None and module.class_name == "ModuleList":
                lists.add(parent)
                break
    return {f for f in walk.modules if (m := _LAYER.match(f)) and m.group("list") in lists}


def text_unreached_modules(walk: ModelWalk, layers: set[str]) -> list[str]:
    """A multimodal model's modules a text batch does not run: the siblings of the language model that holds the
    decoder layers (`model.visual` beside `model.language_model`); none when the decoder is the model itself."""
    lists = {m.group("list") for f in layers if (m := _LAYER.match(f))}
    text_models = {lst.rpartition(".")[0] for lst in lists}
    out = []
    for text in text_models:
        parent, dot, _ = text.rpartition(".")
        if not dot:  # `model.layers`: the decoder is the model (lm_head and the embeddings are its siblings)
            continue
        out += [f for f in walk.modules if f.rpartition(".")[0] == parent and f != text and f not in text_models]
    # modality-isolated experts inside the decoder layers (ERNIE 4.5 VL's `mlp.vision_moe`, its own router and
    # experts): they run only on image tokens
    out += [f for f in walk.modules if f.rpartition(".")[2].startswith("vision_")
            and any(f.startswith(layer + ".") for layer in layers)]
    return out


def index_only_modules(walk: ModelWalk, layers: set[str]) -> list[str]:
    """The sparse attention indexers of the decoder layers (an `indexer` module of a class named so): they return the
    top-k token indices (or a boolean pick mask built from them), which carry no gradient."""
    return [f for f, m in walk.modules.items() if f.rpartition(".")[2] == "indexer" and "Indexer" in m.class_name
            and any(f.startswith(layer + ".") for layer in layers)]


def _mesh_of(fqn: str, ep_experts: list[str]) -> str:
    """The mesh of the FSDP unit that owns parameter `fqn`: "efsdp" inside an EP-sharded experts module, else "dp"."""
    return "efsdp" if any(fqn.startswith(e + ".") for e in ep_experts) else "dp"


def _layer_of(fqn: str, layers: set[str]) -> str:
    """The decoder layer holding parameter `fqn`, "" for the root's own parameters (embeddings, final norm, head)."""
    parts = fqn.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in layers:
            return prefix
    return ""


def _units(walk: ModelWalk, layers: set[str], ep_experts: list[str]) -> dict[str, str]:
    """Parameter fqn -> the FSDP unit that gathers it, as planc.runtime.data_parallel wraps them: an EP experts
    module, then a module of its layer whose own parameters are all of another dtype than the rest of that layer
    (one dtype per unit: the fp32 router of a bf16 model), then the decoder layer; "" for the root."""
    owner_unit: dict[str, str] = {}
    for info in walk.params.values():
        experts = next((e for e in ep_experts if info.fqn.startswith(e + ".")), None)
        owner_unit[info.fqn] = experts or _layer_of(info.fqn, layers)
    # one dtype per unit: the dtype holding most elements is the unit's, a module whose own parameters are all of
    # another dtype becomes a unit of its own (a module of mixed dtypes is refused at apply)
    by_unit: dict[str, dict[str, int]] = {}
    for info in walk.params.values():
        counts = by_unit.setdefault(owner_unit[info.fqn], {})
        counts[info.dtype] = counts.get(info.dtype, 0) + info.numel
    main = {u: max(c, key=lambda d: c[d]) for u, c in by_unit.items()}
    own: dict[str, set[str]] = {}
    for info in walk.params.values():
        own.setdefault(info.owner, set()).add(info.dtype)
    for info in walk.params.values():
        unit = owner_unit[info.fqn]
        if main[unit] not in own[info.owner]:
            owner_unit[info.fqn] = info.owner
    return owner_unit


def train_memory(compiled: CompiledPlan, model_or_walk: Any, *, data_parallel: Optional[str] = None) -> TrainMemory:
    """What a rank holds training `model_or_walk` (a model, real or on meta, or its `ModelWalk`) under `compiled`.

    `data_parallel` overrides the plan's mode (e.g. to compare replicate with fsdp). The plan's mixed precision
    applies under `fsdp` only (the `training:` rules refuse it with replicate).
    """
    from planc.compiler.walk import ModelWalk, walk_model

    walk = model_or_walk if isinstance(model_or_walk, ModelWalk) else walk_model(model_or_walk)
    p = compiled.parallel
    tp, ep, dp = p.tp_size, p.ep_size, p.dp_size
    world = tp * dp
    efsdp = world // ep
    mode = data_parallel or compiled.data_parallel
    shards = DATA_PARALLEL_MODES[mode].shards_parameters
    mp = compiled.training.mixed_precision if compiled.training is not None and shards else None
    styles = {a.fqn: a.style for a in compiled.assignments if a.target == "parameter"}
    ep_experts = [e.fqn for e in compiled.experts if e.mode == "ep" and ep > 1]
    layers = decoder_layers(walk, [e.fqn for e in compiled.experts])
    frozen_experts = [e.fqn for e in compiled.experts if e.strategy is not None and e.strategy.inference_only]
    unreached = text_unreached_modules(walk, layers)
    indexers = index_only_modules(walk, layers)

    params: dict[str, int] = {}
    grads = optim = tensors = frozen = untouched = index_only = largest = 0
    stepped: list[int] = []  # bytes of each parameter AdamW steps, in model.parameters() order
    stepped_by_dtype: dict[str, int] = {}  # the foreach step's (device, dtype) groups, in order of first appearance
    gathered: dict[str, int] = {}
    unit_of = _units(walk, layers, ep_experts)
    unit_bytes: dict[str, int] = {}
    seen: set[int] = set()
    uses: dict[int, int] = {}
    for info in walk.params.values():
        uses[info.tensor_id] = uses.get(info.tensor_id, 0) + 1
    embedding_gradient = 0
    for info in walk.params.values():
        if info.tensor_id in seen:
            continue
        seen.add(info.tensor_id)
        experts = walk.modules[info.owner].experts
        rows = experts.num_experts if experts is not None and info.shape and 0 < experts.num_experts < info.shape[0] else None
        shape = _local_shape(info.shape, styles.get(info.fqn), tp, ep, rows)
        itemsize = info.nbytes // info.numel if info.numel else ITEMSIZE.get(info.dtype, 4)
        mesh = _mesh_of(info.fqn, ep_experts)
        n = (efsdp if mesh == "efsdp" else dp) if shards else 1
        if shape and n > 1:
            held_shape = (-(-shape[0] // n), *shape[1:])
        else:
            held_shape = shape
        held = math.prod(held_shape) * itemsize
        params[info.dtype] = params.get(info.dtype, 0) + held
        if any(info.fqn.startswith(e + ".") for e in frozen_experts):
            frozen += held
            continue
        if any(info.fqn.startswith(m + ".") for m in unreached):
            untouched += held  # still gathered with the root under fsdp
        elif any(info.fqn.startswith(m + ".") for m in indexers):
            index_only += held  # gathered with its layer under fsdp
        else:
            largest = max(largest, held)  # a gradient's transient copy: inference-only experts have none
            stepped.append(held)
            stepped_by_dtype[info.dtype] = stepped_by_dtype.get(info.dtype, 0) + held
            grads += held
            if walk.modules[info.owner].class_name == "Embedding" and uses[info.tensor_id] == 1:
                embedding_gradient += held
            optim += 2 * held + STEP_BYTES
            tensors += 1
        if shards:
            gathered_itemsize = ITEMSIZE[mp.param_dtype] if mp is not None else itemsize
            layer = _layer_of(info.fqn, layers)  # a layer's EP experts unit is gathered inside the layer's forward
            gathered[layer] = gathered.get(layer, 0) + math.prod(shape) * gathered_itemsize
            # a dtype-odd unit keeps its own dtype (no param_dtype cast)
            unit = unit_of[info.fqn]
            odd = unit not in layers and unit not in ep_experts and unit != ""
            size = math.prod(shape) * (itemsize if odd else gathered_itemsize)
            unit_bytes[unit] = unit_bytes.get(unit, 0) + size
    root = gathered.pop("", 0)
    return TrainMemory(
        data_parallel=mode,
        dp_size=dp,
        efsdp_size=efsdp,
        parameters=tuple(sorted(params.items(), key=lambda kv: -kv[1])),
        gradients=grads,
        optimizer=optim,
        tensors=tensors,
        experts_sharded=bool(ep_experts),
        local_experts=min((e.num_local_experts for e in compiled.experts if e.fqn in ep_experts), default=0),
        param_dtype=mp.param_dtype if mp is not None else None,
        reduce_dtype=mp.reduce_dtype if mp is not None else None,
        gathered_root=root,
        gathered_layer=max(gathered.values(), default=0),
        frozen=frozen,
        text_unreached=untouched,
        index_only=index_only,
        embedding_gradient=embedding_gradient,
        largest_tensor=largest,
        step=adamw_step(compiled, walk),
        for_loop_step=for_loop_temporaries(stepped),
        foreach_step=foreach_temporaries(list(stepped_by_dtype.values())),
        units=tuple((u, _layer_of(u + ".x", layers) if u not in layers else u, n) for u, n in unit_bytes.items()
                    if u),
    )


__all__ = ["TrainMemory", "decoder_layers", "index_only_modules", "text_unreached_modules", "train_memory"]
