"""FlashAttention (the FA2 algorithm) in Triton: forward and backward.

    flash_attention(q, k, v, *, causal=True, sm_scale=None, window=0, docs=None) -> (B, Hq, Nq, D)
    flash_attention_qkvpacked(qkv, n_head, n_kv_head, *, causal=True, sm_scale=None, window=0, docs=None,
                              rope=None) -> (B, Hq, N, D)
    flash_attention_varlen(q, k, v, cu_seqlens, max_seqlen=None, *, causal=True, window=0, sm_scale=None)
        -> (total, Hq, D)

Same semantics as ``kernels.naive.naive_attention`` (the reference and test oracle):

* q is (B, Hq, Nq, D); k and v are (B, Hkv, Nk, D); Hq must be a multiple of Hkv (grouped-query and
  multi-query attention: query head h reads key/value head h // (Hq // Hkv)). Any strides (transposed
  views, expanded heads): the kernels index through the strides, nothing is copied.
* ``sm_scale`` defaults to 1/sqrt(D); it must be a finite number > 0.
* ``causal=True`` is aligned bottom-right: query i sees keys j <= i + (Nk - Nq). With Nq < Nk this is what a
  KV cache or chunked prefill needs. With Nq > Nk the first Nq - Nk query rows see no key at all: those rows
  are defined to be **zero** in the output, and they give **zero** gradients (no NaN anywhere).
* The result has q's dtype and is differentiable in q, k and v.
* The packed form takes one projection qkv (B, N, (Hq + 2·Hkv)·D) — what a fused QKV matmul gives — and runs
  the same kernels on its views (``kernels.naive.split_qkv``); its backward writes dQ, dK, dV straight into
  one d(qkv) buffer, so a model's gradient needs no concatenation copy.
  With ``rope=(cos, sin)`` ((N, D) or (B, N, D) tables, rotate-half layout) it rotates q and k first (one
  pass of kernels/rope.py) and returns the gradient w.r.t. the projection before the rotation: for head dims
  that are powers of two >= 16 the dQ and dK/dV kernels store their tiles rotated back (ROPE), other head
  dims take one rotation pass after them.
* ``window`` > 0 (a sliding window; needs ``causal=True``): query i sees keys j with
  i + (Nk - Nq) - window < j <= i + (Nk - Nq), i.e. itself and the window - 1 keys before it, bottom-right
  aligned like the causal mask (rows that see no key: zero, as above). Any window >= 1, any Nq, Nk.
* ``docs`` (documents packed in each row; needs Nq = Nk = N): (B, 2, N) int32 bounds, ``docs[b, 0, i]`` and
  ``docs[b, 1, i]`` the first token and one past the last of the document holding token i of row b
  (``kernels.documents.document_bounds`` builds them from end-of-text tokens, on the device). Query i sees
  only the keys of its own document, with the causal mask (or the whole document with ``causal=False``) and the
  window on top. Any document lengths >= 1, any number per row, anywhere in the row. The values are trusted,
  not read back: they must be bounds as document_bounds writes them (each token inside its own document, the
  starts and the ends non-decreasing along the row); other values give wrong results, but bounds outside
  [0, N] cannot make a kernel read outside the row.
* The varlen form is FlashAttention's packed-sequence interface: q (total, Hq, D), k and v (total, Hkv, D) of
  sequences laid one after another (total >= 1), ``cu_seqlens`` (n + 1,) int32/int64 their offsets (0 ...
  total, non-decreasing; empty sequences allowed; the values are checked with one device-to-host read, not
  under torch.compile). It runs the document kernels on the (1, H, total, D) view; ``max_seqlen`` is optional
  and only checked. Window, GQA, causal or not, every dtype and head dim below, forward and backward.
* With a window or documents, each query tile loads only the key blocks that some row of it sees: the blocks
  between the tile's first row's lowest key and its last row's highest key. Those visible to every row run
  without a mask, the blocks at either edge with one; the dK/dV kernel skips query blocks the same way. So
  documents cost what their own lengths cost, plus the tiles that straddle a boundary.

Supported, forward and backward (anything else raises ValueError before any launch):

* dtypes: float16, bfloat16, float32 (q, k, v the same). Accumulation is always float32: S = QKᵀ, the online
  softmax statistics and O (and in the backward dP, dS, dQ, dK, dV) are float32 in registers; P and dS are
  rounded to the input dtype before they enter the second matmul of each pair, exactly as the naive reference
  rounds P to q's dtype. float32 inputs use ``input_precision="ieee"`` dots (true fp32, no TF32) so that the
  kernel matches float32 PyTorch (whose matmuls do not use TF32 by default); that path is for accuracy, not
  speed — train in bf16/fp16.
* head dims 1 <= D <= 256. D is padded to the constexpr BLOCK_D = max(16, next power of two) with masked loads
  and stores, so 48, 80, 96 (and 8 or 200) work; the padding lanes are zeros and never written back.
* any lengths Nq, Nk >= 1: the sequence tails are handled with masked loads/stores; nothing needs to be a
  multiple of a block size. Offsets within one (batch, head) are int32: each of q, k, v needs
  (N - 1)·stride(N) + (D - 1)·stride(D) < 2³¹ elements (contiguous (B, H, N, D): about N·D; the varlen form's
  (total, H, D): about total·H·D). Batch and head counts up to 65535 (the grid's limits).
* windows of any size >= 1 (WINDOW is a constexpr: each window size compiles its own kernels; 0 is none).
* causal and non-causal masks, windows and documents, each in the forward and in the backward (split and fused),
  with GQA, TMA or pointer loads, and the longest-first grid.
* tensors on a CUDA device, or on the CPU through Triton's interpreter (TRITON_INTERPRET=1 set before the
  kernels are imported; bf16 is wrong in the interpreter because its dots run numpy matmul on raw bits — test
  bf16 on a GPU).

Memory is linear in the sequence length: no Nq x Nk tensor exists anywhere, S and P live in registers tile by
tile. The forward saves only O and the per-row log-sum-exp (base 2, scaled; +inf for rows that see no key).

Dense attention pays nothing for windows and documents: WINDOW = 0 and VARLEN off are constexprs whose branches
vanish, and DOCS is None (a constant, not a parameter), so those kernels compile to the code of kernels written
without either option.

The package, one layer per module:

    blocks.py    @triton.jit helpers shared by the kernels (tile of a program, causal key ranges, the key and
                 query ranges under a window or documents, K/V descriptors)
    forward.py   the forward kernel
    backward.py  the backward kernels (split: dQ then dK/dV; fused: delta pass, dK/dV adding dQ, dQ pass)
    configs.py   tile configs per kernel, dtype and head dim; the autotuners; forced_configs
    launch.py    host side: load path, grid order, launches, autotune picks, fast launcher, launch plans
    ops.py       input checks, the autograd Function, the torch.library custom ops; the public functions

What the host chooses per call — the tile config (autotuned on a GPU, one small config in the interpreter),
TMA descriptors or pointer loads, a longest-first causal grid, the split or fused backward — follows from the
inputs' shapes, dtypes and layout (never their values) within what ``kernels.options`` allows (kernels/options.py).
"""
from .configs import MAX_HEAD_DIM, forced_configs, gpu_configs
from .ops import flash_attention, flash_attention_qkvpacked, flash_attention_varlen
from .._triton import SUPPORTED_DTYPES

__all__ = ["flash_attention", "flash_attention_qkvpacked", "flash_attention_varlen", "forced_configs", "gpu_configs",
           "SUPPORTED_DTYPES", "MAX_HEAD_DIM"]
