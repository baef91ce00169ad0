"""`planc.verify`: certify that a plan's sharded run computes what the unsharded model computes, on CPU ranks.

The steps, each refusing bad input with one clear message (VerifyReport.error, exit 2): load the plan at the
sizes that run; build the model's config from its source and shrink it (planc.verification.shrink); build the model
once here and compile the plan against it (the compile diagnostics when it does not resolve); check the host can
hold the world; then run the stages (planc.verification.stages) on `world_size` gloo processes and gather the report.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from typing import Any, Callable, Iterator, Mapping, Optional

from planc.errors import CompileError, ModelBuildError, PlanError, VerifyError
from planc.spec.choices import EXPERTS_IMPLEMENTATIONS
from planc.verification.report import Divergence, RuleRef, StageResult, VerifyReport
from planc.verification.source import BuildTarget, ModelSource, target_name
from planc.verification.tolerance import tolerance

DTYPES = ("float32", "bfloat16")
MAX_WORLD = 64  # gloo processes one host runs
# bytes a rank holds per parameter byte: the model, its twin, their gradients, AdamW's two moments each
_BYTES_PER_PARAM_BYTE = 8
TIMEOUT_S = 1800.0

Progress = Callable[[str], None]


def _host_memory() -> Optional[int]:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _source(build: Any, model: Optional[str], model_type: Optional[str], trust_remote_code: bool,
            overrides: dict) -> ModelSource:
    given = [x for x in (build, model, model_type) if x is not None]
    if len(given) > 1:
        raise VerifyError("give one model source: a build target, --model DIR or --model-type T")
    if build is not None:
        if overrides:
            raise VerifyError("--set changes a config; a --build function builds its own model: set it there")
        return ModelSource("build", build)
    if model is not None:
        return ModelSource("dir", os.fspath(model), trust_remote_code, dict(overrides))
    return ModelSource("type", model_type, False, dict(overrides))


def verify(build: Optional[BuildTarget] = None, plan: Any = None, *, parallel: Optional[Mapping[str, int]] = None,
           train: bool = False, dtype: Optional[str] = None, model: Optional[str] = None,
           model_type: Optional[str] = None, trust_remote_code: bool = False, overrides: Optional[dict] = None,
           shrink: bool = True, reshard: Optional[Mapping[str, int]] = None, seed: int = 0,
           progress: Optional[Progress] = None, memory: bool = False, kernels: Optional[bool] = None) -> VerifyReport:
    """Run `plan` at its own sizes (or `parallel`) on CPU gloo ranks against the unsharded twin and report.

    The model: `build` (`"pkg.module:function"` or a module-level callable returning a fresh, seeded nn.Module),
    `model` (a local checkpoint or config directory), or `model_type` (a transformers family's default config);
    none of them: the plan's `model.type`. `train` (or a `training:` section in the plan) adds the training stages.
    `reshard`: the sizes the saved checkpoint is loaded back at (default: half of tp and ep; `{}`: no reshard stage).
    `memory`: also rank 0 at full width under the fake process group, measured beside `planc explain`'s predicted
    peak (the `memory` stage; planc.verification.memory_check).
    `kernels`: the Mega MoE kernel stages (planc.verification.kernels: the Triton backend against the reference
    backend at the plan's real per-rank shapes); None runs them where a CUDA GPU is, True also under Triton's CPU
    interpreter, False never. Where they cannot run, `report.skipped` says why (not a failure).
    Never raises for bad input: the report's `error` says what could not run (`exit_code` 2)."""
    started = time.monotonic()
    say = progress or (lambda _text: None)
    report = VerifyReport(plan=str(plan), world_size=0, sizes={}, dtype=dtype or "float32", model="")
    try:
        with _quiet():
            _run(report, build, plan, parallel=parallel, train=train, dtype=dtype or "float32", model=model,
                 model_type=model_type, trust_remote_code=trust_remote_code, overrides=overrides or {}, shrink=shrink,
                 reshard=reshard, seed=seed, say=say, announce=progress is not None and sys.stderr.isatty(),
                 kernels=kernels)
            if memory:
                _memory(report, build, plan, parallel=parallel, train=train, model=model, model_type=model_type,
                        trust_remote_code=trust_remote_code, overrides=overrides or {}, say=say)
    except (VerifyError, PlanError, CompileError, ModelBuildError) as e:
        report.error = str(e)
    except KeyboardInterrupt:
        report.error = "interrupted (every rank was stopped)"
    report.seconds = time.monotonic() - started
    return report


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """While verify builds and shrinks configs here: no warnings, transformers' logging at errors only (a shrunk
    config's RoPE or cache remarks are about the tiny model, not the user's); restored after."""
    import warnings

    hf_logging: Any
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        hf_logging = None
    level = hf_logging.get_verbosity() if hf_logging is not None else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if hf_logging is not None:
            hf_logging.set_verbosity_error()
        try:
            yield
        finally:
            if hf_logging is not None and level is not None:
                hf_logging.set_verbosity(level)


def _run(report: VerifyReport, build, plan, *, parallel, train, dtype, model, model_type, trust_remote_code,
         overrides, shrink, reshard, seed, say, announce, kernels=None) -> None:
    from planc.lint.plan_loader import load_plan

    if dtype not in DTYPES:
        raise VerifyError(f"dtype {dtype!r}: verify runs {' or '.join(DTYPES)}")
    if plan is None:
        raise VerifyError("no plan given")
    try:
        loaded = load_plan(plan, parallel=dict(parallel) if parallel else None)
    except PlanError as e:
        raise VerifyError(f"the plan does not load:\n{e}") from None
    loaded, inference_only = _on_cpu(loaded, report)
    if inference_only and train:
        raise VerifyError(f"experts.implementation `{loaded.plan.experts.implementation}` is inference-only: "
                          "there are no training stages to run; drop --train (and the plan's `training:`)")
    report.plan = loaded.path or str(loaded.plan.name or "<plan>")
    p = loaded.plan.parallel
    report.sizes = {"tp_size": p.tp_size, "ep_size": p.ep_size, "dp_size": p.dp_size}
    report.world_size = world = p.world_size
    if world > MAX_WORLD:
        raise VerifyError(f"the plan runs {world} ranks; one host runs at most {MAX_WORLD} gloo processes: verify it "
                          "at smaller sizes with --parallel")
    source = _source(build, model, model_type or (None if build or model else loaded.plan.model.type),
                     trust_remote_code, overrides)
    report.model = source.describe()
    train = train or loaded.plan.training is not None
    say("building the model")
    config, lines = _config(source, loaded, shrink, report)
    report.shrink = list(lines)
    compiled = _check_before_spawning(source, config, loaded, seed, world)
    from planc.verification.stages import Job, ReshardJob, run_rank, run_reshard_rank

    back = _reshard_plan(loaded, reshard, source, report)
    with tempfile.TemporaryDirectory(prefix="planc-verify-") as tmp:
        job = Job(source=source, config=config, plan=loaded, dtype=dtype, seed=seed, train=train, serve=not train,
                  inference_only=inference_only,
                  save_dir=tmp if back is not None else None, progress=announce)
        say(f"running the stages on {world} ranks")
        results = _run_world(run_rank, world, job)
        if back is not None and results[0]["divergence"] is None:
            say(f"loading the checkpoint back on {back.plan.parallel.world_size} ranks")
            again = _run_world(run_reshard_rank, back.plan.parallel.world_size,
                               ReshardJob(source, config, back, dtype, seed, tmp))
            for r, a in zip(results, again):
                r["stages"] += a["stages"]
            for r in results[len(again):]:
                r["stages"] += again[0]["stages"]
    _gather(report, results, compiled, dtype)
    if EXPERTS_IMPLEMENTATIONS[loaded.plan.experts.implementation].megamoe:
        _kernels(report, loaded, source, compiled, kernels, seed, say)
    elif kernels:
        report.notes.append("no kernel stages: the plan has no Mega MoE experts (`experts.implementation: "
                            "deepgemm_megamoe`), whose Triton kernels they check")


def _kernels(report: VerifyReport, loaded, source: ModelSource, compiled, kernels: Optional[bool], seed: int,
             say) -> None:
    """The Mega MoE kernel stages at the real config's per-rank shapes (planc.verification.kernels), or the reason
    they could not run here in `report.skipped`."""
    from planc.verification.kernels import STAGE, kernel_device, run_kernel_stages
    from planc.verification.report import SkippedStage

    device, why = kernel_device(kernels)
    if device is not None and source.kind == "build":
        device, why = None, "a --build model has no config to take the real per-rank shapes from"
    if device is None:
        report.skipped.append(SkippedStage(STAGE, why))
        return
    say("running the kernel stages (the Triton backend against the reference backend)")
    outcome = run_kernel_stages(loaded, source.full_config(), device, seed=seed, say=say)
    if outcome.skipped:
        report.skipped.append(SkippedStage(STAGE, outcome.skipped))
    report.stages += outcome.stages
    report.notes += outcome.notes
    found = outcome.divergence
    if found is not None and report.first_divergence is None:
        rules = _rules_of(compiled.assignments, found.module)
        report.first_divergence = Divergence(found.stage, found.direction, found.module, found.rel_error,
                                             rules=rules, note=found.note, tokens=found.tokens, expert=found.expert)


def _memory(report: VerifyReport, build, plan, *, parallel, train, model, model_type, trust_remote_code, overrides,
            say) -> None:
    """The `memory` stage: rank 0 at full width (the fewest layers that hold one of each kind) measured beside the
    predicted peak; a build source has no config to build it from (a note says so)."""
    from planc.lint.plan_loader import load_plan
    from planc.verification.memory_check import UNDER_PREDICTION, memory_stage
    from planc.verification.shrink import no_shrink

    if build is not None:
        report.notes.append("no memory stage: a --build model has no config to build rank 0 at full width from")
        return
    loaded = load_plan(plan, parallel=dict(parallel) if parallel else None)
    source = _source(None, model, model_type or (None if model else loaded.plan.model.type), trust_remote_code,
                     overrides)
    say("measuring rank 0 at full width (fake process group)")
    kept = no_shrink(source.full_config())
    s = memory_stage(loaded, kept.config, train=train or loaded.plan.training is not None)
    rule = f"memory: explain's predicted peak at most {UNDER_PREDICTION:.0%} under rank 0's measured peak"
    report.stages.append(StageResult("memory", s["abs"], s["rel"], UNDER_PREDICTION, rule, s["rel"] <= UNDER_PREDICTION,
                                     f"{s['detail']}; {kept.lines[0]}"))


def _on_cpu(loaded, report: VerifyReport):
    """The plan as the CPU ranks run it, and whether its experts are inference-only. A Mega MoE plan whose backend is
    chosen per device (`auto`) runs the `reference` backend (pure PyTorch, FP4 quantized); its twin runs the same
    backend unsharded, so the comparison is the plan's sharding, not FP4 against bf16."""
    from planc.lint.plan_loader import with_values
    from planc.spec.choices import EXPERTS_IMPLEMENTATIONS, MEGAMOE_BACKENDS

    experts = loaded.plan.experts
    row = EXPERTS_IMPLEMENTATIONS[experts.implementation]
    if row.megamoe and experts.megamoe is not None and experts.megamoe.backend != "reference":
        backend = experts.megamoe.backend
        if not MEGAMOE_BACKENDS[backend].per_device:
            raise VerifyError(f"experts.megamoe.backend `{backend}` needs a GPU; verify runs on CPU ranks: write "
                              "`backend: reference` (or `auto`) to verify the plan's sharding with the reference backend")
        loaded = with_values(loaded, ("experts", "megamoe"), {"backend": "reference"}, "verify runs on CPU")
        report.notes.append("Mega MoE: on CPU the `reference` backend runs (pure PyTorch, FP4 experts), against the "
                            "unsharded model running the same backend; the Triton kernels are checked by the kernel "
                            "stages, on a GPU")
    return loaded, row.inference_only


def _reshard_plan(loaded, reshard: Optional[Mapping[str, int]], source: ModelSource, report: VerifyReport):
    """The plan at the sizes the checkpoint is read back at, or None (no reshard stage, with a note why)."""
    from planc.lint.plan_loader import with_parallel

    if reshard is not None and not reshard:
        return None
    if source.kind == "build":
        report.notes.append("no reshard stage: planc.load rebuilds a transformers model from its config, and a "
                            "--build model's class is the user's own")
        return None
    megamoe = loaded.plan.experts.megamoe
    if megamoe is not None and megamoe.quantize == "fp4":
        report.notes.append("no reshard stage: experts quantized to FP4 at apply time cannot be saved by planc.save")
        return None
    p = loaded.plan.parallel
    sizes = dict(reshard) if reshard else {"tp_size": max(1, p.tp_size // 2), "ep_size": max(1, p.ep_size // 2)}
    if all(sizes.get(k, getattr(p, k)) == getattr(p, k) for k in ("tp_size", "ep_size", "dp_size")):
        report.notes.append("no reshard stage: the plan already runs on one rank")
        return None
    try:
        return with_parallel(loaded, sizes)
    except PlanError as e:
        raise VerifyError(f"--reshard {sizes}: the plan does not load at those sizes:\n{e}") from None


def _config(source: ModelSource, loaded, shrink: bool, report) -> tuple[Any, tuple[str, ...]]:
    if source.kind == "build":
        return None, ("none: a --build model runs at the widths its function builds",)
    from planc.models.build import meta_model
    from planc.verification.shrink import check_faithful, no_shrink, shrink as shrink_config

    real = source.full_config()
    if not shrink:
        kept = no_shrink(real)
        return kept.config, kept.lines
    model_type = getattr(real, "model_type", None) or loaded.plan.model.type
    candidates = shrink_config(real, model_type, loaded, user_overrides=source.overrides)
    try:
        real_model = meta_model(real)
    except ModelBuildError as e:
        raise VerifyError(f"{source.describe()}: {e}") from None
    refused: Optional[VerifyError] = None
    for shrunk in candidates:
        try:
            check_faithful(real_model, meta_model(shrunk.config), loaded)
        except ModelBuildError as e:
            refused = VerifyError(f"{source.describe()}, shrunk: {e}; run the real widths with --no-shrink")
            continue
        except VerifyError as e:
            refused = e
            continue
        return shrunk.config, shrunk.lines
    assert refused is not None
    raise refused


def _check_before_spawning(source: ModelSource, config, loaded, seed: int, world: int) -> Any:
    """Build the model here and compile the plan against it: a model that does not build, a plan that does not
    resolve, or a world the host cannot hold fails in seconds with one message, before any rank starts."""
    from planc.compiler.resolve import compile_plan
    from planc.verification.source import build_model

    model = build_model(source, config, seed)
    try:
        compiled = compile_plan(model, loaded)
    except CompileError as e:
        raise VerifyError(f"the plan does not resolve against the model ({type(model).__name__}):\n{e}") from None
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    need = params * _BYTES_PER_PARAM_BYTE * world + world * 600 * 2 ** 20  # + torch and transformers per process
    free = _host_memory()
    if free is not None and need > free:
        raise VerifyError(f"{world} ranks of this model need about {need / 2 ** 30:.1f} GiB; the host has "
                          f"{free / 2 ** 30:.1f} GiB free: shrink it (drop --no-shrink) or verify at smaller sizes")
    return compiled


def _run_world(fn, world: int, job) -> list[dict]:
    """`fn` on `world` gloo ranks; a rank's failure is one VerifyError naming the rank and the exception, with its
    traceback below for a failure inside planc or torch. SIGTERM stops every rank, as Ctrl-C does."""
    import logging
    import signal
    import threading

    import torch.multiprocessing as mp

    from planc.runtime.local_world import run_local_world

    def interrupted(_signum, _frame):
        raise KeyboardInterrupt

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, interrupted) if main_thread else None
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)  # "Terminating process ... via signal SIGTERM" per peer of a failed rank
    try:
        return run_local_world(fn, world, job, timeout=TIMEOUT_S)
    except mp.ProcessRaisedException as e:
        text = str(e)
        lines = [line for line in text.strip().splitlines() if line.strip()]
        last = lines[-1] if lines else text
        rank = getattr(e, "error_index", "?")
        if any(k in last for k in ("VerifyError", "ModelBuildError", "ApplyError", "CheckpointError")):
            raise VerifyError(f"rank {rank} could not run: {last.split(': ', 1)[-1]}") from None
        raise VerifyError(f"rank {rank} failed: {last}\n{text}") from None
    except mp.ProcessExitedException as e:  # a rank killed: by gloo (SIGABRT) when the ranks' collectives differ
        why = ("the ranks ran different collectives (gloo aborts on a size mismatch), so they cannot have computed the "
               "same thing; a style or EP strategy whose forward or backward communicates on some ranks only does "
               "this" if getattr(e, "signal_name", None) == "SIGABRT" else "out of memory, or killed from outside")
        raise VerifyError(f"a rank died ({e}): {why}") from None
    except TimeoutError as e:
        raise VerifyError(str(e)) from None
    finally:
        spawn_log.setLevel(level)
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _rules_of(compiled_assignments, module: str) -> tuple[RuleRef, ...]:
    refs: list[RuleRef] = []
    for a in compiled_assignments:
        if a.fqn == module or a.fqn.startswith(module + "."):
            r = a.rule
            ref = RuleRef(r.table, r.pattern, r.style, str(r.where))
            if ref not in refs:
                refs.append(ref)
    return tuple(refs)


def _gather(report: VerifyReport, results: list[dict], compiled, dtype: str) -> None:
    names = [s["name"] for s in results[0]["stages"]]
    for i, name in enumerate(names):
        per_rank = [r["stages"][i] for r in results]
        abs_err = max(s["abs"] for s in per_rank)
        rel = max(s["rel"] for s in per_rank)
        tol = tolerance(name, dtype)
        ok = rel <= tol.rel
        report.stages.append(StageResult(name, abs_err, rel, tol.rel, tol.rule, ok, per_rank[0].get("detail", "")))
    for r in results:
        report.notes += [n for n in r["notes"] if n not in report.notes]
    found = results[0]["divergence"]
    if found is not None:
        rules: tuple[RuleRef, ...] = ()
        owner = found["module"]
        while owner and not rules:  # the module's own rules, else those of the nearest module around it
            rules = _rules_of(compiled.assignments, owner)
            owner = owner.rpartition(".")[0]
        note = ""
        if found.get("parameter"):
            own = [a for a in compiled.assignments if a.fqn == found["parameter"]]
            note = (f"`{found['parameter']}` is sharded by {own[0].rule.pattern}: {own[0].style}" if own else
                    f"`{found['parameter']}` is replicated (no rule): a replicated parameter used on sharded "
                    "activations needs its gradient reduced over the ranks")
        note = note or _strategy_note(compiled, found["module"])
        report.first_divergence = Divergence(found["stage"], found["direction"], found["module"], found["rel"],
                                             found.get("parameter"), rules, note)


def _strategy_note(compiled, module: str) -> str:
    """For an experts module: the EP strategy its forward runs (and who registered it, for a project's own)."""
    from planc.spec.extensions import EXTENSIONS

    for e in compiled.experts:
        if e.fqn == module and e.strategy is not None:
            ext = EXTENSIONS.get(e.strategy.name)
            mine = f", registered by {ext.origin} (runtime {ext.runtime_ref})" if ext is not None else ""
            return f"its forward runs the {e.strategy.row.title} EP strategy (`experts.ep_implementation: " \
                   f"{e.strategy.name}`{mine})"
    return ""


def main_progress(stream=sys.stderr) -> Progress:
    """Progress lines on a terminal; nothing when stderr is not one (CI logs stay clean)."""
    if not stream.isatty():
        return lambda _text: None
    return lambda text: print(f"planc verify: {text}...", file=stream, flush=True)


__all__ = ["verify", "target_name", "DTYPES"]
