"""compile_plan(): resolve a plan against a model's real module tree, or refuse with every reason at once.

transformers applies a plan as it finds it: a rule that matches nothing is a warning after the weights
are loaded, experts without a rule are silently replicated, a module rule before its parameters'
rules computes wrong results. Here each of those is found before a parameter is touched, against
the concrete module paths, and reported together in one CompileError whose problems name the module,
the plan line and what to write instead. Reads the model by duck typing (see `walk.py`); no torch.

`Resolver.run` is the whole pipeline, read top to bottom; each pass lives in its own module:
`match` (patterns -> targets, order, inheritance), `checks` (model-aware refusals, one module per
concern), `experts_assignments` (the EP strategy and each experts module), `layout` (the activation
layouts through each block), `accounting` (bytes per rank, coverage, warnings).
"""

from __future__ import annotations

from typing import Any, Optional

from planc.compiler import accounting, layout, match
from planc.compiler.checks import forwards, shards, targets
from planc.compiler.experts_assignments import experts_assignments, resolve_strategy
from planc.compiler.compiled import CompiledPlan
from planc.compiler.context import PlanRule, Problems, key_where
from planc.compiler.walk import ModelWalk, walk_model
from planc.errors import CompileError, PlancError
from planc.lint.diagnostic import Diagnostic
from planc.spec.loaded_plan import LoadedPlan
from planc.spec.sizes import Sizes, sizes_hint, solve_sizes


class Resolver:
    """The state the passes share: the loaded plan, the model walk, the rules, the problems."""

    def __init__(self, loaded: LoadedPlan, walk: ModelWalk, *, suggest_sizes: bool = True) -> None:
        self.loaded = loaded
        self.plan = loaded.plan
        self.walk = walk
        self.parallel = self.plan.parallel
        self.tp, self.ep = self.parallel.tp_size, self.parallel.ep_size
        self.active = {"tp": self.tp > 1, "ep": self.ep > 1}
        self.megamoe = self.plan.experts.implementation_row.megamoe
        self.problems = Problems()
        self.warnings: list[Diagnostic] = []
        self.rules: list[PlanRule] = []
        self.by_dtype: dict[str, int] = {}  # filled by the accounting pass
        self._suggest = suggest_sizes
        self._hint: Optional[str] = None

    def sizes_hint(self, fallback: str) -> str:
        """Sizes under which these rules compile cleanly against this model (`planc.spec.sizes.solve_sizes`):
        on the plan's own world first; when none keeps experts expert-parallel there, the nearest worlds
        that do, and the sizes without EP on this world. `fallback` when nothing fits."""
        if not self._suggest:
            return fallback
        if self._hint is None:
            self._hint = self._solve_hint() or fallback
        return self._hint

    def _solve(self, world: int, need_ep: bool, limit: int = 3) -> list[Sizes]:
        p = self.parallel
        experts = [m.experts.num_experts for m in self.walk.experts if m.experts is not None]
        current = Sizes(p.tp_size, p.ep_size, p.dp_size)
        return solve_sizes(
            world,
            num_experts=min(experts) if experts and need_ep else None,
            need_ep=need_ep,
            prefer=Sizes(p.tp_size, p.ep_size, max(1, world // p.tp_size)),
            accept=lambda s: s != current and compiles_under(self, s),
            limit=limit,
        )

    def _solve_hint(self) -> Optional[str]:
        world = self.parallel.world_size
        need_ep = self.parallel.ep_size > 1 and bool(self.plan.ep_plan)
        found = self._solve(world, need_ep)
        if found:
            return sizes_hint(found, world, "")
        if not need_ep:
            return None
        nearest = sorted((w for w in range(2, 4 * world + 1) if w != world), key=lambda w: (abs(w - world), w))
        others = []
        for w in nearest[:12]:
            got = self._solve(w, True, limit=1)
            if got:
                others.append(f"launch {w} ranks with {got[0].yaml()}")
            if len(others) == 2:
                break
        plain = self._solve(world, False, limit=1)
        parts = others + ([f"keep {world} ranks without expert parallelism: {plain[0].yaml()}"] if plain else [])
        if not parts:
            return None
        return f"no expert-parallel sizes on {world} ranks pass the other checks; " + ", or ".join(parts)

    def run(self) -> CompiledPlan:
        targets.check_sizes(self)
        if self.problems:  # sizes that do not fit make every later problem moot: report them alone
            raise CompileError(self.problems.build())
        targets.check_model_type(self)
        match.collect_rules(self)
        match.match_rules(self)
        maps = match.table_maps(self)
        ep_experts = match.find_ep_experts(self, maps)
        assignments, final = match.expand(self, maps, ep_experts)
        targets.check_tied(self, final)
        shards.check_shards(self, assignments, final)
        shards.check_block_grid(self, assignments, final)
        forwards.check_bare_parameters(self, assignments, final)
        forwards.check_dense_experts(self, final)
        forwards.check_experts_implementation(self, key_where(self.loaded, ("experts", "implementation")))
        layout.check_layouts(self, assignments, final)
        strategy = resolve_strategy(self, ep_experts)
        experts = experts_assignments(self, final, strategy)
        total, sharded, replicated, per_rule_bytes, replicated_groups = accounting.account(self, final)
        if self.problems:
            raise CompileError(self.problems.build())
        accounting.table_warnings(self, replicated_groups)
        return CompiledPlan(
            model_type=self.walk.model_type or self.plan.model.type,
            model_class=self.walk.model_class,
            parallel=self.parallel,
            experts_settings=self.plan.experts,
            assignments=tuple(assignments),
            experts=tuple(experts),
            coverage=tuple(accounting.coverage(self, assignments, per_rule_bytes)),
            bytes_sharded_per_rank=sharded,
            bytes_replicated_per_rank=replicated,
            warnings=tuple(self.warnings),
            plan_name=self.plan.name,
            plan_path=self.loaded.path,
            bytes_total=total,
            replicated=replicated_groups,
            bytes_per_rank_by_dtype=tuple(sorted(self.by_dtype.items(), key=lambda kv: -kv[1])),
            training=self.plan.training,
        )


def with_sizes(loaded: LoadedPlan, sizes: Sizes) -> LoadedPlan:
    """`loaded` with its `parallel` replaced (positions kept): what the plan would be under other sizes."""
    import dataclasses

    from planc.spec.model import Parallel

    plan = loaded.plan.model_copy(update={"parallel": Parallel(tp_size=sizes.tp, ep_size=sizes.ep, dp_size=sizes.dp)})
    return dataclasses.replace(loaded, plan=plan)


def compiles_under(resolver: Resolver, sizes: Sizes) -> bool:
    """Whether the plan's rules compile cleanly against the same model under `sizes`.

    A candidate the user never wrote is not linted, so any refusal (the EP strategy a Mega MoE kernel needs
    at sizes where the EP group does not share a batch, say) only means "not these sizes", never an error."""
    try:
        Resolver(with_sizes(resolver.loaded, sizes), resolver.walk, suggest_sizes=False).run()
    except PlancError:
        return False
    return True


def sizes_for_world(loaded: LoadedPlan, model: Any, world: int, limit: int = 3) -> list[Sizes]:
    """Sizes for `world` ranks under which `loaded`'s rules compile cleanly against `model` (apply's world hint)."""
    r = Resolver(loaded, walk_model(model), suggest_sizes=False)
    p = r.parallel
    experts = [m.experts.num_experts for m in r.walk.experts if m.experts is not None]
    need_ep = p.ep_size > 1 and bool(r.plan.ep_plan)
    return solve_sizes(
        world,
        num_experts=min(experts) if experts and need_ep else None,
        need_ep=need_ep,
        prefer=Sizes(p.tp_size, p.ep_size, max(1, world // p.tp_size)),
        accept=lambda s: compiles_under(r, s),
        limit=limit,
    )


def compile_plan(model: Any, loaded: LoadedPlan) -> CompiledPlan:
    """Resolve `loaded` against `model` (a model, or its ModelWalk: `planc explain` reads a stored one); never changes
    the model.

    Raises CompileError listing every problem found (each with module path, plan position and hint). Every other
    plan source (path, YAML text, mapping, Plan) is loaded once, at the public face: `planc.compile`,
    `planc.apply`, `planc.load`, the commands.
    """
    if not isinstance(loaded, LoadedPlan):
        raise TypeError(
            f"compile_plan takes a LoadedPlan (planc.load_plan), not {type(loaded).__name__}; planc.compile(model, "
            "plan) takes any plan source"
        )
    return Resolver(loaded, model if isinstance(model, ModelWalk) else walk_model(model)).run()
