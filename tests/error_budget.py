"""The suite's accuracy criterion for a low-precision kernel, against a float64 oracle.

A kernel passes when its max error against the float64 reference is at most `factor` (2) times the max error of
the plain path it replaces, computed in the same low precision (naive attention in q's dtype, the eager model in
its dtype, ...), plus a floor: the larger of `floor_rel` and one unit in the last place of the result's dtype
(torch.finfo(dtype).eps), times max(1, max |reference|). The floor matters only where the plain path happens to
be (nearly) exact: a gradient that is exactly 0, or a bf16 result whose plain path rounds luckily (any result
stored in bf16 can be off by rounding alone; in float32 the floor stays at `floor_rel`). A result last stored in a
low precision and handed over widened (an fp16 model's logits cast to float32) names that precision with
`rounded_to`, so its floor is that precision's unit, not float32's.
"""
from __future__ import annotations

import torch


def max_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref|, computed in float64 on the CPU (any shapes that broadcast, any devices)."""
    return (got.detach().cpu().double() - ref.detach().cpu().double()).abs().max().item()


def assert_within_budget(name: str, got: torch.Tensor, ref: torch.Tensor, plain: torch.Tensor, *,
                         factor: float = 2.0, floor_rel: float = 1e-5,
                         rounded_to: torch.dtype | None = None) -> None:
    """Assert max|got - ref| <= factor * max|plain - ref| + floor, floor = max(floor_rel, eps of rounded_to or of
    got's dtype) * max(1, max|ref|) (eps: torch.finfo for floating dtypes), and that got and ref
    hold no NaN (a NaN in got: an element the kernel never wrote, or a 0/0). ref is the float64 oracle, plain
    the low-precision path the kernel replaces. The message names `name` and all three numbers."""
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    assert not torch.isnan(got).any(), f"{name}: NaN (an element was never written, or a 0/0)"
    assert not torch.isnan(ref).any(), f"{name}: NaN in the float64 reference"
    err = max_error(got, ref)
    err_plain = max_error(plain, ref)
    stored = rounded_to or got.dtype
    eps = torch.finfo(stored).eps if stored.is_floating_point else 0.0
    floor = max(floor_rel, eps) * max(ref.detach().abs().max().item(), 1.0)
    assert err <= factor * err_plain + floor, (
        f"{name}: max error {err:.3g} > {factor:g} x the plain path's {err_plain:.3g} + floor {floor:.3g}")
