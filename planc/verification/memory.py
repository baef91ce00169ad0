"""Rank 0 of a plan at its real sizes, measured: the harness of `planc verify --memory`, the memory test suite and
`bench/memory_grid.py`.

One process plays rank 0 of a `tp * dp` world under torch's fake process group (`init_process_group("fake")`:
collectives return at once, their outputs keep the shapes the real ones have), with real CPU tensors. The model
is built on `meta` from its transformers config at full width (fewer layers), `planc.apply` installs the plan
exactly as on a real rank (TP/EP sharding, EP forwards, the data-parallel wrap, activation checkpointing), then
`to_empty` gives this rank's shards real memory. torch's `MemTracker` (`FSDPMemTracker` under `fsdp`) records the
peak of every live tensor while it runs:

- `serve`: one prefill, `model(ids, use_cache=True, logits_to_keep=1)` under `torch.no_grad()` (what `generate`
  runs first), the cache kept alive;
- `train`: two AdamW steps (forward, loss, backward, step, zero_grad): the second sees the optimizer state.

The one thing the fake group cannot hallucinate is the EP all_to_all's count exchange (its output decides the
shapes that follow): `symmetric_counts` fills it as a world where every rank routes like rank 0 does, the
uniform-routing assumption the analytic model states (`planc.compiler.peak_memory`).
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist



def plan_path(name: str) -> str:
    """A shipped plan by its file's stem (`plans/NAME.yaml`): the grid's family names are the plans'."""
    return f"plans/{name}.yaml"


@contextlib.contextmanager
def symmetric_counts():
    """The EP count exchange (`all_to_all_single` of an int64 [ep, local experts] tensor) answered for a world
    where rank j routes like rank 0 with the experts rotated by j ranks: peer j sends rank 0 what rank 0 sends
    rank -j, so rank 0 receives as many rows as it sends (the load is balanced across ranks)."""
    real = dist.all_to_all_single

    def exchange(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        work = real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        if input.dtype == torch.long and output.shape == input.shape and output_split_sizes is None:
            output.copy_(torch.roll(input.flip(0), 1, 0))  # row j: input[-j mod ep]
        return work

    dist.all_to_all_single = exchange
    try:
        yield
    finally:
        dist.all_to_all_single = real


@contextlib.contextmanager
def no_backward_hooks_without_grad():
    """MemTracker's module tracker registers a backward hook on every module input that requires grad, even under
    `no_grad`, where an input can require grad without a gradient function (Qwen3-Next's conv weight view in its
    hub-kernel layer) and the registration fails: a prefill has no backward, so it registers none. The same for the
    gradient hooks MemTracker puts on every parameter (Mega MoE's FP4 experts do not require grad). In training, a
    parameter that does not require grad (ERNIE 4.5's `e_score_correction_bias`) gets no gradient hook: it never has
    a gradient, and torch refuses the hook. Nor does a parameter swapped for its local shard inside an EP forward
    (`planc.runtime.ep.base.install_ep_forward`: a non-leaf view of the DTensor, which torch refuses too): a module
    inside the experts (Ergo's per-expert norm) is entered with it, while its leaf, tracked at the experts' entry,
    gets the gradient."""
    from torch.distributed._tools import mod_tracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.hooks import RemovableHandle

    real = mod_tracker.register_multi_grad_hook
    real_track = MemTracker._track_module_params_and_buffers

    def register(tensors, fn, *args, **kwargs):
        if not torch.is_grad_enabled():
            return None
        return real(tensors, fn, *args, **kwargs)

    def track(self, module, install_grad_hooks: bool = True):
        install = install_grad_hooks and torch.is_grad_enabled()
        if install:  # MemTracker skips a parameter whose hooks it holds: hold no-op handles for these
            for param in module.parameters():
                if (not param.requires_grad or not param.is_leaf) and self._param_to_grad_hook_handles.get(param) is None:
                    self._param_to_grad_hook_handles[param] = (RemovableHandle(OrderedDict()), RemovableHandle(OrderedDict()))
        return real_track(self, module, install_grad_hooks=install)

    mod_tracker.register_multi_grad_hook = register
    MemTracker._track_module_params_and_buffers = track  # type: ignore[method-assign]
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = real
        MemTracker._track_module_params_and_buffers = real_track  # type: ignore[method-assign]


def _fill(model, seed: int = 0) -> None:
    """Real values for the memory `to_empty` gave: small normal weights (routing near uniform), ones for norms,
    and the rotary buffers recomputed from the config."""
    from torch.distributed.tensor import DTensor

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p._local_tensor if isinstance(p, DTensor) else p
            if local.dtype.is_floating_point:
                if "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1] or local.ndim == 1:
                    local.fill_(1.0 if "norm" in name else 0.0)
                else:  # embeddings at unit scale: token-specific hidden states, so routing spreads like a trained model's
                    std = 1.0 if "embed" in name else 0.02
                    local.copy_(torch.randn(local.shape, generator=gen, dtype=torch.float32).mul_(std).to(local.dtype))
        for module in model.modules():
            init = getattr(module, "rope_init_fn", None)
            if init is not None and hasattr(module, "inv_freq"):
                inv_freq, _ = init(module.config)  # as transformers calls it (Phi-MoE takes only the config)
                module.inv_freq.copy_(inv_freq)
                if hasattr(module, "original_inv_freq"):
                    module.original_inv_freq = inv_freq
            elif hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.zero_()


def _apply_with_weights(model, loaded, mesh, device: str) -> None:
    """Install the plan on the meta model and give this rank's shards real values. A plan that quantizes its Mega MoE
    experts to FP4 when applied needs real weights at that step: as `planc.load` does, the model is sharded on meta,
    its shards are filled (random values) right after sharding, and the rest of the install runs on them."""
    from planc.runtime import install

    from planc.checkpoint.dcp import materialize

    megamoe = loaded.plan.experts.megamoe
    if not (loaded.plan.experts.implementation_row.megamoe and megamoe is not None and megamoe.quantize == "fp4"):
        install.apply(model, loaded, mesh=mesh)
        materialize(model, torch.device(device))  # as planc.load: tied weights stay one tensor (`to_empty` splits them)
        _fill(model)
        return

    def fill(_state) -> None:
        materialize(model, torch.device(device))
        _fill(model)

    install.apply(model, loaded, mesh=mesh, after_sharding=fill)


def plan_data(family: str, mode: str, *, dp: int = 1, root: str = ".") -> dict:
    """The shipped plan at its own tp/ep, with `dp` replicas and the training mode of `mode`."""
    from planc.lint.plan_loader import load_plan

    data = load_plan(f"{root}/{plan_path(family)}").plan.model_dump(exclude_none=True)
    data.pop("extends", None)
    data["parallel"]["dp_size"] = dp
    if mode == "serve":
        return data
    training = {"data_parallel": "fsdp" if mode == "fsdp" else "replicate"}
    if mode == "checkpoint":
        training["activation_checkpointing"] = "full"
    data["training"] = training
    return data


def measure(family: str, mode: str, batch: int, seq: int, overrides: dict, *, dp: int = 1, root: str = ".",
            device: str = "cpu", plan: dict | None = None, config_dir: str | None = None) -> dict:
    """Rank 0's peak (bytes) and MemTracker's categories at that peak, for one point of the grid. On `cuda` the peak
    is `torch.cuda.max_memory_allocated` (the allocator's own count) instead. `plan` (plan data) and `config_dir`
    (a saved config): a user's plan and model instead of the shipped plan of `family` and its config (verify)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from planc.models.build import build_meta_model, meta_model
    from planc.runtime import install
    from planc.spec.model import Parallel
    from planc.verification.stages import training_labels

    data = plan if plan is not None else plan_data(family, mode, dp=dp, root=root)
    p = Parallel.model_validate(data["parallel"])  # the schema's defaults: a plan may leave ep_size / dp_size out
    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=p.world_size, store=FakeStore())
    if config_dir is not None:
        from transformers import AutoConfig

        model = meta_model(AutoConfig.from_pretrained(config_dir), dtype=torch.bfloat16)
    else:
        # built in bf16 as `from_pretrained(dtype=)` and `planc.load` build it: the modules transformers keeps in fp32
        # (`_keep_in_fp32_modules`, parameters its code creates in fp32) stay fp32, as `planc explain` counts them
        model = build_meta_model(data["model"]["type"], dict(overrides), dtype=torch.bfloat16)
    mesh = None
    if device != "cpu":  # the fake backend is not NCCL, so planc would build a CPU mesh: FSDP2 allocates on its device
        from torch.distributed.device_mesh import init_device_mesh

        from planc.spec.sizes import mesh_dims

        sizes, names = mesh_dims(p.tp_size, p.ep_size, p.dp_size)
        mesh = init_device_mesh(device, sizes, mesh_dim_names=names)
    _apply_with_weights(model, install.load_plan_on_every_rank(data, what="planc verify --memory"), mesh, device)
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    labels = training_labels(model, ids)
    if device != "cpu":
        return _measure_cuda(model, ids, labels, mode)
    out: dict[str, Any] = {}
    with symmetric_counts():
        if mode == "serve":
            model.eval()
            tracker = MemTracker()
            tracker.track_external(model)
            with no_backward_hooks_without_grad(), tracker, torch.no_grad():
                result = model(ids, use_cache=True, logits_to_keep=1)
                del result
        else:
            model.train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            fsdp = mode == "fsdp" and p.dp_size > 1
            tracker = FSDPMemTracker(model, optimizer) if fsdp else MemTracker()
            if not fsdp:
                tracker.track_external(model, optimizer)
            with no_backward_hooks_without_grad(), tracker:
                for _ in range(2):
                    tracker.reset_mod_stats()  # per-module stats are per iteration; the peak stays
                    loss = model(ids, labels=labels).loss
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    del loss
    snapshot = tracker.get_tracker_snapshot("peak")
    dev = next(iter(snapshot))
    out["peak"] = int(snapshot[dev]["Total"])
    out["by_category"] = {str(k): int(v) for k, v in snapshot[dev].items() if k != "Total"}
    gc.collect()
    return out


def _measure_cuda(model, ids, labels, mode: str) -> dict:
    """The same steps on a CUDA device, the allocator's high-water mark above what the model held as the peak's
    activations part (the model's own bytes added back, as MemTracker counts them)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with symmetric_counts():
        if mode == "serve":
            model.eval()
            with torch.no_grad():
                result = model(ids, use_cache=True, logits_to_keep=1)
                del result
        else:
            model.train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            for _ in range(2):
                loss = model(ids, labels=labels).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                del loss
    torch.cuda.synchronize()
    return {"peak": int(torch.cuda.max_memory_allocated()), "reserved": int(torch.cuda.max_memory_reserved()),
            "by_category": {}}


def measure_point(point: dict) -> dict:
    from planc.spec.extensions import restore_data

    restore_data(point.get("extensions", []))  # the styles and strategies the verifying process registered
    return measure(point["family"], point["mode"], point["batch"], point["seq"], point["overrides"],
                   dp=point.get("dp", 1), root=point.get("root", "."), device=point.get("device", "cpu"),
                   plan=point.get("plan"), config_dir=point.get("config_dir"))


if __name__ == "__main__":  # python -m planc.verification.memory '<json point or list of points of one world size>'
    arg = json.loads(sys.argv[1])
    print(json.dumps([measure_point(p) for p in arg] if isinstance(arg, list) else measure_point(arg)))
