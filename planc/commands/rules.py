"""`planc rules [CODE|NAME]`: list the lint rules, or print one rule's doc and examples."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rule", nargs="?", metavar="CODE", help="a rule code (PLC402) or name (shared-batch-needs-ep-equal-tp)")


def explain(r) -> str:
    """The text `planc rules CODE` prints (docs/lint.md renders the same fields as markdown: planc.lint.docs)."""
    lines = [f"{r.code} {r.name} ({r.severity}, {r.family})", "", r.title + ".", "", r.doc]
    if r.bad:
        lines += ["", "Fails:", "", *("    " + line for line in r.bad.rstrip("\n").split("\n"))]
    if r.good:
        lines += ["", "Passes:", "", *("    " + line for line in r.good.rstrip("\n").split("\n"))]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    import sys

    from planc.lint.registry import all_rules, get
    from planc.lint.suggest import did_you_mean

    if args.rule:
        r = get(args.rule)
        if r is None:
            names = [x.code for x in all_rules()] + [x.name for x in all_rules()]
            guess = did_you_mean(args.rule.upper(), names) or did_you_mean(args.rule.lower(), names)
            extra = f" (did you mean {guess}?)" if guess else ""
            sys.stderr.write(f"planc rules: no rule {args.rule!r}{extra}; `planc rules` lists them\n")
            return 2
        sys.stdout.write(explain(r))
        return 0
    rules = all_rules()
    width = max(len(r.name) for r in rules)
    for r in rules:
        sys.stdout.write(f"{r.code}  {r.name:<{width}}  {r.severity:<7}  {r.title}\n")
    return 0
