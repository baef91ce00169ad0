"""`planc.apply(model, plan, *, mesh=None)`: compile, agree across ranks, then install all or nothing.

Read top to bottom, `apply` is the whole story:

1. torch.distributed must be initialized: by the caller's own `init_process_group`, or from torchrun's
   environment (planc.runtime.process_group). The public face (`planc.apply`, `planc.load`) makes sure of it,
   then loads the plan once, on every rank, with `load_plan_on_every_rank`: a plan that fails to load on one rank
   raises the same error on every rank (naming file:line:col) instead of leaving the others in a collective.
2. Compile the LoadedPlan against the model (`planc.compiler.resolve.compile_plan`; changes nothing) and
   run the checks that need no communication: world size, a model applied twice or sharded by
   another tool, experts kernels that cannot run where the model lives.
3. Every rank shares a status flag and its fingerprint's digest in one small all-reduce: if any rank
   failed or any fingerprint differs, the ranks gather their messages (`all_gather_object`, only
   then) and every rank raises the same ApplyError (a rank with another plan file fails the job
   instead of hanging it in a collective).
4. Build the process groups, snapshot everything the steps may touch, run `INSTALL_STEPS` in order,
   then all-reduce one status flag. If a step raised on any rank, the ranks gather the messages,
   every rank restores its snapshot (parameters, buffers, forwards, attributes, hooks, configs) and
   raises.

`INSTALL_STEPS` is a module-level list so tests can wrap a step to fail after it ran and check the
rollback bit for bit.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from planc.errors import ApplyError, PlanError
from planc.runtime.ep import EP_RUNTIMES
from planc.runtime.ep.base import install_ep_forward, shard_expert_tensor
from planc.runtime.ep.dense import install_dense_ep_forward
from planc.runtime.guards import guard_applied_model
from planc.runtime.exit_drain import destroy_groups_at_exit
from planc.runtime.mesh import Groups, build_groups, rank_device
from planc.runtime.snapshot import Snapshot
from planc.runtime.tp_styles import tp_style
from planc.spec.styles import STYLE, dispatches_experts, splits_by_expert

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PreTrainedModel

    from planc.compiler.compiled import CompiledPlan
    from planc.lint.plan_loader import PlanSource
    from planc.spec.loaded_plan import LoadedPlan
    from planc.spec.model import MegaMoe


def apply(model: nn.Module, loaded: LoadedPlan, *, mesh: Optional[Any] = None,
          after_sharding: Optional[Callable[[InstallState], None]] = None) -> CompiledPlan:
    """Compile `loaded` against `model`, then shard and install it on every rank (all or nothing).

    `loaded`: the plan as `load_plan_on_every_rank` loaded it (at the sizes it runs at). `mesh`: an optional
    DeviceMesh, planc's root (planc.spec.sizes.mesh_dims) or ("dp", "tp"); planc builds the root from the plan's
    sizes otherwise. `after_sharding`: run once the parameters are sharded, before the rest of the install (what
    gives a model sharded on meta its values: `install_atomically`). Returns the CompiledPlan.
    """
    compiled, problems = compile_and_check(model, loaded, mesh)
    agree_across_ranks(compiled, problems)
    assert compiled is not None  # agree_across_ranks raised on every rank otherwise
    groups = build_groups(compiled.parallel, mesh)
    state = InstallState(model=model, compiled=compiled, groups=groups)
    install_atomically(state, after_sharding=after_sharding)
    return compiled


def require_distributed(what: str) -> None:
    """1. `what` (planc.apply, planc.load) runs on every rank of a process group: one torchrun's environment
    describes is started here (planc.runtime.process_group). From here on planc runs collectives on it, also when
    `what` then fails and the caller goes on: the exit drain is registered now, not only once planc's own groups
    exist (`destroy_groups_at_exit` says why a gloo job needs it)."""
    from planc.runtime.process_group import ensure_process_group

    ensure_process_group(what)
    destroy_groups_at_exit()


# ---- 1. the plan, loaded on every rank ---------------------------------------------------------------------


def load_plan_on_every_rank(plan: PlanSource, *, what: str, parallel: Optional[Mapping[str, int]] = None,
                            world_model: Optional[nn.Module] = None) -> LoadedPlan:
    """`plan` (path, YAML text, mapping, Plan or LoadedPlan) loaded and linted at `parallel`'s sizes on every rank;
    if it fails on any rank, every rank raises the same ApplyError, each rank's message (PlanError: file:line:col)
    with the ranks it happened on. The one place the public face turns a plan source into a LoadedPlan.

    `world_model` (planc.apply without a caller's mesh): when the plan fails lint at sizes the launched world does
    not fit, the world's sizes are reported first and alone, with sizes that fit it and compile against this model:
    the other problems would be about sizes that are not the ones launched.
    """
    from planc.lint.plan_loader import load_plan

    agree_on_extensions(what=what)
    loaded: Optional[LoadedPlan] = None
    problems: list[str] = []
    try:
        try:
            loaded = load_plan(plan, parallel=parallel)
        except PlanError as e:  # e.g. PLC501 at the plan's own sizes: if the world does not fit them, that comes first
            world = _world_problem(world_model, e.loaded) if world_model is not None and e.loaded is not None else None
            if world is None:
                raise
            problems.append(world)
    except Exception as e:  # noqa: BLE001 - reported on every rank by agree_on_problems instead of hanging them
        problems.append(f"{type(e).__name__}: {e}")
    agree_on_problems(problems, what=what)
    assert loaded is not None  # agree_on_problems raised on every rank otherwise
    return loaded


# ---- 2. compile and local checks ---------------------------------------------------------------------------


def compile_and_check(model: nn.Module, loaded: LoadedPlan, mesh: Optional[DeviceMesh], *,
                      device: Optional[torch.device] = None,
                      launched: bool = True) -> tuple[Optional[CompiledPlan], list[str]]:
    """The CompiledPlan (or None) and the list of problems found on this rank, without any communication.

    A world that does not fit the plan's sizes is reported first and alone: every other problem
    (heads split, experts uneven) would be about sizes that are not the ones launched. `device`: where
    the model will run (planc.load builds it on `meta` first); default: where it lives. `launched=False`
    (`planc explain --checkpoint`): no world is running, so the world size and the kernels' device are not checked.
    """
    from planc.runtime.adapters import peft_model_problem

    peft = peft_model_problem(model)
    if peft:
        return None, [peft]
    try:
        if mesh is None and launched:
            sizes = _world_problem(model, loaded)
            if sizes:
                return None, [sizes]
        compiled = _compile(model, loaded)
    except Exception as e:  # noqa: BLE001 - reported on every rank by agree_across_ranks instead of hanging them
        return None, [f"{type(e).__name__}: {e}"]
    if not launched:
        return compiled, []
    problems: list[str] = []
    try:
        problems += _local_checks(model, compiled, mesh, device)
    except Exception as e:  # noqa: BLE001 - reported on every rank by agree_across_ranks instead of hanging them
        problems.append(f"{type(e).__name__}: {e}")
    return compiled, problems


def _world_problem(model: nn.Module, loaded: LoadedPlan) -> Optional[str]:
    """The sizes problem of this world (`planc.spec.sizes.check_sizes`), with sizes that fit it and compile."""
    from planc.compiler.resolve import sizes_for_world
    from planc.spec.sizes import check_sizes, sizes_hint

    p, world = loaded.plan.parallel, dist.get_world_size()
    problems = check_sizes(p.tp_size, p.ep_size, p.dp_size, world)
    if not problems:
        return None
    found = sizes_for_world(loaded, model, world)
    hint = sizes_hint(found, world, "change `parallel` in the plan to match the world")
    if found:  # the same sizes without editing the plan: planc.apply(..., parallel=...)
        s = found[0]
        hint += f" (or keep the plan and pass parallel={{'tp_size': {s.tp}, 'ep_size': {s.ep}, 'dp_size': {s.dp}}})"
    return (
        f"{problems[0].code}: {problems[0].message}. Launch {p.world_size} processes (torchrun --nproc-per-node "
        f"{p.world_size}), or {hint}."
    )


def _local_checks(model: nn.Module, compiled: CompiledPlan, mesh: Optional[DeviceMesh],
                  device: Optional[torch.device] = None) -> list[str]:
    from planc.runtime.extensions import bind_runtimes

    problems: list[str] = bind_runtimes(compiled)  # registered styles and strategies: their runtime halves
    problems += _already_sharded(model)
    problems += _unrunnable_experts(model, compiled, device)
    return problems


def _compile(model: nn.Module, loaded: LoadedPlan) -> CompiledPlan:
    from planc.compiler.resolve import compile_plan

    return compile_plan(model, loaded)


def _already_sharded(model: nn.Module) -> list[str]:
    if getattr(model, "_planc_plan", None) is not None:
        return [
            "planc.apply was already called on this model; a plan installs once. Build a fresh model "
            "(or reload it) to apply another plan."
        ]
    dtensors = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    if dtensors:
        return [
            f"the model is already sharded by another tool: {len(dtensors)} parameter(s) are DTensors "
            f"(first: {dtensors[0]}), e.g. from transformers' tp_plan/distributed_config or FSDP2. Load it "
            "without that tool's parallelism and let planc.apply shard it."
        ]
    hooked = [n or "<model>" for n, m in model.named_modules() if getattr(m, "_is_hooked", False)]
    fsdp = [n or "<model>" for n, m in model.named_modules() if type(m).__name__.startswith("FSDP")]
    if hooked or fsdp:
        return [
            f"the model is already parallelized by another tool (module {(hooked or fsdp)[0]} carries "
            f"{'transformers parallel hooks (`_is_hooked`)' if hooked else 'an FSDP wrapper'}). Load it without "
            "that tool's parallelism and let planc.apply shard it."
        ]
    return []


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _unrunnable_experts(model: nn.Module, compiled: CompiledPlan, device: Optional[torch.device] = None) -> list[str]:
    """Experts kernels that cannot run where the model lives, found before anything is installed."""
    impl, row = compiled.experts_settings.implementation, compiled.experts_implementation
    device = device if device is not None else _model_device(model)
    if row.min_capability is not None:
        need = row.min_capability
        if device.type != "cuda" or not torch.cuda.is_available():
            return [
                f"experts.implementation `{impl}` runs CUDA kernels (compute capability >= {need[0]}.{need[1]}), "
                f"but the model lives on {device.type}. Use `grouped_mm` (or `batched_mm`, `eager`) here, or move "
                "the model to a suitable GPU before planc.apply."
            ]
        cap = torch.cuda.get_device_capability(device)
        if cap < need:
            return [
                f"experts.implementation `{impl}` needs compute capability >= {need[0]}.{need[1]}, but "
                f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}. Use `grouped_mm` on this GPU."
            ]
    if row.package is not None and importlib.util.find_spec(row.package) is None:
        return [f"experts.implementation `{impl}` needs the `{row.package}` package; install it or use `grouped_mm`."]
    if row.megamoe:
        try:
            from planc.runtime.megamoe import resolve_backend

            settings = _megamoe_settings(compiled)
            resolve_backend(settings.backend, device if device.type == "cuda" else None, settings.math)
        except (RuntimeError, ValueError, ImportError, OSError) as e:
            return [f"experts.implementation `{impl}` cannot run here: {e}"]
    return []


def _megamoe_settings(compiled: CompiledPlan) -> MegaMoe:
    """The plan's `experts.megamoe` settings, or their defaults when the plan leaves them out."""
    from planc.spec.model import MegaMoe

    return compiled.experts_settings.megamoe or MegaMoe()


# ---- 3. rank agreement -------------------------------------------------------------------------------------


def _digest(fingerprint: Optional[str]) -> int:
    """A fingerprint as a non-negative int64 (0: no fingerprint, the rank failed to compile)."""
    if fingerprint is None:
        return 0
    return int.from_bytes(hashlib.blake2b(str(fingerprint).encode(), digest_size=8).digest(), "big") >> 1


def agree_on_problems(problems: list[str], *, what: str) -> None:
    """Raise the same ApplyError on every rank if any rank has problems (one small all-reduce when none has)."""
    if _all_agree(not problems):
        return
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    raise ApplyError(f"{what}: nothing was installed:\n" + _by_message([(r, p) for r, ps in enumerate(everyone) for p in ps]))


def agree_on_extensions(*, what: str) -> None:
    """Raise the same ApplyError on every rank unless every rank registered the same styles and strategies (rows
    and runtimes, planc.spec.extensions): a style registered on some ranks only would fail lint there and compile
    elsewhere; this names it, with the ranks that have it, before any plan is read. One small all-reduce."""
    from planc.spec.extensions import load_project_extensions, registry_summary

    load_project_extensions()  # the project's config, as lint reads it (a failure shows when the plan is linted)
    mine = registry_summary()
    if _all_agree(True, _digest(repr(sorted(mine.items())) if mine else None)):
        return
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    parts = []
    for name in sorted({n for summary in everyone for n in summary}):
        per_rank = [(rank, summary.get(name, "not registered")) for rank, summary in enumerate(everyone)]
        if len({d for _, d in per_rank}) > 1:
            parts.append(f"  `{name}`:\n" + "\n".join(f"  {line}" for line in _by_message(per_rank).splitlines()))
    detail = "\n".join(parts)
    raise ApplyError(
        f"{what}: the ranks registered different styles or strategies, so they would compile different plans; nothing "
        f"was installed:\n{detail}\nRegister them on every rank: name the module that registers them in "
        "pyproject.toml's [tool.planc] extensions, or call planc.register_tp_style / planc.register_ep_strategy at "
        "import time in code every rank runs (docs/extending.md)."
    )


def _all_agree(ok: bool, digest: int = 0) -> bool:
    """One all-reduce (MAX over [failed, digest, -digest]): True when every rank is ok with the same digest."""
    t = torch.tensor([0 if ok else 1, digest, -digest], dtype=torch.int64, device=rank_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    any_failed, max_digest, neg_min_digest = t.tolist()
    return not any_failed and max_digest == -neg_min_digest


def agree_across_ranks(
    compiled: Optional[CompiledPlan], problems: list[str], *, what: str = "planc.apply", decisions: Optional[Mapping[str, str]] = None
) -> None:
    """Raise the same ApplyError on every rank if any rank has problems, another fingerprint or other decisions.

    `decisions`: every choice a rank made on its own that leads to different collectives later (planc.load: the
    checkpoint route, DCP or safetensors; the quantization mode; which checkpoint it sees), `{name: value}`. They
    are agreed here, with the fingerprint, so that ranks that chose differently fail together instead of entering
    different collectives and hanging. The common case (all agree) costs one small all-reduce; the messages are
    gathered only when some rank disagrees, and then every rank builds the same error from them.
    """
    fingerprint = compiled.fingerprint if compiled is not None else None
    decisions = dict(decisions or {})
    agreed = None if fingerprint is None else f"{fingerprint} {sorted(decisions.items())}"
    if _all_agree(not problems and fingerprint is not None, _digest(agreed)):
        return
    mine = (fingerprint, problems, decisions)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    failed = [(rank, p) for rank, (_, ps, _) in enumerate(everyone) for p in ps]
    if failed:
        raise ApplyError(f"{what}: nothing was installed:\n" + _by_message(failed))
    for name in dict.fromkeys(n for _, _, d in everyone for n in d):  # in the order the ranks decided them
        chosen = [(rank, f"{name}: {d.get(name, '(not decided)')}") for rank, (_, _, d) in enumerate(everyone)]
        if len({c for _, c in chosen}) > 1:
            raise ApplyError(
                f"{what}: the ranks decided `{name}` differently, so they would enter different collectives and hang; "
                f"nothing was installed:\n{_by_message(chosen)}\nEvery rank must see the same inputs (one shared "
                "path: the same checkpoint directory, device kind and options on every rank)."
            )
    fingerprints = {rank: fp for rank, (fp, _, _) in enumerate(everyone)}
    if len(set(fingerprints.values())) > 1:
        by_fp: dict[str, list[int]] = {}
        for rank, fp in fingerprints.items():
            by_fp.setdefault(fp, []).append(rank)
        table = "; ".join(f"ranks {ranks}: {fp}" for fp, ranks in sorted(by_fp.items(), key=lambda kv: kv[1]))
        raise ApplyError(
            f"{what}: the ranks compiled different plans (fingerprints {table}); nothing was installed. "
            "Every rank must load the same plan file against the same model; `planc explain` prints the "
            "fingerprint to compare."
        )


def _by_message(failed: list[tuple[int, str]]) -> str:
    """One line per distinct message with the ranks it happened on (`ranks 0, 1: ...`), in first-rank order."""
    ranks: dict[str, list[int]] = {}
    for rank, message in failed:
        ranks.setdefault(message, []).append(rank)
    return "\n".join(
        f"  {'rank' if len(rs) == 1 else 'ranks'} {', '.join(map(str, rs))}: {message}" for message, rs in ranks.items()
    )


# ---- 4. the install steps ----------------------------------------------------------------------------------


@dataclass
class InstallState:
    """What the steps share: the model, the compiled plan, the groups, and the modules by name."""

    model: nn.Module
    compiled: CompiledPlan
    groups: Groups
    modules: dict[str, nn.Module] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.modules = dict(self.model.named_modules())

    def module(self, fqn: str) -> nn.Module:
        try:
            return self.modules[fqn]
        except KeyError:
            raise ApplyError(
                f"planc.runtime.install: the compiled plan names `{fqn}`, which this model does not have; "
                "compile the plan against this model (planc.apply does) instead of reusing a CompiledPlan."
            ) from None


def step_set_experts_implementation(state: InstallState) -> None:
    """transformers' experts dispatch reads `config._experts_implementation`: set it its own way."""
    impl, row = state.compiled.experts_settings.implementation, state.compiled.experts_implementation
    if row.megamoe or not state.compiled.experts:
        return  # Mega MoE gets an instance forward (step_install_megamoe); transformers refuses a runtime switch to it
    can = getattr(type(state.model), "_can_set_experts_implementation", None)
    if row.class_forward and callable(can) and not can():
        return  # the class runs its own experts forward and refuses any switch (the compiler checked: PLC624)
    if not hasattr(state.model, "set_experts_implementation"):
        raise ApplyError(
            f"planc.runtime.install: {type(state.model).__name__} is not a transformers PreTrainedModel, so its "
            f"experts implementation cannot be set to `{impl}`. Apply the plan to a transformers model."
        )
    cast("PreTrainedModel", state.model).set_experts_implementation(impl)


def step_shard_parameters(state: InstallState) -> None:
    """Every parameter assignment: TP styles slice by feature, `grouped_gemm` by expert."""
    num_experts = {e.fqn: e.num_experts for e in state.compiled.experts}
    for a in state.compiled.assignments:
        if a.target != "parameter":
            continue
        owner_name, _, pname = a.fqn.rpartition(".")
        owner = state.module(owner_name)
        owner._planc_fqn = owner_name  # type: ignore[assignment]  # plain attributes; torch types them as tensors or modules
        if splits_by_expert(a.style):
            # a parameter of a module inside the experts (a per-expert norm) is sliced alike; its owner is not the experts
            shard_expert_tensor(owner, pname, state.groups, num_experts.get(owner_name),
                                experts_module=owner_name in num_experts)
        elif dispatches_experts(a.style):
            continue  # a module style inherited by its parameters: grouped_gemm rules shard them
        else:
            style = tp_style(a.style, a.rule.where)
            if isinstance(owner._parameters.get(pname), DTensor):
                raise ApplyError(
                    f"planc.runtime.install: {a.fqn} ({a.rule.where}) is already sharded by another rule; a "
                    "parameter takes one style."
                )
            style.shard_param(owner, pname, state.groups.tp_mesh)


def step_install_tp_forwards(state: InstallState) -> None:
    """Every module assignment of the TP table: wrap its forward with the style's layouts."""
    for a in state.compiled.assignments:
        if a.target != "module" or STYLE[a.style].section == "ep":
            continue
        module = state.module(a.fqn)
        module._planc_fqn = a.fqn  # type: ignore[assignment]  # plain attributes; torch types them as tensors or modules
        if a.style == "mla_kv_a_proj":
            module._planc_rope_dim = _rope_dim(state, a.fqn)  # type: ignore[assignment]  # as _planc_fqn
        tp_style(a.style, a.rule.where).install(module, state.groups.tp_mesh)


def _rope_dim(state: InstallState, fqn: str) -> Optional[int]:
    """`qk_rope_head_dim` of the attention module holding `fqn`, else of the config it or the model carries."""
    parent = state.module(fqn.rpartition(".")[0]) if "." in fqn else None
    for source in (parent, getattr(parent, "config", None)):
        value = getattr(source, "qk_rope_head_dim", None)
        if isinstance(value, int):
            return value
    config = getattr(state.model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    return getattr(text, "qk_rope_head_dim", None)


def step_install_megamoe(state: InstallState) -> None:
    """Mega MoE experts (`deepgemm_megamoe`): their forward (quantizing to FP4 when the plan says so)."""
    if not state.compiled.experts_implementation.megamoe:
        return
    from planc.runtime.megamoe import install_megamoe_forward

    settings = _megamoe_settings(state.compiled)
    for e in state.compiled.experts:
        module = state.module(e.fqn)
        module._planc_fqn = e.fqn  # type: ignore[assignment]  # plain attributes; torch types them as tensors or modules
        install_megamoe_forward(
            module,
            backend=settings.backend,
            max_tokens_per_rank=settings.max_tokens_per_rank,
            activation_clamp=settings.activation_clamp,
            quantize=settings.quantize,
            math=settings.math,
            num_global_experts=e.num_experts,
            ep_rank=state.groups.ep_rank,
            ep_size=state.groups.ep_size,
        )


def step_install_ep_forwards(state: InstallState) -> None:
    """Every experts module with an EP strategy: bind its runtime and route the forward through it."""
    for e in state.compiled.experts:
        if e.strategy is None:
            continue
        module = state.module(e.fqn)
        module._planc_fqn = e.fqn  # type: ignore[assignment]  # plain attributes; torch types them as tensors or modules
        if e.dispatch == "dense":  # every token pre-scaled (Llama 4): no routed pairs
            install_dense_ep_forward(module, e.strategy, state.groups, e.num_experts)
            continue
        runtime = EP_RUNTIMES[e.strategy.name](module, e.strategy, state.groups)
        local = runtime.num_local_experts
        if local * state.groups.ep_size != e.num_experts:
            raise ApplyError(
                f"planc.runtime.install: {e.fqn} holds {local} experts per rank, but {e.num_experts} experts over "
                f"{state.groups.ep_size} EP ranks is {e.num_experts // state.groups.ep_size}: shard every expert "
                "tensor with `grouped_gemm` before `ep_dispatch_experts`."
            )
        install_ep_forward(module, runtime)


def step_mark_applied(state: InstallState) -> None:
    """Mark the model (double apply is refused) and the touched modules (other tools see them as hooked)."""
    for a in state.compiled.assignments:
        if a.target == "module":
            state.module(a.fqn)._is_hooked = True  # type: ignore[assignment]  # plain flags and records (torch types
    state.model._planc_plan = state.compiled  # type: ignore[assignment]  # plain attributes; torch types them as tensors or modules
    state.model._planc_groups = state.groups  # type: ignore[assignment]  # module attributes as tensors or modules)
    guard_applied_model(state.model)  # save_pretrained / deepcopy refuse with what to call instead


def step_activation_checkpointing(state: InstallState) -> None:
    """`training.activation_checkpointing: full`: each decoder layer recomputed in backward, before the dp wrap."""
    from planc.runtime.activation_checkpointing import install_activation_checkpointing

    install_activation_checkpointing(state.model, state.compiled)


def step_data_parallel(state: InstallState) -> None:
    """`training.data_parallel` over the dp replicas (replicate or FSDP2), after TP/EP: the last step."""
    from planc.runtime.clip import guard_torch_clip_grad_norm
    from planc.runtime.data_parallel import install_data_parallel

    install_data_parallel(state.model, state.compiled, state.groups)
    guard_torch_clip_grad_norm()


def step_declare_to_trainers(state: InstallState) -> None:
    """Describe the model as transformers describes one it sharded itself: Trainer and Accelerate leave it to planc."""
    from planc.runtime.trainers import declare_to_trainers

    declare_to_trainers(state.model, state.compiled)


def step_guard_adapters(state: InstallState) -> None:
    """PEFT LoRA adapters added after this call must go through planc.distribute_adapters: refused at a training
    forward otherwise (planc.runtime.adapters)."""
    from planc.runtime.adapters import guard_adapters

    p = state.compiled.parallel
    guard_adapters(state.model, p.tp_size, p.dp_size)


def step_check_registered_styles(state: InstallState) -> None:
    """Registered TP styles the plan uses shard a probe as their rows say (and, on nn.Linear modules, compute the
    unsharded linear in the row's layouts), on this TP mesh, before the model is touched."""
    from planc.runtime.extensions import check_shards

    check_shards(state.compiled, state.groups.tp_mesh, state.model)


INSTALL_STEPS: list[Callable[[InstallState], None]] = [
    step_check_registered_styles,
    step_set_experts_implementation,
    step_shard_parameters,
    step_install_tp_forwards,
    step_install_megamoe,
    step_install_ep_forwards,
    step_mark_applied,
    step_activation_checkpointing,
    step_data_parallel,
    step_declare_to_trainers,
    step_guard_adapters,
]


def install_atomically(
    state: InstallState,
    *,
    after_sharding: Optional[Callable[[InstallState], None]] = None,
    what: str = "planc.apply",
) -> None:
    """Run `INSTALL_STEPS` on every rank; if any rank fails, every rank restores its snapshot and raises.

    `after_sharding`: planc.load's fill step, run right after `step_shard_parameters` (the model was
    sharded on `meta`; the fill reads this rank's bytes into it) and before any forward is installed.
    """
    snapshot = Snapshot(state.model)
    error: Optional[BaseException] = None
    try:
        for step in INSTALL_STEPS:
            step(state)
            if step is step_shard_parameters and after_sharding is not None:
                after_sharding(state)
    except Exception as e:  # noqa: BLE001 - any failure rolls back, then is re-raised with context
        error = e
    # All or nothing across the world too: a rank that failed makes every rank roll back.
    if _all_agree(error is None):
        return
    outcomes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}")
    failed = [(rank, msg) for rank, msg in enumerate(outcomes) if msg is not None]
    if failed:
        snapshot.restore()
        outcome = (
            "no model was returned" if what == "planc.load" else "the model was restored exactly as it was"
        )
        raise ApplyError(f"{what} failed while installing; {outcome}:\n{_by_message(failed)}") from error
