"""The polynomial exp2 of kernels/flash_hopper/poly_exp2.py: its constants and steps, replayed in float32 with
numpy on the CPU, stay within the stated error of 2^x; the PTX computes the stated share of elements each way.
(The kernel itself runs only on an sm_90 GPU: tests/test_flash_hopper.py checks its output against float64.)"""
from __future__ import annotations

import numpy as np
import pytest

from kernels import flash_hopper

pytestmark = pytest.mark.skipif(not flash_hopper.AVAILABLE, reason=f"{flash_hopper.UNAVAILABLE_REASON}")


def _f32(literal: str) -> np.float32:
    """A PTX fp32 literal (0fXXXXXXXX) as a float32."""
    assert literal.startswith("0f") and len(literal) == 10
    return np.array([int(literal[2:], 16)], dtype=np.uint32).view(np.float32)[0]


def _replay(x: np.ndarray) -> np.ndarray:
    """The polynomial's PTX steps in float32 (each fma rounded once, as fma.rn is; float64 stands in for the
    exact product, then one rounding)."""
    from kernels.flash_hopper import poly_exp2 as pe
    c0, c1, c2, c3 = (_f32(c) for c in pe.COEFFS)
    rnd = _f32(pe.ROUND)

    def fma(a, b, c):
        return (a.astype(np.float64) * b + c).astype(np.float32)
    f = np.maximum(x, _f32(pe.CLAMP))
    t = (f + rnd).astype(np.float32)
    j = (t - rnd).astype(np.float32)
    f = (f - j).astype(np.float32)
    p = fma(fma(fma(f, c3, c2), f, c1), f, c0)
    e = t.view(np.uint32) << np.uint32(23)
    return (p.view(np.uint32) + e).view(np.float32)


def test_within_the_stated_error_where_inputs_are_finite():
    rng = np.random.default_rng(0)
    x = np.concatenate([-rng.random(200_000, dtype=np.float32) * 124,
                        np.float32([0.0, -0.5, -1.0, -1.5, -2.5, -63.5, -124.0])])  # round-half cases included
    y = _replay(x)
    ref = np.exp2(x.astype(np.float64))
    assert np.max(np.abs(y - ref) / ref) < 7.5e-5
    assert np.all(y > 0)


def test_below_the_clamp_the_result_is_tiny_and_positive():
    """-125 and below (-inf included) give 2^-125 times the cubic's value at 0: positive and below 3e-38."""
    y = _replay(np.float32([-125.0, -126.0, -1000.0, -np.inf]))
    assert np.all(y > 0) and np.all(y < 3e-38)


@pytest.mark.parametrize("poly", [1, 2])
def test_the_asm_takes_four_and_computes_poly_of_them_by_the_cubic(poly):
    from kernels.flash_hopper import poly_exp2 as pe
    asm = pe._asm(poly)
    assert asm.count("ex2.approx.ftz.f32") == 4 - poly
    assert asm.count("shl.b32") == poly and asm.count("fma.rn.ftz.f32") == 3 * poly
    assert {f"${i}" for i in range(8)} <= set(asm.replace(",", " ").replace(";", " ").split())
