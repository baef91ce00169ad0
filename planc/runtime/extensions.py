"""The runtime half of a registered TP style or EP strategy, checked against its row (planc.spec.extensions).

The checks that guard planc's own rows guard these too, as library functions: `tp_runtime_problems` (the object
is a `TPStyle` of the row's name), `ep_runtime_problems` (an `EPRuntime` subclass with its own `forward` that keeps
the base's row checks), and `shard_probe_problems`, which runs a style's `shard_param` on a probe `nn.Linear` over
a real mesh and compares every local shape with the row's placement, and `forward_probe_problems`, which runs its
installed forward there on the row's input layout against the unsharded linear in the row's output layout (tests/runtime/test_styles_table.py runs it
on every built-in style over 2 gloo ranks; `planc.apply` runs it on the TP mesh for each registered style a plan
uses, before any parameter of the model is touched). `bind_runtimes` imports a runtime given by import path and
puts it in `TP_RUNTIMES` / `EP_RUNTIMES`, where install finds planc's own.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.functional import linear as F_linear
from torch.distributed.tensor import DTensor

from planc.runtime.ep import EP_RUNTIMES
from planc.runtime.ep.base import EPRuntime
from planc.runtime.tp_styles import TP_RUNTIMES, TPStyle
from planc.spec.extensions import EXTENSIONS, Extension, ExtensionError
from planc.spec.styles import REPLICATED, SHARDED, Style

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from planc.compiler.compiled import CompiledPlan
    from planc.spec.choices import EPStrategyRow


def tp_runtime_problems(row: Style, runtime: Any) -> list[str]:
    """What makes `runtime` not the object of the TP style `row` (empty: it is)."""
    if not isinstance(runtime, TPStyle):
        return [f"the runtime object is a {type(runtime).__name__}, not a planc.runtime.tp_styles.TPStyle; subclass "
                "TPStyle (or Colwise, Rowwise, ...) and pass an instance"]
    if runtime.name != row.name:
        return [f"the runtime object's name is `{runtime.name}`, the row's is `{row.name}`: the object shards by the "
                f"row of its own name, so set `name = \"{row.name}\"` on it"]
    return []


def ep_runtime_problems(row: EPStrategyRow, runtime: Any) -> list[str]:
    """What makes `runtime` not the runtime class of the EP strategy `row` (empty: it is)."""
    if not (isinstance(runtime, type) and issubclass(runtime, EPRuntime)):
        return [f"the runtime is {runtime!r}, not a subclass of planc.runtime.ep.EPRuntime; subclass it (or "
                "AllToAllEPRuntime) and pass the class"]
    if runtime.forward is EPRuntime.forward:
        return [f"{runtime.__name__} does not define forward(hidden_states, top_k_index, top_k_weights)"]
    if runtime.__call__ is not EPRuntime.__call__:
        return [f"{runtime.__name__} overrides __call__, which enforces the row's inference_only; override forward "
                "instead"]
    return []


def check_runtime(ext: Extension, runtime: Any) -> None:
    """Raise ExtensionError when `runtime` contradicts the row of `ext`."""
    problems = (tp_runtime_problems(ext.row, runtime) if isinstance(ext.row, Style)
                else ep_runtime_problems(ext.row, runtime))
    if problems:
        raise ExtensionError(f"the {ext.kind} `{ext.name}` (registered by {ext.origin}): " + "; ".join(problems))


def resolve_runtime(ext: Extension) -> Any:
    """The runtime half of `ext`: the object itself, or the one its import path names (a TPStyle class is
    instantiated), checked against the row."""
    runtime = ext.runtime
    if isinstance(runtime, str):
        module, _, attr = runtime.partition(":")
        try:
            obj: Any = importlib.import_module(module)
            for part in attr.split(".") if attr else ():
                obj = getattr(obj, part)
        except Exception as e:  # noqa: BLE001 - the project's code failed: said with the path the project gave
            raise ExtensionError(
                f"the {ext.kind} `{ext.name}` (registered by {ext.origin}): its runtime `{runtime}` cannot be "
                f"imported: {type(e).__name__}: {e}. Write the runtime as \"package.module:Name\", importable on "
                "every rank.") from None
        if not attr:
            raise ExtensionError(f"the {ext.kind} `{ext.name}`: runtime `{runtime}` names a module; write "
                                 f"\"{runtime}:Name\"")
        runtime = obj() if isinstance(obj, type) and issubclass(obj, TPStyle) else obj
    check_runtime(ext, runtime)
    return runtime


def bind_runtimes(compiled: CompiledPlan) -> list[str]:
    """Every registered style and strategy `compiled` uses, its runtime resolved, checked and put in the runtime
    registries; the problems (empty: all bound). A local check: `planc.apply` agrees on it across ranks."""
    problems = []
    for ext in used_extensions(compiled):
        try:
            runtime = resolve_runtime(ext)
        except ExtensionError as e:
            problems.append(str(e))
            continue
        if ext.kind == "TP style":
            TP_RUNTIMES[ext.name] = runtime
        else:
            EP_RUNTIMES[ext.name] = runtime
    return problems


def used_extensions(compiled: CompiledPlan) -> list[Extension]:
    """The registered styles and strategies `compiled` names, in name order."""
    names = {a.style for a in compiled.assignments} | {e.strategy.name for e in compiled.experts
                                                        if e.strategy is not None}
    return [EXTENSIONS[n] for n in sorted(names) if n in EXTENSIONS]


def shard_probe_problems(row: Style, runtime: TPStyle, mesh: DeviceMesh) -> list[str]:
    """Run `runtime.shard_param` on a probe nn.Linear's weight, bias and a 1-D non-bias parameter over `mesh` and
    compare each local shape with `row.placement` (an even split over the mesh). No communication: the probe is the
    same on every rank. Empty: the object shards as its row says."""
    n = mesh.size()
    probe = nn.Linear(2 * n, 4 * n, bias=True)
    probe.scale = nn.Parameter(torch.ones(2 * n))
    full = {name: tuple(p.shape) for name, p in probe.named_parameters()}
    problems = []
    for name, shape in full.items():
        try:
            runtime.shard_param(probe, name, mesh)
        except Exception as e:  # noqa: BLE001 - the object's own code: reported as a contradiction of its row
            problems.append(f"shard_param failed on a probe nn.Linear's `{name}` {shape}: {type(e).__name__}: {e}")
            continue
        p = probe._parameters[name]
        if p is None:
            problems.append(f"shard_param removed the probe nn.Linear's `{name}`")
            continue
        got = tuple((p.to_local() if isinstance(p, DTensor) else p).shape)
        dim = row.placement(len(shape))
        want = list(shape)
        if dim is not None:
            want[dim] //= n
        if got != tuple(want):
            split = "whole" if dim is None else f"split on dim {dim}"
            problems.append(f"a {len(shape)}-D parameter {shape} (`{name}` of a probe nn.Linear) came out {got} on "
                            f"this rank, but the row says {split}: {tuple(want)}")
    return problems


def forward_probe_problems(row: Style, runtime: TPStyle, mesh: DeviceMesh) -> list[str]:
    """Install `runtime` on a probe nn.Linear sharded by it and run the forward on the row's input layout: the output
    must be the unsharded linear's, in the row's output layout. For a module style whose row splits a 2-D weight and
    names both layouts (a Linear style); empty for any other row, or when the forward computes what the row says.
    Every rank runs the same probe (the style's own collectives included), before the model is touched."""
    if row.target != "module" or not row.shards or row.packed or row.input is None or row.output is None:
        return []
    import copy

    n, rank = mesh.size(), mesh.get_local_rank()
    gen = torch.Generator().manual_seed(0)
    probe = nn.Linear(2 * n, 4 * n, bias=True)
    with torch.no_grad():
        for p in probe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(3, 2 * n, generator=gen)
    with torch.no_grad():
        want = F_linear(x, probe.weight, probe.bias)
    sharded = copy.deepcopy(probe)
    try:
        for name in ("weight", "bias"):
            runtime.shard_param(sharded, name, mesh)
        runtime.install(sharded, mesh)
        with torch.no_grad():
            got = sharded(x if row.input == REPLICATED else x.chunk(n, -1)[rank])
    except Exception as e:  # noqa: BLE001 - the object's own code: reported as a contradiction of its row
        return [f"its forward failed on a probe nn.Linear{tuple(probe.weight.shape)} given the row's {row.input} "
                f"input: {type(e).__name__}: {e}"]
    if row.output == SHARDED:
        want = want.chunk(n, -1)[rank]
    if isinstance(got, DTensor) or not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return [f"its forward on a probe nn.Linear gave {type(got).__name__} {tuple(getattr(got, 'shape', ()))}, but "
                f"the row's {row.output} output is a tensor {tuple(want.shape)}"]
    err = (got - want).abs().max().item()
    if err > 1e-4 * max(1.0, want.abs().max().item()):
        return [f"its forward on a probe nn.Linear differs from the unsharded linear by {err:.3g} in the row's "
                f"{row.output} output layout"]
    return []


def check_shards(compiled: CompiledPlan, mesh: DeviceMesh, model: nn.Module) -> None:
    """Raise ExtensionError when a registered style `compiled` uses shards or computes otherwise than its row says
    (the forward probe where every module the style is on in `model` is an nn.Linear, as the probe is)."""
    modules = dict(model.named_modules())
    for ext in used_extensions(compiled):
        if not isinstance(ext.row, Style):
            continue
        runtime = TP_RUNTIMES[ext.name]
        targets = [modules.get(a.fqn) for a in compiled.assignments if a.style == ext.name and a.target == "module"]
        linear = bool(targets) and all(isinstance(m, nn.Linear) for m in targets)
        problems = shard_probe_problems(ext.row, runtime, mesh) or (
            forward_probe_problems(ext.row, runtime, mesh) if linear else [])
        if problems:
            row = ext.row
            raise ExtensionError(
                f"the TP style `{ext.name}` (registered by {ext.origin}): its runtime object contradicts its row "
                f"(dims={row.dims}, input={row.input}, output={row.output}): " + "; ".join(problems) + ". Fix the "
                "row (the compiler counts bytes and follows layouts from it) or the object.")


__all__ = ["tp_runtime_problems", "ep_runtime_problems", "check_runtime", "resolve_runtime", "bind_runtimes",
           "used_extensions", "shard_probe_problems", "forward_probe_problems", "check_shards"]
