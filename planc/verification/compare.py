"""The one error measure of `planc verify`: `||got - want||_2 / ||want||_2`, computed in float64."""

from __future__ import annotations

import torch


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative L2 error of `got` against `want`; exact equality for integer tensors (token ids, expert indices:
    the fraction that differ); inf when shapes differ or `want` is zero and `got` is not."""
    if got.shape != want.shape:
        return float("inf")
    if not got.is_floating_point() or not want.is_floating_point():
        return float((got != want).double().mean().item()) if got.numel() else 0.0
    g, w = got.detach().double(), want.detach().double()
    if not torch.isfinite(g).all() or not torch.isfinite(w).all():
        return 0.0 if torch.equal(torch.nan_to_num(g), torch.nan_to_num(w)) else float("inf")
    diff = torch.linalg.vector_norm(g - w).item()
    scale = torch.linalg.vector_norm(w).item()
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return float(diff / scale)


def abs_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference (0 for integer tensors that agree)."""
    if got.shape != want.shape:
        return float("inf")
    return float((got.detach().double() - want.detach().double()).abs().max().item()) if got.numel() else 0.0
