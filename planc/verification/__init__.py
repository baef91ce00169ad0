"""`planc verify`: prove on CPU ranks that a plan's sharded run computes what the unsharded model computes.

One concept per module: `source` (where the model comes from), `shrink` (a model small enough for a CPU world at
the plan's sizes, sharded exactly as the real one), `stages` (one rank's comparisons), `compare` (the error measure),
`tolerance` (the bounds, per dtype and stage), `divergence` (the first module or parameter that differs), `kernels` (the Mega MoE kernel stages on a GPU), `report`
(VerifyReport), `engine` (the steps, `verify()`). The package is not named `verify`: importing a submodule
`planc.verify` would replace the public function `planc.verify` with the module.
"""

from __future__ import annotations

from planc.verification.engine import verify
from planc.verification.report import Divergence, RuleRef, SkippedStage, StageResult, VerifyReport

__all__ = ["verify", "VerifyReport", "StageResult", "SkippedStage", "Divergence", "RuleRef"]
