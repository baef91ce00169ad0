"""Shared helpers of the lint tests: the repository root and running the real `planc` CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.checkout_env import checkout_env

REPO = Path(__file__).resolve().parents[2]
PLANS = sorted((REPO / "plans").glob("*.y*ml"))



def plan_text(model_type: str = "mixtral", tp_size: int = 2, ep_size: int = 2) -> str:
    """A minimal clean plan for a `model.layers.*.self_attn` / `mlp.experts` family (mixtral, qwen2_moe, ...)."""
    return f"""\
version: 1
model: {{type: {model_type}}}
parallel: {{tp_size: {tp_size}, ep_size: {ep_size}}}
tp_plan:
  model.layers.*.self_attn.{{q,k,v}}_proj: colwise
  model.layers.*.self_attn.o_proj: rowwise
ep_plan:
  model.layers.*.mlp.experts.{{gate_up_proj,down_proj}}: grouped_gemm
  model.layers.*.mlp.experts: ep_dispatch_experts
"""


GOOD = plan_text()


def planc(*args: str, cwd=REPO, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run `python -m planc ARGS` in a fresh process (the same entry point as the console script)."""
    return subprocess.run(
        [sys.executable, "-m", "planc", *args], cwd=cwd, env=checkout_env(), capture_output=True, text=True, timeout=timeout
    )


def codes(diags) -> list[str]:
    return [d.code for d in diags]
