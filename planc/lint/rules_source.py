"""Source rules: a file that cannot become a plan document (emitted by planc.spec.source and the runner).

These have no check function: the loader finds them before there is a plan to check. They are
registered here so that every code the linter can print has a doc, `planc rules` lists it, and the
tests can hold the loader to the documented codes.
"""

from __future__ import annotations

from planc.lint.registry import Rule, register
from planc.spec import source

NO_PLANS = "PLC010"
INTERNAL = "PLC000"

# Codes that mean "the input could not be read as text": `planc lint` exits 2 on them.
UNREADABLE_CODES = frozenset({source.UNREADABLE, source.NOT_UTF8, source.TOO_LARGE})

register(Rule(
    INTERNAL, "internal-error", "The linter itself failed on this input",
    "planc never lets an exception escape `planc lint`: a bug in a check is reported as this\n"
    "diagnostic (with the exception) instead of a traceback, and the other files are still linted.\n"
    "Please report it with the plan that triggers it.",
    family="source",
))
register(Rule(
    source.YAML_SYNTAX, "yaml-syntax", "The file is not valid YAML",
    "The YAML parser stopped at the position shown. Multiple documents (`---`), control characters\n"
    "and collections used as mapping keys are reported here too.",
    family="source",
    bad="version: 1\nmodel: {type: mixtral\nparallel: {tp_size: 2}\n",
    good="version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2}\n",
))
register(Rule(
    source.UNREADABLE, "unreadable-file", "The path cannot be read",
    "The file does not exist, is not readable, or is a directory given where a file was expected.\n"
    "`planc lint` exits with status 2 on this diagnostic.",
    family="source",
))
register(Rule(
    source.NOT_UTF8, "not-utf8", "The file is not UTF-8 text",
    "Plans are UTF-8 (an initial byte-order mark is allowed). The diagnostic points at the first\n"
    "byte that does not decode. `planc lint` exits with status 2 on this diagnostic.",
    family="source",
))
register(Rule(
    source.TOO_LARGE, "file-too-large", "The file is larger than 1 MiB",
    "A plan is a few dozen lines. The cap bounds the time the linter (and a pre-commit hook) spends on\n"
    "a file that is not a plan. `planc lint` exits with status 2 on this diagnostic.",
    family="source",
))
register(Rule(
    source.TAB_INDENT, "tab-indentation", "A tab character indents a line",
    "YAML allows only spaces for indentation; a tab makes the parser fail with an obscure message.\n"
    "planc points at the first tab instead. Tabs inside strings and comments are fine.",
    family="source",
    bad="version: 1\nmodel:\n\ttype: mixtral\nparallel: {tp_size: 2}\n",
    good="version: 1\nmodel:\n  type: mixtral\nparallel: {tp_size: 2}\n",
))
register(Rule(
    source.UNSAFE_TAG, "yaml-tag", "A YAML tag or merge key would build something other than plain data",
    "Plans hold strings, numbers, booleans, mappings and lists. Any tag that would construct a\n"
    "Python object (`!!python/...`, `!!binary`, `!!set`, custom `!tags`) is refused without being\n"
    "constructed, and so are merge keys (`<<`): share settings with `extends` instead.",
    family="source",
    bad="version: 1\nname: !!python/object/apply:os.system [echo hi]\nmodel: {type: mixtral}\nparallel: {tp_size: 2}\n",
    good="version: 1\nname: echo-hi\nmodel: {type: mixtral}\nparallel: {tp_size: 2}\n",
))
register(Rule(
    source.ALIAS_LIMIT, "alias-limit", "Aliases expand the document past the size cap",
    "Anchors and aliases are expanded with a budget (50,000 values, 4 MiB of text, 64 levels), so a\n"
    "\"billion laughs\" document is rejected in milliseconds. A recursive alias is reported here too.\n"
    "Plans need no anchors; write the values out or use `extends`.",
    family="source",
    bad="version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2}\n"
    + "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n"
    + "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 7)),
    good="version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2}\n",
))
register(Rule(
    source.DUPLICATE_KEY, "duplicate-key", "The same key or pattern appears twice in one mapping",
    "YAML parsers silently keep the last of two equal keys, so a rule written twice in `tp_plan` or\n"
    "`ep_plan` quietly loses one of its styles. planc reports the second occurrence.",
    family="source",
    bad="version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2}\ntp_plan:\n"
    "  model.layers.*.self_attn.o_proj: rowwise\n  model.layers.*.self_attn.o_proj: colwise\n",
    good="version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2}\ntp_plan:\n"
    "  model.layers.*.self_attn.o_proj: rowwise\n",
))
register(Rule(
    source.NOT_A_MAPPING, "not-a-mapping", "The document is empty or not a mapping",
    "A plan is a YAML mapping with at least `version`, `model` and `parallel`.",
    family="source",
    bad="- version: 1\n- model: {type: mixtral}\n",
    good="version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2}\n",
))
register(Rule(
    source.AMBIGUOUS_SCALAR, "ambiguous-scalar", "A value that YAML 1.1 and YAML 1.2 tools read differently",
    "planc reads plans with the YAML 1.2 core schema, like editors (yaml-language-server) and\n"
    "check-jsonschema. PyYAML and the tools built on it read YAML 1.1, where `010` is 8, `0b11` is 3,\n"
    "`1_0` is 10, `1:00` is 60, `on`/`yes`/`off`/`no` are booleans and `2024-01-01` is a date; in\n"
    "YAML 1.2 these are 10 and strings. A plan must mean the same to every tool, so any plain value\n"
    "the two read differently is an error, and so is an integer in another base (`0x10`, `0o10`):\n"
    "write integers in decimal, `true`/`false` for booleans, and quote text that looks like a number.\n"
    "A `%YAML` directive changes nothing: the check is the same under either version.",
    family="source",
    bad="version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 010}\n",
    good="version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 8}\n",
))
register(Rule(
    source.KEY_NOT_STRING, "key-not-a-string", "A mapping key is a number or a boolean",
    "Every key of a plan is a name or a path pattern, and JSON (what the JSON Schema checks) has only\n"
    "string keys. A key that YAML reads as a number or a boolean (`1:`, `true:`, `1.5:`) is reported at\n"
    "the key, with the quoted form to write; planc keeps its text so two such keys never collide.",
    family="source",
    bad="version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2}\ntp_plan:\n  1: colwise\n",
    good="version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2}\ntp_plan:\n  model.layers.*.self_attn.q_proj: colwise\n",
))
register(Rule(
    NO_PLANS, "no-plans", "A directory argument holds no plan files",
    "`planc lint DIR` lints every `*.yaml` / `*.yml` below DIR. A directory without any is almost\n"
    "always a wrong path (a typo in CI would otherwise pass silently).",
    family="source",
))
