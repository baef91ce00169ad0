"""The README and docs/ as a reader uses them: every block marked `<!-- runnable: NAME -->` runs as pasted (bash in
a fresh directory, Python under `torchrun --nproc-per-node 2` on gloo), and every relative link and #anchor resolves.

Cheap on purpose: the runnable blocks are few, and each torchrun block is one two-rank world; the command lines of the
other bash and console blocks (a real checkpoint, minutes of explain) are parsed by planc's own parser, and the plans
they name must exist. docs/train.md's script runs in tests/train/test_train_doc.py (4 ranks, then 2), and docs/lint.md's
pre-commit recipe in tests/lint/test_precommit.py.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from tests.checkout_env import checkout_env

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUNNABLE = re.compile(r"<!-- runnable: ([\w-]+) -->\n```(\w+)\n(.*?)```", re.S)


def runnable_blocks() -> dict[str, tuple[Path, str, str]]:
    """name -> (page, language, text) of every marked block."""
    found: dict[str, tuple[Path, str, str]] = {}
    for page in PAGES:
        for m in RUNNABLE.finditer(page.read_text(encoding="utf-8")):
            assert m.group(1) not in found, f"two runnable blocks named {m.group(1)}"
            found[m.group(1)] = (page, m.group(2), m.group(3))
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
    assert sorted(runnable_blocks()) == sorted(RUNNERS), "a block marked runnable needs a runner here, and back"


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


RUNNERS = {"shortest-path": run_shortest_path, "apply": run_python_under_torchrun, "migrate": run_migrate,
           "lint-api": run_python}


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(set(RUNNERS) - {"lint-api"}))
def test_runnable_block_runs_as_pasted(name, tmp_path):
    _page, _language, text = runnable_blocks()[name]
    RUNNERS[name](text, tmp_path)


def test_the_lint_api_block_runs_as_pasted(tmp_path):
    """One process, no torch: not among the slow multi-process blocks."""
    _page, _language, text = runnable_blocks()["lint-api"]
    run_python(text, tmp_path)


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


# ---- the command lines of the blocks that do not run here (a checkpoint, minutes of explain) ------------------------


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
