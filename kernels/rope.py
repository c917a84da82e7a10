"""Rotary position embeddings of the training step in Triton: q and k of the packed QKV projection in one launch.

    rope_qkv(qkv, cos, sin, n_head, n_kv_head) -> (B, T, (n_head + 2·n_kv_head)·D)

qkv is the attention's packed projection as c_attn gives it: per token [q heads | k heads | v heads], D wide
each. The result is a new packed tensor in the same layout with every q and k head rotated and the v heads
copied, ready for the packed attention call: one read and one write of qkv, no transposes, no concatenation.
The rotation is model/rope.py's apply_rope (Hugging Face's rotate-half layout) with the tables
RotaryEmbedding gives (cos, sin of the angles, Llama-3 frequency scaling included there), for lane i < D/2 of
a head and its partner i + D/2:

    y[i]       = x[i] · cos[i]             - x[i + D/2] · sin[i]
    y[i + D/2] = x[i + D/2] · cos[i + D/2] + x[i] · sin[i + D/2]

The tables are rounded to qkv's dtype first (as apply_rope does), then everything is computed in float32 and
rounded once to qkv's dtype (eager PyTorch rounds each product and the sum: low-precision results may differ
from it by an ulp; in float32 they agree to rounding). The backward is the transposed map — for RotaryEmbedding's
tables (cos and sin equal in both halves) the rotation by -angle — on d(output), in one launch writing d(qkv)
in the packed layout (v heads' gradient copied); only cos and sin are saved.

Supports (a ValueError before any launch otherwise):
    dtypes     qkv float16, bfloat16 or float32; cos and sin float16, bfloat16 or float32 (of one dtype);
               output and d(qkv) in qkv's dtype
    shapes     qkv (B, T, (n_head + 2·n_kv_head)·D) with unit stride along the last dim (any B and T strides);
               D even, D <= MAX_HEAD_DIM (1024); n_head, n_kv_head >= 1; cos, sin (T, D) (positions shared by
               the batch) or (B, T, D) (per sequence); B·T·(n_head + 2·n_kv_head) < 2**31; empty B or T: empty
               outputs, no launch
    devices    CUDA; CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1, for tests)
Under torch.compile the launches are the custom ops ``flashgpt::rope_qkv_fwd`` / ``rope_qkv_bwd``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _triton
from . import options as _options

MAX_HEAD_DIM = 1024
TILE = 2048  # elements of the (BLOCK_R, BLOCK_HALF) half-head tile a program holds per tensor


@triton.jit
def _rope_qkv(X, COS, SIN, Y, R, T, H, N_ROT, stride_xb, stride_xt, stride_yb, stride_yt, stride_cb, stride_ct,
              HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BACKWARD: tl.constexpr):
    """BLOCK_R (token, head) rows r = (b·T + t)·H + h of X (B, T, H·2·HALF): heads h < N_ROT rotated by the
    angles of COS/SIN[b, t] (table rows at b·stride_cb + t·stride_ct, unit stride along the head dim), the
    others copied, into Y. BACKWARD: the transposed rotation (X holds d(output), Y gets d(input)).
    grid (cdiv(R, BLOCK_R),)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)                    # (BLOCK_R,)
    r_ok = r < R
    h = r % H
    tok = r // H
    b = (tok // T).to(tl.int64)
    t = (tok % T).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)                                              # (BLOCK_HALF,) lanes of a half
    ok = r_ok[:, None] & (i < HALF)[None, :]                                  # (BLOCK_R, BLOCK_HALF)
    head = h.to(tl.int64) * (2 * HALF)
    xp = X + (b * stride_xb + t * stride_xt + head)[:, None] + i[None, :]
    x1 = tl.load(xp, mask=ok, other=0.0).to(tl.float32)                       # (BLOCK_R, BLOCK_HALF) lanes i
    x2 = tl.load(xp + HALF, mask=ok, other=0.0).to(tl.float32)                # (BLOCK_R, BLOCK_HALF) lanes i + D/2
    rot = ok & (h < N_ROT)[:, None]                                           # q and k heads
    tab = (b * stride_cb + t * stride_ct)[:, None] + i[None, :]               # (BLOCK_R, BLOCK_HALF)
    dt = X.dtype.element_ty  # the tables rounded to x's dtype, as apply_rope does
    c1 = tl.load(COS + tab, mask=rot, other=1.0).to(dt).to(tl.float32)
    c2 = tl.load(COS + tab + HALF, mask=rot, other=1.0).to(dt).to(tl.float32)
    s1 = tl.load(SIN + tab, mask=rot, other=0.0).to(dt).to(tl.float32)
    s2 = tl.load(SIN + tab + HALF, mask=rot, other=0.0).to(dt).to(tl.float32)
    if BACKWARD:  # the transpose of [[c1, -s1], [s2, c2]]
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    yp = Y + (b * stride_yb + t * stride_yt + head)[:, None] + i[None, :]
    tl.store(yp, y1.to(Y.dtype.element_ty), mask=ok)  # v heads: c = 1, s = 0, a copy
    tl.store(yp + HALF, y2.to(Y.dtype.element_ty), mask=ok)


_triton.check_decorated(_rope_qkv)


def _check(qkv, cos, sin, n_head, n_kv_head) -> None:
    for name, t in (("qkv", qkv), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"rope_qkv: {name} must be a tensor")
    for name, n in (("n_head", n_head), ("n_kv_head", n_kv_head)):
        if not (isinstance(n, int) and n >= 1):
            raise ValueError(f"rope_qkv: {name} must be an int >= 1, got {n!r}")
    heads = n_head + 2 * n_kv_head
    if qkv.dim() != 3 or qkv.shape[2] % heads:
        raise ValueError(f"rope_qkv: expected qkv (B, T, (n_head + 2·n_kv_head)·D) with n_head={n_head}, "
                         f"n_kv_head={n_kv_head}, got {tuple(qkv.shape)}")
    B, T, W = qkv.shape
    D = W // heads
    if D % 2 or not 2 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"rope_qkv supports even head dims 2..{MAX_HEAD_DIM}, got {D}")
    if cos.shape != sin.shape or cos.shape not in ((T, D), (B, T, D)):
        raise ValueError(f"rope_qkv: expected cos and sin ({T}, {D}) or ({B}, {T}, {D}) for qkv {tuple(qkv.shape)}, "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if qkv.dtype not in _triton.SUPPORTED_DTYPES:
        raise ValueError(f"rope_qkv supports float16, bfloat16 and float32 qkv, got {qkv.dtype}")
    if cos.dtype != sin.dtype or cos.dtype not in _triton.SUPPORTED_DTYPES:
        raise ValueError(f"rope_qkv: cos and sin must be of one dtype of float16, bfloat16, float32, got "
                         f"{cos.dtype} and {sin.dtype}")
    if not (qkv.device == cos.device == sin.device):
        raise ValueError(f"rope_qkv: qkv on {qkv.device}, cos on {cos.device}, sin on {sin.device}")
    if B * T * heads >= 2**31:
        raise ValueError(f"rope_qkv: B·T·heads = {B * T * heads} (token, head) rows, at most 2**31 - 1")
    _triton.check_device(qkv.device, "rope_qkv's Triton kernel")


# The compiled kernel per launch signature (tensor dtypes and 16-byte alignment, every other argument by value),
# called through its launcher on later launches (the fast_launch option; kernels/flash/launch.py does the same).
_compiled: dict[tuple, object] = {}
_COMPILED_MAX = 1024


def _run(grid: tuple, args: tuple, consts: dict) -> None:
    if _triton.INTERPRET or not _options.get().fast_launch:
        _rope_qkv[grid](*args, **consts, num_warps=4)
        return
    key = (args[0].device.index, *[(t.dtype, t.data_ptr() % 16 == 0) for t in args[:4]], *args[4:],
           *consts.values())
    kernel = _compiled.get(key)
    if kernel is not None:
        _triton.launch_compiled(kernel, grid, (*args, *consts.values()))
        return
    kernel = _rope_qkv[grid](*args, **consts, num_warps=4)
    if hasattr(kernel, "run") and list(_rope_qkv.arg_names[len(args):]) == list(consts):
        if len(_compiled) >= _COMPILED_MAX:
            _compiled.clear()
        _compiled[key] = kernel


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_rot: int, heads: int,
            backward: bool) -> torch.Tensor:
    """y (B, T, W) contiguous, in x's dtype: heads < n_rot of x (B, T, W) rotated (or, backward, rotated back)."""
    if x.stride(2) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    B, T, W = x.shape
    half = W // heads // 2
    y = _triton.empty((B, T, W), x.dtype, x.device)
    R = B * T * heads
    if R == 0:
        return y
    block_half = triton.next_power_of_2(half)
    block_r = max(1, TILE // block_half)
    stride_cb = cos.stride(0) if cos.dim() == 3 else 0
    args = (x, cos, sin, y, R, T, heads, n_rot, x.stride(0), x.stride(1), y.stride(0), y.stride(1), stride_cb,
            cos.stride(-2))
    with _triton.device_guard(x):
        _run((triton.cdiv(R, block_r),), args, dict(HALF=half, BLOCK_R=block_r, BLOCK_HALF=block_half,
                                                     BACKWARD=backward))
    return y


def _fwd(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int, n_kv_head: int) -> torch.Tensor:
    return _launch(qkv, cos, sin, n_head + n_kv_head, n_head + 2 * n_kv_head, backward=False)


def _bwd(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int, n_kv_head: int) -> torch.Tensor:
    return _launch(dy, cos, sin, n_head + n_kv_head, n_head + 2 * n_kv_head, backward=True)


_LIB = torch.library.Library("flashgpt", "FRAGMENT")
_LIB.define("rope_qkv_fwd(Tensor qkv, Tensor cos, Tensor sin, int n_head, int n_kv_head) -> Tensor")
_LIB.define("rope_qkv_bwd(Tensor dy, Tensor cos, Tensor sin, int n_head, int n_kv_head) -> Tensor")
_LIB.impl("rope_qkv_fwd", _fwd, "CompositeExplicitAutograd")
_LIB.impl("rope_qkv_bwd", _bwd, "CompositeExplicitAutograd")
torch.library.register_fake("flashgpt::rope_qkv_fwd", lambda qkv, cos, sin, nh, nkv: qkv.new_empty(qkv.shape),
                            lib=_LIB)
torch.library.register_fake("flashgpt::rope_qkv_bwd", lambda dy, cos, sin, nh, nkv: dy.new_empty(dy.shape),
                            lib=_LIB)


def _setup_context(ctx, inputs, output):
    _, cos, sin, n_head, n_kv_head = inputs
    ctx.save_for_backward(cos, sin)
    ctx.heads = (n_head, n_kv_head)


def _backward(ctx, dy):
    cos, sin = ctx.saved_tensors
    return torch.ops.flashgpt.rope_qkv_bwd(dy, cos, sin, *ctx.heads), None, None, None, None


torch.library.register_autograd("flashgpt::rope_qkv_fwd", _backward, setup_context=_setup_context, lib=_LIB)


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int, n_kv_head: int) -> torch.Tensor:
    """qkv (B, T, (n_head + 2·n_kv_head)·D), cos and sin (T, D) or (B, T, D) → a new contiguous packed tensor,
    q and k heads rotated, v heads copied; differentiable in qkv (not in cos and sin)."""
    _check(qkv, cos, sin, n_head, n_kv_head)
    return torch.ops.flashgpt.rope_qkv_fwd(qkv, cos, sin, n_head, n_kv_head)
