"""The README and docs/ as a reader uses them: every block a reader copies runs here as written, or says in the
page why it cannot (tests/doc_blocks.py lists the markers), and every relative link and #anchor resolves.

Blocks marked `<!-- runnable: NAME -->` run as pasted (bash in a fresh directory, Python under `torchrun
--nproc-per-node 2` on gloo). The plans and `planc` command blocks of every page run in page order in one copy of
the clone's plans/ and schemas/: each YAML plan is linted by `planc lint`, each `planc` line runs with its
arguments, redirections and working directory as written, a console block's shown output is checked against what
the command prints. The `planc` console script is `planc.cli:main`: the lines run through it in this one process,
so torch is imported once for all of them, not once a line; a line that a runnable block runs too (the demo) is
not run twice. Fragments of a training script (gradient accumulation, save and export, the optimizer round trip) run
in one 2-rank world whose prelude holds the names they use. Blocks another test runs say so (`<!-- runs in: ... -->`): docs/train.md's scripts
(tests/train/test_train_doc.py), docs/lint.md's pre-commit recipe (tests/lint/test_precommit.py), docs/install.md's
torch-free transcript (tests/test_torch_free.py), the README's two commands (.ci/run).
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from tests.checkout_env import checkout_env

from tests.doc_blocks import PAGES, REPO, Block, all_blocks


def runnable_blocks() -> dict[str, tuple[Path, str, str]]:
    """name -> (page, language, text) of every block marked runnable."""
    found: dict[str, tuple[Path, str, str]] = {}
    for b in all_blocks():
        name = b.marker("runnable")
        if name:
            assert name not in found, f"two runnable blocks named {name}"
            found[name] = (b.page, b.language, b.text)
    return found


def _env() -> dict:
    """The user's shell: this venv's console scripts (planc, torchrun) first on PATH, this checkout importable."""
    bin_dir = os.path.dirname(sys.executable)
    return checkout_env(PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))


def _bash(text: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", text], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done


def test_every_runnable_block_has_a_runner():
    assert sorted(runnable_blocks()) == sorted([*RUNNERS, *RUN_WITH]), "a block marked runnable needs a runner here"


def run_shortest_path(text: str, tmp_path: Path) -> None:
    """init -> lint -> explain -> demo -> a tiny checkpoint by save_pretrained -> torchrun load.py on 2 ranks."""
    elastic_before = set(glob.glob(os.path.join(tempfile.gettempdir(), "torchelastic_*")))
    done = _bash(text, tmp_path)
    out = done.stdout
    assert (tmp_path / "my_plan.yaml").is_file() and (tmp_path / "tiny-qwen3-moe" / "config.json").is_file()
    assert "1 file checked: no problems" in out
    assert "max |logits - unsharded logits| on 2 ranks" in out
    # load.py printed its CompiledPlan (rank 0 only), at the sizes it was run at
    assert out.count("coverage: full") == 3, out[-3000:]  # explain, demo, load.py
    assert "tp_size=2" in out or "tp_size 2" in out or "tp2" in out, out[-3000:]
    # torchrun's log directories land in the tests' temporary directory (conftest), not in /tmp
    assert Path(tempfile.gettempdir()).parent == tmp_path.parent  # both under pytest's base temporary directory
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "torchelastic_*"))) - elastic_before


def run_python_under_torchrun(text: str, tmp_path: Path) -> None:
    """The block as the script its first line names, run by the torchrun command that line gives, from an empty
    directory: the plan is a shipped one by name (`planc:mixtral`), found from anywhere."""
    found = re.match(r"# (\w+\.py); run it on 2 processes: (torchrun --nproc-per-node 2 \1)\n", text)
    assert found, f"the block's first line names its script and torchrun command: {text.splitlines()[0]!r}"
    (tmp_path / found.group(1)).write_text(text, encoding="utf-8")
    done = _bash(found.group(2), tmp_path)
    assert done.stdout.count("coverage: full") == 2, done.stdout[-3000:]  # printed on both ranks


def run_python(text: str, tmp_path: Path) -> None:
    """The block as a script in a project with a plans/ directory: one clean plan, one with a misspelt style."""
    (tmp_path / "plans").mkdir()
    clean = (REPO / "plans" / "mixtral.yaml").read_text(encoding="utf-8")
    (tmp_path / "plans" / "mixtral.yaml").write_text(clean, encoding="utf-8")
    (tmp_path / "plans" / "typo.yaml").write_text(clean.replace(": rowwise", ": row_wise"), encoding="utf-8")
    (tmp_path / "block.py").write_text(text, encoding="utf-8")
    done = _bash(f"{sys.executable} block.py", tmp_path)
    assert re.search(r"^plans/typo\.yaml:\d+:\d+: PLC310 error: unknown style `row_wise`", done.stdout, re.M), done.stdout
    assert "did you mean `rowwise`?" in done.stdout and "mixtral.yaml" not in done.stdout, done.stdout


def run_migrate(text: str, tmp_path: Path) -> None:
    done = _bash(text, tmp_path)
    assert "PLC320" in done.stdout and "+  model.layers.*.mlp.experts: ep_dispatch_experts" in done.stdout
    assert "PLC404" not in done.stdout  # no cascade: PLC320's fix is migrate's
    assert done.stdout.rstrip().endswith("1 file checked: no problems")
    assert "ep_dispatch_experts" in (tmp_path / "old_plan.yaml").read_text()


def run_extending(text: str, tmp_path: Path) -> None:
    """docs/extending.md's three blocks as a project: the registering module (`myproject/planc_styles.py`), the
    pyproject.toml that names it, a plan using both rows: `planc lint` knows them; without the config it does not."""
    blocks = runnable_blocks()
    (tmp_path / "myproject").mkdir()
    (tmp_path / "myproject" / "__init__.py").write_text("", encoding="utf-8")
    (tmp_path / "myproject" / "planc_styles.py").write_text(text, encoding="utf-8")
    (tmp_path / "pyproject.toml").write_text(blocks["extending-config"][2], encoding="utf-8")
    plan = blocks["extending-plan"][2]
    (tmp_path / "plans").mkdir()
    (tmp_path / plan.splitlines()[0].removeprefix("# ")).write_text(plan, encoding="utf-8")
    assert _bash("planc lint plans/", tmp_path).stdout.strip() == "1 file checked: no problems"
    (tmp_path / "pyproject.toml").unlink()
    bare = subprocess.run(["planc", "lint", "plans/"], cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert bare.returncode == 1 and "PLC310 error: unknown style `colwise_traced`" in bare.stdout, bare.stdout


def run_compile_api(text: str, tmp_path: Path) -> None:
    """The block with `model` bound to what it stands for: the full-size Mixtral, built on `meta` as explain does."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("mixtral"))
    scope = {"model": model}
    exec(compile(text, "compile.md", "exec"), scope)
    compiled = scope["compiled"]
    assert compiled.assignments and compiled.experts and re.fullmatch(r"[0-9a-f]{16}", compiled.fingerprint)


FRAGMENT_WORLD = """\
import contextlib, os, sys, torch, torch.distributed as dist
import planc
from planc.models.build import build_tiny_model

dist.init_process_group("gloo")
rank = dist.get_rank()
plan = "planc:mixtral"
model = build_tiny_model("mixtral", seed=0)
planc.apply(model, plan, parallel={"tp_size": 2, "ep_size": 2})
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
vocab = model.config.vocab_size
micro_batches = [torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(i)) for i in range(4)]
max_norm = 0.5
before = {n: p.full_tensor().clone() for n, p in model.named_parameters() if hasattr(p, "full_tensor")}
for name in sys.argv[1:]:  # each page's fragment, as written, in this one scope
    exec(compile(open(name).read(), name, "exec"))
    if name == "accumulate.py":  # two optimizer steps ran: every sharded weight moved, every gradient cleared
        assert all(not torch.equal(p.full_tensor(), before[n]) for n, p in model.named_parameters() if n in before)
        assert all(p.grad is None for p in model.parameters()) and opt.state
    if name == "save_export.py":
        assert os.path.isfile("ckpt/step-1000/planc.json") and os.path.isfile("hub/my-model/config.json")
    if name == "optimizer_state.py":  # loaded at other sizes, the AdamW state resharded into the new opt
        assert model._planc_plan.parallel.tp_size == 1 and model._planc_plan.parallel.dp_size == 2
        assert len(opt.state) == len(list(model.parameters()))
    print(f"rank {rank}: {name} ran", flush=True)
dist.destroy_process_group()
"""


def run_fragments(text: str, tmp_path: Path) -> None:
    """Fragments of a training script, each run as written in one 2-rank gloo world that holds the names they use:
    `model` (a tiny Mixtral applied by `planc:mixtral` at tp 2, ep 2), `opt`, `plan`, `micro_batches`, `max_norm`.
    docs/train.md's gradient accumulation, then docs/load.md's save and export, then its optimizer round trip."""
    blocks = runnable_blocks()
    names = {"accumulate.py": text, "save_export.py": blocks["save-export"][2],
             "optimizer_state.py": blocks["optimizer-state"][2]}
    for name, body in names.items():
        (tmp_path / name).write_text(body, encoding="utf-8")
    (tmp_path / "world.py").write_text(FRAGMENT_WORLD, encoding="utf-8")
    done = _bash(f"torchrun --nproc-per-node 2 world.py {' '.join(names)}", tmp_path)
    assert done.stdout.count(" ran") == 2 * len(names), done.stdout[-3000:]


RUNNERS = {"shortest-path": run_shortest_path, "apply": run_python_under_torchrun, "migrate": run_migrate,
           "lint-api": run_python, "extending": run_extending, "compile-api": run_compile_api,
           "accumulate": run_fragments}
RUN_WITH = {"extending-config": "extending", "extending-plan": "extending", "save-export": "accumulate",
            "optimizer-state": "accumulate"}  # blocks a runner above runs together
IN_PROCESS = {"lint-api", "extending", "compile-api"}  # cheap: one process (or torch-free commands), no world


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(set(RUNNERS) - IN_PROCESS))
def test_runnable_block_runs_as_pasted(name, tmp_path):
    _page, _language, text = runnable_blocks()[name]
    RUNNERS[name](text, tmp_path)


@pytest.mark.parametrize("name", sorted(IN_PROCESS))
def test_cheap_runnable_block_runs_as_pasted(name, tmp_path):
    """No process group: not among the slow multi-process blocks."""
    _page, _language, text = runnable_blocks()[name]
    RUNNERS[name](text, tmp_path)


# ---- links and anchors --------------------------------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation other than `-` and `_` dropped, spaces to `-`, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))  # a link in a heading: its text
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in PAGES:
        for target in relative_links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no heading with that id in {dest.name})")
    assert broken == [], "\n".join(broken)


def test_the_anchor_rule_is_githubs():
    """The slug rule on headings whose GitHub ids are known (as rendered on github.com)."""
    # `## Compile: planc.compile_plan against ...`: the dot goes, the two words join; `## Measured (`bench/x.py`)`
    assert "compile-planccompile_plan-against-transformers-plan-resolution" in anchors(REPO / "docs" / "benchmarks.md")
    assert "measured-benchtrain_steppy" in anchors(REPO / "docs" / "train.md")


def test_plan_format_lists_every_megamoe_backend():
    from planc.spec.choices import MEGAMOE_BACKENDS

    line = next(ln for ln in (REPO / "docs" / "plan-format.md").read_text().splitlines()
                if ln.startswith("`experts.megamoe` holds `backend`"))
    assert [v for v in MEGAMOE_BACKENDS if f"`{v}`" not in line] == [], line


# ---- every command line parses, those of blocks marked `not run` too (a checkpoint, a GPU, minutes of verify) -------


def command_lines() -> list[tuple[str, str]]:
    """(page, command) for every `planc ...` line of the README's and docs' bash and console blocks that no runner
    above runs: comments, `$ ` prompts and redirections dropped."""
    import shlex

    runnable = {text for _page, _language, text in runnable_blocks().values()}
    out = []
    for page in PAGES:
        for m in re.finditer(r"```(bash|console)\n(.*?)```", page.read_text(encoding="utf-8"), re.S):
            if m.group(2) in runnable:
                continue
            for line in m.group(2).splitlines():
                if m.group(1) == "console" and not line.startswith("$ "):
                    continue  # output
                line = line.removeprefix("$ ").split(" #", 1)[0].split("<", 1)[0].split(">", 1)[0].strip()
                if line.startswith("planc "):
                    out.append((page.name, " ".join(shlex.split(line))))
    return out


def test_every_documented_command_line_parses_and_names_real_plans():
    """Each line is parsed by planc's own argument parser (a flag that no longer exists fails here), and every plan
    it names is a shipped plan (`planc:NAME`) or a plan path a reader has in a clone (`plans/NAME.yaml`)."""
    from planc.cli import build_parser
    from planc.spec.shipped import shipped_reference

    lines = command_lines()
    assert any(page == "README.md" for page, _ in lines) and len(lines) > 20, lines
    bad = []
    for page, line in lines:
        argv = line.split()[1:]
        try:
            build_parser(only=argv[0]).parse_args(argv)
        except SystemExit:
            bad.append(f"{page}: `{line}` does not parse")
            continue
        for before, word in zip(["", *argv], argv):
            if before in ("-o", "--stdin-filename"):  # a file the command writes, or the name of a buffer
                continue
            if word.startswith("planc:") and shipped_reference(word) is None:
                bad.append(f"{page}: `{line}`: no shipped plan `{word}`")
            if re.fullmatch(r"plans/\w+\.yaml", word) and not (REPO / word).is_file():
                bad.append(f"{page}: `{line}`: no plan `{word}` in a clone")
    assert bad == [], "\n".join(bad)


# ---- every block a reader copies: run here, run by another test, or marked with why not ---------------------------


@dataclass
class Command:
    """One `planc` line of a bash or console block: its argv, redirections, and the output a console block shows."""

    line: str
    argv: list[str]
    stdin: str | None = None
    stdout: str | None = None
    may_fail: bool = False  # `|| true`, or a comment that names the diagnostic (PLCnnn) or `exit 1` it ends with
    shown: list[str] = field(default_factory=list)


def commands(b: Block) -> list[Command] | None:
    """The block's command lines, or None when one is not a `planc` command (a runner or a marker handles those)."""
    import shlex

    out: list[Command] = []
    for raw in b.text.splitlines():
        if b.language == "console" and not raw.startswith("$ "):
            if out:
                out[-1].shown.append(raw)
            continue
        line, _, comment = raw.removeprefix("$ ").partition(" #")
        if not line.strip():
            continue
        words = shlex.split(line)
        cmd = Command(line.strip(), [], may_fail=bool(re.search(r"PLC\d{3}|exit 1", comment)))
        if words[-2:] == ["||", "true"]:
            words, cmd.may_fail = words[:-2], True
        while len(words) > 2 and words[-2] in ("<", ">"):
            setattr(cmd, "stdin" if words[-2] == "<" else "stdout", words[-1])
            words = words[:-2]
        if words[0] != "planc" or any(w in ("|", "&&", ";", "<", ">", "<<") for w in words):
            return None
        cmd.argv = words[1:]
        out.append(cmd)
    return out


def how_it_runs(b: Block) -> str | None:
    """What runs the block, in words; None when nothing does and the page does not say why."""
    if b.marker("runnable"):
        return f"runner `{b.marker('runnable')}` (tests/test_docs.py)"
    if b.marker("not run"):
        return f"not run: {b.marker('not run')}"
    if b.marker("runs in"):
        return f"runs in {b.marker('runs in')}"
    if b.generated and b.language == "yaml":
        return "a rule's example (tests/lint/test_rules.py, tests/compiler/test_rule_examples.py)"
    if b.language in ("", "text"):
        return "a picture: output, a diagram or signatures"
    if b.language == "yaml":
        return f"a plan: planc lint, {b.marker('lint') or 'clean'}"
    if b.language in ("bash", "console") and commands(b):
        return "planc commands, in a copy of the clone"
    return None


def test_every_block_runs_or_says_why_not():
    """Each block is run (here or by the test its marker names) or marked `not run` with its reason; the reasons
    are printed, so they are read."""
    from planc.lint.registry import all_rules

    examples = {(ex or "").strip() for r in all_rules() for ex in (r.bad, r.good)}
    problems, skipped = [], []
    for b in all_blocks():
        how = how_it_runs(b)
        if b.generated and b.text.strip() not in examples:
            problems.append(f"{b.where}: a block of the generated rule section that is no rule's example")
        if how is None:
            problems.append(f"{b.where}: a `{b.language}` block nothing runs: make it runnable here, or write "
                            f"`<!-- not run: REASON -->` right above it")
        elif how.startswith("not run"):
            skipped.append(f"{b.where}: {how}")
        elif b.marker("runs in"):
            target = REPO / b.marker("runs in")  # type: ignore[operator]
            others = [k for k, _ in b.markers if k != "runs in"]
            if target.name == "run":  # .ci/run: test_the_two_commands_are_the_ones_ci_runs reads it
                continue
            if not target.is_file():
                problems.append(f"{b.where}: runs in {target}, which does not exist")
            elif b.page.name not in (text := target.read_text(encoding="utf-8")) or any(
                    o not in text for o in others):
                problems.append(f"{b.where}: {target.name} does not read this block (it names neither "
                                f"{b.page.name} nor {others})")
        elif how.startswith("a picture") and re.search(r"^\$ ", b.text, re.M):
            problems.append(f"{b.where}: a command line (`$ `) in a block without a language: make it `console`")
    assert problems == [], "\n".join(problems)
    assert len(skipped) <= 13, "\n".join(skipped)  # rare, each with its reason
    print("\n".join(skipped))


def test_an_unmarked_block_a_bare_marker_and_a_stale_transcript_are_caught():
    page = REPO / "docs" / "load.md"
    assert how_it_runs(Block(page, 1, "python", "print(1)\n", (), False)) is None
    assert how_it_runs(Block(page, 1, "python", "print(1)\n", (("not run", ""),), False)) is None  # no reason
    assert how_it_runs(Block(page, 1, "bash", "planc lint | head\n", (), False)) is None  # not a plain planc line
    printed = "memory:\n  held after loading: 158.11 GiB per rank (bfloat16 157.7 GiB)\n  device memory: OVER\n"
    assert shown_output_differs(["...", "memory:", "  held after loading: 158.11 GiB ... (bfloat16 ...)"], printed) is None
    assert shown_output_differs(["  held after loading: 158.12 GiB per rank"], printed) == "held after loading: 158.12 GiB per rank"
    assert shown_output_differs(["device memory: OVER", "memory:"], printed) == "memory:"  # in order


def test_the_two_commands_are_the_ones_ci_runs():
    """The README's set-up and test command are .ci/run's own (which adds `-q` to pip and a timeout to pytest); its
    `planc demo` runs from the built wheel there and from this checkout in tests/runtime/test_demo.py."""
    (block,) = [b for b in all_blocks() if b.marker("runs in") == ".ci/run"]
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").replace(" -q", "")
    for part in (p.strip().replace(" -q", "") for ln in block.text.splitlines() for p in ln.split("&&")):
        assert part in ci or part.replace(".venv/bin/", "") in ci, f"{part!r} is not what .ci/run runs"


def shown_output_differs(shown: list[str], printed: str) -> str | None:
    """The first line a console block shows that the command did not print (in order; `...` stands for any text)."""
    actual = [" ".join(ln.split()) for ln in printed.splitlines()]
    at = 0
    for want in (" ".join(ln.split()) for ln in shown):
        if not want or want == "...":
            continue
        pattern = re.compile(".*".join(re.escape(piece) for piece in want.split("...")))
        found = next((i for i in range(at, len(actual)) if pattern.search(actual[i])), None)
        if found is None:
            return want
        at = found + 1
    return None


def plan_path(b: Block, clone: Path) -> Path:
    """Where the plan is written: the file its first line names (a shipped plan's name stands for its copy in
    plans/, so a relative `extends:` finds its parent), else a name from its page and line."""
    named = re.match(r"# ([\w./-]+\.ya?ml)\b", b.text)
    if not named:
        return clone / f"{b.page.stem}-{b.line}.yaml"
    name = named.group(1)
    if "/" not in name and (REPO / "plans" / name).is_file():
        return clone / "plans" / name
    return clone / name


def test_plans_and_commands_of_every_page_run_in_a_clone(tmp_path, monkeypatch, capsys):
    import io
    import shutil

    from planc.cli import main

    for d in ("plans", "schemas"):
        shutil.copytree(REPO / d, tmp_path / d)
    monkeypatch.chdir(tmp_path)
    ran_by_runners = {" ".join(c.argv) for name in RUNNERS for c in commands(
        Block(REPO, 0, "bash", "\n".join(ln for ln in runnable_blocks()[name][2].splitlines()
                                         if ln.startswith("planc ")), (), False)) or []}
    failures, ran = [], 0
    for b in all_blocks():
        how = how_it_runs(b) or ""
        if how.startswith("a plan"):
            path = plan_path(b, tmp_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(b.text, encoding="utf-8")
            rc = main(["lint", str(path.relative_to(tmp_path))])
            out = capsys.readouterr()
            expect = b.marker("lint") or "clean"
            if (rc == 0) != (expect == "clean") or (expect != "clean" and expect not in out.out):
                failures.append(f"{b.where}: `planc lint` exit {rc}, expected {expect}:\n{out.out}{out.err}")
            ran += 1
        elif how.startswith("planc commands"):
            for cmd in commands(b) or []:
                if " ".join(cmd.argv) in ran_by_runners:
                    continue
                if cmd.stdin:
                    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO((tmp_path / cmd.stdin).read_bytes())))
                rc = main(cmd.argv)
                out = capsys.readouterr()
                ran += 1
                if cmd.stdout:
                    (tmp_path / cmd.stdout).write_text(out.out, encoding="utf-8")
                wrong = shown_output_differs(cmd.shown, out.out + out.err)
                may_fail = cmd.may_fail or any(re.search(r"PLC\d{3}", s) for s in cmd.shown)  # a transcript shows it
                if rc not in ((0, 1) if may_fail else (0,)) or "Traceback" in out.err or wrong is not None:
                    failures.append(f"{b.where}: `{cmd.line}` exit {rc}"
                                    + (f"; it does not print the shown line {wrong!r}" if wrong else "")
                                    + f":\n{out.out[-3000:]}{out.err[-3000:]}")
    assert failures == [], "\n\n".join(failures)
    assert ran > 30, ran  # every plan block and `planc` line above
