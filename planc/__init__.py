"""planc: compile declarative tensor- and expert-parallel plans for Mixture-of-Experts models.

The public API is imported lazily so that `import planc` (and `planc lint`) never pulls in torch.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["load_plan", "lint_paths", "compile", "apply", "load", "destroy_megamoe_buffers", "__version__"]


def load_plan(source):
    """Load and validate a plan (path, YAML string, mapping or LoadedPlan)."""
    from planc.spec.load import load_plan as _load

    return _load(source)


def lint_paths(paths, **kwargs):
    """Lint plan files or directories; returns the list of Diagnostics."""
    from planc.lint.runner import lint_paths as _lint

    return _lint(paths, **kwargs)


def compile(plan, model):  # noqa: A001 - the verb is the API
    """Resolve `plan` against `model` (never changes it) and return the CompiledPlan."""
    from planc.compiler.resolve import compile_plan

    return compile_plan(plan, model)


def apply(model, plan, *, mesh=None):
    """Compile `plan` against `model`, then shard and install it on every rank (all or nothing)."""
    from planc.runtime.install import apply as _apply

    return _apply(model, plan, mesh=mesh)


def load(source, plan, *, dtype=None, device=None, mesh=None):
    """Load the checkpoint directory `source` sharded by `plan`: every rank reads only its own shards.

    Returns the applied model (as `from_pretrained` returns one); its CompiledPlan is `model._planc_plan`.
    """
    from planc.runtime.checkpoint.load import load as _load

    return _load(source, plan, dtype=dtype, device=device, mesh=mesh)


def destroy_megamoe_buffers() -> None:
    """Free every shared Mega MoE buffer; the next forward allocates again."""
    from planc.runtime.megamoe import destroy_megamoe_buffers as _destroy

    _destroy()
