"""The suite's accuracy criterion (tests/error_budget.py) on hand-made errors: the 2x factor, the floor of the
result's own precision, and the floor of the precision a widened result was stored in."""
import pytest
import torch

from tests.error_budget import assert_within_budget

REF = torch.tensor([2.25, -1.0, 0.5], dtype=torch.float64)   # max |ref| = 2.25


def off_by(x: float) -> torch.Tensor:
    return REF + torch.tensor([x, 0.0, 0.0], dtype=torch.float64)


def test_twice_the_plain_error_passes_and_more_fails():
    assert_within_budget("x", off_by(2e-3).float(), REF, off_by(1e-3).float())
    with pytest.raises(AssertionError, match=r"x: max error 0.0025 > 2 x the plain path's 0.001"):
        assert_within_budget("x", off_by(2.5e-3).float(), REF, off_by(1e-3).float())


def test_a_widened_fp16_result_gets_one_fp16_unit_as_floor():
    """An error of 2.3e-3 against twice a lucky plain error of 1e-4 plus one fp16 unit (2^-10 · 2.25 ≈ 2.2e-3):
    as a float32 result it fails, as fp16 results widened it passes; past that floor it fails too."""
    got, plain = off_by(2.3e-3).float(), off_by(1e-4).float()
    with pytest.raises(AssertionError, match="floor"):
        assert_within_budget("logits", got, REF, plain)
    assert_within_budget("logits", got, REF, plain, rounded_to=torch.float16)
    with pytest.raises(AssertionError, match="floor 0.0022"):
        assert_within_budget("logits", off_by(2.5e-3).float(), REF, plain, rounded_to=torch.float16)


def test_nan_and_shape_are_named():
    with pytest.raises(AssertionError, match="y: NaN"):
        assert_within_budget("y", off_by(float("nan")), REF, REF)
    with pytest.raises(AssertionError, match=r"z: shape \(2,\)"):
        assert_within_budget("z", REF[:2], REF, REF)
