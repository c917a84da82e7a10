"""kernels.naive.naive_attention as the test oracle: float64 inputs stay float64 end to end (the softmax
included), and lower precisions keep the rounding the kernels are measured against (softmax in float32, P
rounded to q's dtype before P V)."""
from __future__ import annotations

import math

import pytest
import torch

from kernels import naive_attention


def _plain(q, k, v, causal: bool):
    """softmax(Q Kᵀ / sqrt(D)) V written out in q's dtype, with GQA heads expanded; a causal mask bottom-right
    aligned (query i sees keys j <= i + Nk - Nq)."""
    Hq, Hkv = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(Hq // Hkv, dim=1), v.repeat_interleave(Hq // Hkv, dim=1)  # (B, Hq, Nk, D)
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, Hq, Nq, Nk)
    if causal:
        Nq, Nk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(Nq, Nk, dtype=torch.bool).tril(Nk - Nq), float("-inf"))
    return torch.softmax(s, dim=-1) @ v  # (B, Hq, Nq, D)


@pytest.mark.parametrize("heads,Nq,Nk,causal", [((2, 2), 37, 37, True), ((4, 2), 17, 53, True),
                                               ((3, 1), 29, 29, False)])
def test_float64_is_float64_end_to_end(heads, Nq, Nk, causal):
    """Output and gradients of float64 inputs match the plain float64 formula to ~1e-12 (a float32 softmax
    inside would leave errors near 1e-8)."""
    g = torch.Generator().manual_seed(Nq * 1000 + Nk)
    Hq, Hkv = heads
    q = (torch.randn(2, Hq, Nq, 32, generator=g, dtype=torch.float64) * 2).requires_grad_()
    k = (torch.randn(2, Hkv, Nk, 32, generator=g, dtype=torch.float64) * 2).requires_grad_()
    v = torch.randn(2, Hkv, Nk, 32, generator=g, dtype=torch.float64).requires_grad_()
    do = torch.randn(2, Hq, Nq, 32, generator=g, dtype=torch.float64)

    got = naive_attention(q, k, v, causal=causal)
    want = _plain(q, k, v, causal)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), do), torch.autograd.grad(want, (q, k, v), do)):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_lower_precisions_round_like_the_kernels(dtype):
    """16- and 32-bit inputs: softmax of the scores in float32, P rounded to q's dtype, then P V in q's dtype."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 23, 16, generator=g).to(dtype) for _ in range(3))
    s = (q @ k.transpose(-2, -1)) * 0.25  # (1, 2, 23, 23)
    s = s.masked_fill(~torch.ones(23, 23, dtype=torch.bool).tril(), float("-inf"))
    want = torch.softmax(s.float(), dim=-1).to(dtype) @ v
    assert torch.equal(naive_attention(q, k, v, causal=True), want)
