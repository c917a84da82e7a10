"""exp2 with part of the elements computed by a polynomial on the FMA units instead of the MUFU unit.

At head dim 64 a softmax step of the Hopper forward costs as many cycles of the MUFU unit (16 ex2 per clock and
SM) as of the tensor cores: a 128 x 128 block of scores is 16,384 ex2, about 1,024 clocks, and its two matmuls
about as many. Computing one element in four (POLY = 1) or two in four (POLY = 2) as

    2^x = 2^j · 2^f,   j = round(x), f = x - j in [-0.5, 0.5],   2^f ≈ c0 + f (c1 + f (c2 + f c3))

moves that share of the work to the FMA pipe, which has 8x the MUFU's throughput and spare cycles in the
softmax. 2^j is added to the float's exponent field as an integer. The cubic is a near-minimax fit of 2^f on
[-0.5, 0.5] (relative error below 7.5e-5, under a fiftieth of bf16's rounding step); x is clamped at -125 first,
so an input of -inf gives 2^-125 (about 2e-38), not 0: use it only where every input is finite (the
unmasked key blocks, whose scores are all real numbers minus the row max).

    exp2(x, POLY) -> like gl.exp2(x)      x fp32 of any distributed layout holding a multiple of 4 elements per
                                          thread; POLY 0 (gl.exp2 itself), 1 or 2 of every 4 by the polynomial
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

POLY_CHOICES = (0, 1, 2)
COEFFS = ("0f3F7FFB49", "0f3F31798D", "0f3E786F0D", "0f3D61FBAB")  # c0..c3 as PTX fp32 literals
CLAMP = "0fC2FA0000"  # -125.0: keeps j + 127 >= 1, a normal float's exponent
ROUND = "0f4B400000"  # 1.5 · 2^23: adding it rounds to an integer, held in the low mantissa bits


def _poly_lines(out: int, inp: int) -> list[str]:
    """PTX computing $out = 2^$inp by the polynomial (registers f, t, j, p, e, q of the enclosing block)."""
    c0, c1, c2, c3 = COEFFS
    return [f"max.ftz.f32 f, ${inp}, {CLAMP};",
            f"add.rn.ftz.f32 t, f, {ROUND};",        # t's bits: ROUND's + j (j = round(x))
            f"sub.rn.ftz.f32 j, t, {ROUND};",
            "sub.rn.ftz.f32 f, f, j;",                # f in [-0.5, 0.5]
            f"fma.rn.ftz.f32 p, f, {c3}, {c2};",
            f"fma.rn.ftz.f32 p, p, f, {c1};",
            f"fma.rn.ftz.f32 p, p, f, {c0};",
            "mov.b32 e, t;",
            "shl.b32 e, e, 23;",                      # j << 23: ROUND's own bits shift out
            "mov.b32 q, p;",
            "add.s32 q, q, e;",                       # 2^f · 2^j
            f"mov.b32 ${out}, q;"]


def _asm(poly: int) -> str:
    """Four outputs $0..$3 from four inputs $4..$7: the first 4 - poly by ex2.approx, the rest by the polynomial."""
    lines = ["{", ".reg .f32 f, t, j, p;", ".reg .b32 e, q;"]
    for i in range(4):
        if i < 4 - poly:
            lines.append(f"ex2.approx.ftz.f32 ${i}, ${i + 4};")
        else:
            lines += _poly_lines(i, i + 4)
    lines.append("}")
    return "\n".join(lines)


ASM_POLY1 = gl.constexpr(_asm(1))
ASM_POLY2 = gl.constexpr(_asm(2))


@gluon.jit
def exp2(x, POLY: gl.constexpr):
    """2^x elementwise (x fp32, finite where POLY > 0): POLY of every 4 elements by the polynomial, see above."""
    if POLY == 0:
        y = gl.exp2(x)
    elif POLY == 1:
        y = gl.inline_asm_elementwise(ASM_POLY1, "=f,=f,=f,=f,f,f,f,f", [x], dtype=gl.float32, is_pure=True,
                                      pack=4)
    else:
        y = gl.inline_asm_elementwise(ASM_POLY2, "=f,=f,=f,=f,f,f,f,f", [x], dtype=gl.float32, is_pure=True,
                                      pack=4)
    return y
