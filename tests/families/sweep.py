"""The family sweep: every MoE family of the installed transformers through init, lint, explain and apply.

A driver over planc's commands and public API (it lives beside its tests, outside the package). For each
family (`planc.models.families.moe_families`, found at run time) a tiny config is derived from the family's
own config class (`planc.models.build.tiny_config`, see planc.models.tiny), then:

1. `planc init` writes a plan against that config at tp_size 2 (what two ranks can run);
2. the plan lints clean and compiles against the meta model (what `planc explain` does);
3. on 2 gloo ranks, `planc.apply` of the plan with `ep_implementation` all_to_all, all_reduce and auto
   gives the logits of the unsharded model (fp32, <= 1e-5); a plan without expert parallelism
   (ep_size 1) is applied once. The plan is applied to the top model; the logits come from its forward, or,
   when the top model only generates (Qwen3 Omni MoE), from the submodule built from the family's config
   that has a forward of its own (`comparison_path`: the omni talker).

Every step records an outcome: `pass`, `refused PLCxxx: ...` (planc said no, with its rule code) or
`fail: ...` (anything else). One spawned 2-rank world runs the applies of every family (starting ranks
costs more than the checks). The results render docs/models.md:

    python -m tests.families.sweep --write docs/models.md   # regenerate (about 3 minutes)
"""

from __future__ import annotations

import argparse
import re
import sys
import traceback
from typing import Optional

from planc.errors import PlancError, one_line

TOL = 1e-5
STRATEGIES = ("all_to_all", "all_reduce", "auto")
WORLD = 2
FORWARD_SEED = 2
MAX_TINY_PARAMS = 20_000_000  # fp32 on every rank plus the reference copy: keep the world within CI memory
_CODE = re.compile(r"\b(PLC\d{3})\b")


def outcome_of_error(e: BaseException) -> str:
    """`refused PLCxxx: message` for planc's own refusals (a rule code in the message), else `fail: ...`."""
    text = str(e)
    code = _CODE.search(text)
    if isinstance(e, PlancError) and code:
        lines = [ln.strip() for ln in text.splitlines() if code.group(1) in ln]
        return f"refused {code.group(1)}: {one_line(lines[0] if lines else text, 300)}"
    return f"fail: {type(e).__name__}: {one_line(text, 300)}"


_DEFAULT_CONFIG: dict[str, str] = {}


def default_config_outcome(model_type: str) -> str:
    """What `planc init --from-transformers TYPE` meets without --config: `pass` when transformers' default
    (full-size) config builds a model on meta, else the values that default leaves unset (`planc init` names them)."""
    if model_type not in _DEFAULT_CONFIG:
        from planc.models.build import build_meta_model, config_gaps

        try:
            build_meta_model(model_type)
            _DEFAULT_CONFIG[model_type] = "pass"
        except Exception as e:  # noqa: BLE001 - recorded: the default config does not build
            gaps = config_gaps(model_type, e, limit=3)
            _DEFAULT_CONFIG[model_type] = (
                f"needs --config: `{gaps[0].split()[0]}` {gaps[0].split(' (', 1)[1][:-1]}" if gaps and " (read from " in gaps[0]
                else f"needs --config or --set: {', '.join(f'`{k}`' for k in gaps)} unset" if gaps
                else f"needs --config: {one_line(e, 100)}")
    return _DEFAULT_CONFIG[model_type]


def prepare(fam) -> dict:
    """Steps 1-2 in this process: {'init', 'lint', 'explain', 'plan' (text or None), 'ep'}."""
    import torch

    import planc
    from planc.lint.runner import lint_text
    from planc.models.build import meta_model, tiny_config
    from planc.models.synthesis import init_plan

    rec: dict = {"text_type": fam.text_type, "model_type": fam.model_type, "multimodal": fam.multimodal}
    rec["default_config"] = default_config_outcome(fam.model_type)
    try:
        config = tiny_config(fam)
        meta = meta_model(config, model_class=fam.model_class(config), dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - recorded: transformers cannot build this tiny config
        rec["build"] = f"fail: {type(e).__name__}: {one_line(e, 300)}"
        return rec
    numel = sum(p.numel() for p in meta.parameters())
    if numel > MAX_TINY_PARAMS:
        biggest = max(meta.named_children(), key=lambda nc: sum(p.numel() for p in nc[1].parameters()))[0]
        rec["build"] = (f"fail: the derived config still has {numel / 1e6:.0f}M parameters (mostly `{biggest}`), "
                        f"over the sweep's {MAX_TINY_PARAMS / 1e6:.0f}M")
        return rec
    rec["build"] = "pass"
    try:
        text = init_plan(fam.model_type, config.to_dict(), sizes=(WORLD,))
    except Exception as e:  # noqa: BLE001 - a family planc cannot plan is a recorded outcome
        rec["init"] = outcome_of_error(e) if "PLC" in str(e) else f"refused init: {one_line(e, 300)}"
        return rec
    rec["init"], rec["plan"] = "pass", text
    errors = [d.format() for d in lint_text(text) if d.severity == "error"]
    rec["lint"] = "pass" if not errors else f"fail: {one_line(errors[0], 300)}"
    try:
        compiled = planc.compile(meta, text)
        rec["explain"] = "pass"
        rec["ep"] = compiled.parallel.ep_size > 1
        rec["tp"] = compiled.parallel.tp_size > 1
        rec["rules"] = len(compiled.coverage)
        rec["dropped"] = sorted({c for c in _CODE.findall(text.split("version: 1")[0])})
    except Exception as e:  # noqa: BLE001 - a family planc cannot plan is a recorded outcome
        rec["explain"] = outcome_of_error(e)
    return rec


def _with_strategy(plan: dict, strategy: str) -> dict:
    return {**plan, "experts": {**plan.get("experts", {}), "ep_implementation": strategy}}


def at_world_sizes(text: str) -> dict:
    """A plan's data with its sizes set to what the sweep's world runs: tp 2, ep 2 (or 1 without EP), dp 1."""
    import yaml

    data = yaml.safe_load(text)
    ep = data["parallel"].get("ep_size", 1) > 1
    data["parallel"] = {"tp_size": WORLD, "ep_size": WORLD if ep else 1}
    return data


def apply_world(rank, world_size, jobs):
    """Step 3 on every rank: {text_type: {strategy: outcome}} for the (text_type, plan text, ep) jobs."""
    import copy

    import torch

    from planc import apply
    from planc.models.build import build_tiny_model
    from planc.models.families import family

    out = {}
    for key, text_type, plan, ep in jobs:
        res = out[key] = {}
        try:
            fam = family(text_type)
            base = build_tiny_model(fam)
            path = comparison_path(base, fam)
            if path is None:
                res["build"] = (f"transformers: {type(base).__name__} has no forward of its own (it only generates) "
                                "and no submodule built from the family's config has one: no unsharded logits")
                continue
            target = base.get_submodule(path)
            inputs = comparison_inputs(target, top=not path)
            with torch.no_grad():
                torch.manual_seed(FORWARD_SEED)  # a forward that samples (a diffusion model's canvas) samples alike
                want = _logits(target(**inputs))
        except Exception as e:  # noqa: BLE001 - transformers cannot run the tiny model: recorded
            res["build"] = f"fail: {type(e).__name__}: {one_line(e, 300)}"
            continue
        for strategy in STRATEGIES if ep else ("tp",):
            try:
                model = copy.deepcopy(base)
                apply(model, _with_strategy(plan, strategy) if ep else plan)
                with torch.no_grad():
                    torch.manual_seed(FORWARD_SEED)
                    got = _logits(model.get_submodule(path)(**inputs))
                diff = (got - want).abs().max().item()
                res[strategy] = "pass" if diff <= TOL else f"fail: max |logits diff| {diff:.3g} > {TOL}"
            except Exception as e:  # noqa: BLE001 - every strategy's failure is a recorded outcome
                res[strategy] = outcome_of_error(e)
                if res[strategy].startswith("fail"):
                    res[strategy] += " | " + one_line(traceback.format_exc().splitlines()[-3], 160)
    return out


def _has_own_forward(module) -> bool:
    import torch

    return type(module).forward is not torch.nn.Module.forward


def comparison_path(model, fam) -> Optional[str]:
    """The path of the module whose forward the sweep compares: "" (the top model) when the top model has a
    forward of its own; else, for a top model that only generates (Qwen3 Omni MoE: thinker + talker + code2wav),
    the outermost submodule with a forward of its own whose `config` is one of the configs from the top config
    down to the family's (`fam.config_path`), by identity (the omni talker, whose config holds the talker's
    text config). None when there is no such module. The plan is still applied to the top model."""
    if _has_own_forward(model):
        return ""
    configs, config = [], model.config
    for attr in fam.config_path:
        config = getattr(config, attr, None)
        if config is None:
            break
        configs.append(config)
    found = [(name.count("."), i, name) for i, (name, module) in enumerate(model.named_modules())
             if name and _has_own_forward(module) and any(getattr(module, "config", None) is c for c in configs)]
    return min(found)[2] if found else None


def comparison_inputs(module, top: bool) -> dict:
    """The forward's inputs: token ids for the top model; for a submodule (which its generating parent feeds
    with embeddings: the omni talker ignores `input_ids`) the embeddings of those ids from the unsharded
    module's own input embeddings when its forward takes `inputs_embeds`. Computed once, on the unsharded
    model, so both sides get the same tensor."""
    import inspect

    import torch

    ids = torch.randint(0, _vocab(module), (2, 7), generator=torch.Generator().manual_seed(1))
    if top or "inputs_embeds" not in inspect.signature(type(module).forward).parameters:
        return {"input_ids": ids}
    with torch.no_grad():
        return {"inputs_embeds": module.get_input_embeddings()(ids)}


def _vocab(model) -> int:
    emb = model.get_input_embeddings()
    return int(emb.weight.shape[0])


def _logits(out):
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out[0]


def run_sweep(families=None, shipped: Optional[dict] = None) -> tuple[dict, dict]:
    """({text_type: record} for every family (or the given ones), {plan path: apply outcomes} for the
    `shipped` plans {path: text}, run at the world's sizes on their family's tiny model) in one 2-rank world."""
    import yaml

    from planc.models.families import family, moe_families
    from planc.runtime.local_world import run_local_world

    fams = families if families is not None else moe_families()
    records = {f.text_type: prepare(f) for f in fams}
    jobs = [(t, t, at_world_sizes(r["plan"]), r.get("ep", False)) for t, r in records.items()
            if r.get("explain") == "pass" and r.get("lint") == "pass"]
    for path, text in (shipped or {}).items():
        data = at_world_sizes(text)
        jobs.append((path, family(yaml.safe_load(text)["model"]["type"]).text_type, data, data["parallel"]["ep_size"] > 1))
    per_rank = run_local_world(apply_world, WORLD, jobs)
    plans: dict = {}
    for key, _, _, _ in jobs:
        merged: dict = {}
        for res in per_rank:
            for k, v in res[key].items():
                if merged.get(k, "pass") == "pass":  # the worst outcome over the ranks
                    merged[k] = v
        if key in records:
            records[key]["apply"] = merged
        else:
            plans[key] = merged
    return records, plans


def family_status(rec: dict) -> str:
    """`pass`, `refused` or `fail` over every step of one family; `not built` when transformers cannot build
    the tiny config derived from the family's config class (a limit of the derivation, not of planc)."""
    if (rec.get("apply") or {}).get("build", "").startswith("transformers:"):
        return "transformers"  # transformers' own unsharded model cannot run the check (the cause is named)
    if rec.get("build", "pass") != "pass" or (rec.get("apply") or {}).get("build", "pass") != "pass":
        return "not built"  # also: the unsharded tiny model's own forward fails
    steps = [rec.get(k) for k in ("build", "init", "lint", "explain") if k in rec]
    steps += list((rec.get("apply") or {}).values())
    if any(s.startswith("fail") for s in steps):
        return "fail"
    if any(s.startswith("refused") for s in steps):
        return "refused"
    return "pass" if "apply" in rec else "fail"


def render_models_md(records: dict, transformers_version: str) -> str:
    """docs/models.md from the sweep records (the test compares the file with this)."""
    counts = {"pass": 0, "refused": 0, "fail": 0, "not built": 0, "transformers": 0}
    for rec in records.values():
        counts[family_status(rec)] += 1
    lines = [
        "# Model families",
        "",
        "<!-- generated by `python -m tests.families.sweep --write docs/models.md`; "
        "tests/families/test_sweep.py checks it is current -->",
        "",
        f"Every MoE family of transformers {transformers_version} (a config class with `base_model_ep_plan`, or a",
        "`base_model_tp_plan` naming experts), found at test time, on a tiny config derived from its own config",
        "class: `planc init` at tp_size 2, lint, explain, then `planc.apply` on 2 gloo ranks against the",
        f"unsharded logits (fp32, <= {TOL:g}) with each EP strategy. `tp` = a plan without expert parallelism",
        "(experts tensor-parallel); `refused PLCxxx` = planc declined with that rule code (see `planc rules`",
        "and docs/compile.md); Mega MoE needs an SM100 GPU and gated, untransposed experts (PLC608), not run here.",
        "`default config` = `planc init --from-transformers TYPE` with transformers' default (full-size) config and",
        "no `--config`: `pass`, or the values that default leaves unset: pass the model's own config.json with",
        "`--config`, or the values with `--set KEY=VALUE` (`planc init` names them too).",
        "",
        f"{len(records)} families: {counts['pass']} pass every step, {counts['refused']} refused by planc, "
        f"{counts['fail']} fail, {counts['not built']} not built (transformers rejects the tiny config derived",
        f"from the family's defaults; the reason is in the init column), {counts['transformers']} `transformers`:",
        "init, lint and explain pass, but transformers' own unsharded model cannot run the comparison (the",
        "cause, outside planc, is in the init column).",
        "",
        "| family | model type | status | init | default config | TP | EP | all_to_all | all_reduce | auto "
        "| rules dropped or changed (codes) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for t in sorted(records):
        rec = records[t]
        apply_res = rec.get("apply") or {}
        first_bad = next((rec[k] for k in ("build", "init", "lint", "explain") if rec.get(k, "pass") != "pass"), None)
        if first_bad is None and apply_res.get("build", "pass") != "pass":
            first_bad = apply_res["build"] if apply_res["build"].startswith("transformers:") else "tiny model: " + apply_res["build"]

        def cell(key, apply_res=apply_res):
            v = apply_res.get(key)
            if v is None:
                v = apply_res.get("tp") if key in STRATEGIES and "tp" in apply_res else None
                if v is not None:
                    return "tp " + ("pass" if v == "pass" else v)
            return _md(v or "-")

        lines.append(
            f"| {t} | {rec['model_type']} | {family_status(rec)} | {_md(first_bad or rec.get('init', '-'))} | "
            f"{_md(rec.get('default_config', '-'))} | {'yes' if rec.get('tp') else '-'} | {'yes' if rec.get('ep') else '-'} | "
            f"{cell('all_to_all')} | {cell('all_reduce')} | {cell('auto')} | {', '.join(rec.get('dropped', [])) or '-'} |"
        )
    return "\n".join(lines) + "\n"


def _md(text: str) -> str:
    return one_line(text, 140).replace("|", "\\|")


def main(argv: Optional[list] = None) -> int:
    import json

    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="FILE", help="write the rendered table to FILE (docs/models.md)")
    parser.add_argument("--json", metavar="FILE", help="also dump the raw records")
    args = parser.parse_args(argv)
    records, _ = run_sweep()
    text = render_models_md(records, transformers.__version__)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(records, f, indent=1, sort_keys=True)
    if args.write:
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
