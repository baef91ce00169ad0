"""The rules the compiler emits: importing this module registers each one, from the module that checks it.

Each compile rule (code, name, title, doc, a failing and a passing plan) is registered with
`planc.lint.registry.compile_rule` beside the check that reports it, as lint's rules are beside theirs.
planc/__init__.py names this module to the registry, which imports it when every rule is looked up
(`planc rules`, the generated docs/lint.md): lint never imports the compiler, and
`planc lint` never imports this module.
"""

from planc.compiler import accounting, experts_assignments, layout, match, memory  # noqa: F401
from planc.compiler.checks import experts, forwards, megamoe, shards, targets  # noqa: F401
