"""`planc rules [CODE|NAME|STYLE]`: list the lint rules, print one rule's doc and examples, say what a retired
code became, or describe a style from the style table (`planc rules colwise`)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "rule", nargs="?", metavar="CODE",
        help="a rule code (PLC402), a rule name (shared-batch-needs-ep-equal-tp) or a style (colwise)",
    )


def explain(r) -> str:
    """The text `planc rules CODE` prints (docs/lint.md renders the same fields as markdown: planc.lint.docs)."""
    lines = [f"{r.code} {r.name} ({r.severity}, {r.family})", "", r.title + ".", "", r.doc]
    if r.bad:
        lines += ["", "Fails:", "", *("    " + line for line in r.bad.rstrip("\n").split("\n"))]
    if r.good:
        lines += ["", "Passes:", "", *("    " + line for line in r.good.rstrip("\n").split("\n"))]
    return "\n".join(lines) + "\n"


def describe_style(name: str) -> str | None:
    """What `planc rules STYLE` prints: the style's row of planc.spec.styles (or what replaces a removed style)."""
    from planc.lint.registry import all_rules
    from planc.compiler.checks.targets import STYLE_NOT_INSTALLABLE
    from planc.lint.rules_removed import REMOVED_STYLE
    from planc.spec.styles import REMOVED_STYLES, STYLE, TABLE_STYLES

    style = STYLE.get(name)
    if style is None:
        if name in REMOVED_STYLES:
            return (f"{name}: a removed style ({REMOVED_STYLE}): {REMOVED_STYLES[name]}; "
                    f"`planc migrate PLAN --write` rewrites it\n")
        return None
    tables = " and ".join(f"`{t}`" for t, names in TABLE_STYLES.items() if name in names)
    weight, bias = style.placement(2), style.placement(1)
    how = ("keeps every parameter whole" if weight is None and bias is None else
           f"splits a weight on dim {weight}" + (f" and a bias on dim {bias}" if bias is not None else
                                                    ", keeps a bias whole")
           + f" over the {style.mesh.upper()} group" + (" (two packed halves, each split)" if style.packed else ""))
    lines = [f"{name} (style of {tables}; targets a {style.target})", "", style.doc + ".", "",
             f"- parameters: {how}"]
    if style.input or style.output:
        lines.append(f"- activations: takes {style.input or 'any'} input, gives {style.output or 'the same'} output")
    lines.append("- installed by planc's runtime" if style.runtime else
                 f"- not installed by planc's runtime: the compiler refuses it ({STYLE_NOT_INSTALLABLE})")
    about = [f"{r.code} ({r.name})" for r in all_rules() if r.family in ("styles", "removed")]
    lines += ["", f"Rules about styles: {', '.join(about)}; `planc rules CODE` explains one."]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    import sys

    from planc.lint.registry import all_rules, get, retired
    from planc.lint.suggest import did_you_mean
    from planc.spec.styles import ALL_STYLES, REMOVED_STYLES

    if args.rule:
        r = get(args.rule)
        if r is not None:
            sys.stdout.write(explain(r))
            return 0
        gone = retired(args.rule)
        if gone is not None:
            sys.stdout.write(f"{gone.code} was retired in version {gone.version}: use {', '.join(gone.use)} "
                             f"({gone.why}); `planc rules {gone.use[0]}` explains it\n")
            return 0
        style = describe_style(args.rule.strip())
        if style is not None:
            sys.stdout.write(style)
            return 0
        names = [x.code for x in all_rules()] + [x.name for x in all_rules()] + list(ALL_STYLES) + list(REMOVED_STYLES)
        guess = did_you_mean(args.rule.upper(), names) or did_you_mean(args.rule.lower(), names)
        extra = f" (did you mean {guess}?)" if guess else ""
        sys.stderr.write(f"planc rules: no rule or style {args.rule!r}{extra}; `planc rules` lists the rules\n")
        return 2
    rules = all_rules()
    width = max(len(r.name) for r in rules)
    for r in rules:
        sys.stdout.write(f"{r.code}  {r.name:<{width}}  {r.severity:<7}  {r.title}\n")
    return 0
