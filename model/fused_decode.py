"""One decode step of a GPT in few kernels: the fast path of generation on a GPU.

    logits = fused_decode_step(model, tok, pos)   # same contract as generation.decode_one_token

It wraps a GPT from outside (reads its weights and its attached KV caches; changes nothing else). One launch
embeds the tokens; then each layer is four fused Triton launches plus the split-KV decode attention:

    q, k→cache, v→cache = LN₁(x) W_attnᵀ + b           kernels.ln_linear.ln_qkv_to_cache
    y = decode_attention(q, cache)                       kernels.decode (split-KV; 1 or 2 launches)
    x = x + y W_projᵀ + b                                kernels.ln_linear.ln_linear(residual=x)
    h = GELU(LN₂(x) W_fcᵀ + b)                           ln_linear(ln=..., gelu=True)
    x = x + h W_mlpᵀ + b                                 ln_linear(residual=x)

then LN_f and the LM head (PyTorch: cuBLAS streams the big matrix fastest): about 6 kernels per layer instead
of the ~16 of the eager model (layer norms, GEMVs, bias adds, cache scatters, GELU, residual adds), which is
what bounds a small model's decode speed (bench/NOTES.md). Rounding follows the eager model in its dtype, so the logits agree
to within the usual reduction-order differences (tests compare them). Meant to be captured in a CUDA graph
(`DecodeGraph(..., step=fused_decode_step)`); generation picks it automatically where `supported(model)`.
Each LayerNorm takes its row statistics from the kernel that wrote its input (see ln_linear's stats_out), so
no kernel waits on a pass over the residual stream before streaming its weights. On Hopper the fused kernels
are launched with programmatic dependent launch (pdl=True: nothing in this chain writes a weight), so each
streams its weights while the kernel before it finishes (kernels/pdl.py). Positions and token ids are
not range-checked here: the caller keeps them inside the cache and the vocabulary (generate() does).
"""
from __future__ import annotations

import torch

from kernels import SUPPORTED_DTYPES, interpreting
from kernels.decode import decode_attention
from kernels.ln_linear import embed_with_stats, ln_linear, ln_qkv_to_cache


def _ln(norm) -> tuple:
    return norm.weight, norm.bias, norm.eps


def unsupported_reason(model, check_cache: bool = True) -> str | None:
    """Why fused_decode_step cannot run this model, or None when it can (check_cache: its KV caches too)."""
    c = model.config
    if c.pos_emb != "learned" or c.norm != "layernorm" or c.mlp != "gelu" or c.qk_norm:
        return "the fused step covers GPT-2 blocks only (not RoPE, RMSNorm, SwiGLU or qk_norm)"
    w = model.lm_head.weight
    if w.device.type != "cuda" and not (w.device.type == "cpu" and interpreting()):
        return f"the model is on {w.device} (the fused step runs on CUDA)"
    if w.dtype not in SUPPORTED_DTYPES:
        return f"weights of dtype {w.dtype}"
    if model.training and model.config.dropout > 0:
        return "the model is in training mode with dropout"
    for block in model.transformer.h:
        if not 16 <= block.attn.head_dim <= 256:
            return f"head dim {block.attn.head_dim} outside the decode kernel's 16..256"
        cache = block.attn.kv_cache
        if not check_cache:
            continue
        if cache is None:
            return "no KV cache attached (call model.setup_kv_cache first)"
        if cache.k.dtype != w.dtype:
            return f"KV cache dtype {cache.k.dtype} differs from the weights' {w.dtype}"
    return None


def supported(model, check_cache: bool = True) -> bool:
    return unsupported_reason(model, check_cache) is None


@torch.no_grad()
def fused_decode_step(model, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """tok: (B, 1) the latest tokens, pos: (B, 1) their positions → logits (B, V) in float32.

    Writes each token's keys and values at its position in every layer's cache (as the eager step does).
    """
    B = tok.shape[0]
    tr = model.transformer
    n_layer = len(tr.h)
    p = pos[:, 0]                                               # (B,) positions of the new tokens
    lens = p + 1                                                # (B,) valid cache lengths after this step
    # stats[2l] / stats[2l + 1]: the row sums (Σx, Σx²) feeding layer l's LN₁ / LN₂, written by the kernel that
    # produces that residual stream (the embedding, then each residual add), so no LayerNorm re-reads x for them
    stats = torch.empty(2 * n_layer, B, 2, dtype=torch.float32, device=tok.device)
    x = embed_with_stats(tok[:, 0], p, tr.wte.weight, tr.wpe.weight, stats)  # (B, C); stats[0] set, rest zeroed
    for i, block in enumerate(tr.h):
        attn, mlp, cache = block.attn, block.mlp, block.attn.kv_cache
        q = ln_qkv_to_cache(x, attn.c_attn.weight, attn.c_attn.bias, _ln(block.ln_1), cache.k, cache.v, p,
                            attn.n_head * attn.head_dim, ln_stats=stats[2 * i], pdl=True)  # (B, Hq·D); k, v in the cache
        y = decode_attention(q.view(B, attn.n_head, 1, attn.head_dim), cache.k[:B], cache.v[:B], lens,
                             check_lens=False)                  # (B, Hq, 1, D)
        x = ln_linear(y.view(B, -1), attn.c_proj.weight, attn.c_proj.bias, residual=x,
                      stats_out=stats[2 * i + 1], pdl=True)     # (B, C)
        h = ln_linear(x, mlp.c_fc.weight, mlp.c_fc.bias, ln=_ln(block.ln_2), gelu=True,
                      ln_stats=stats[2 * i + 1], pdl=True)      # (B, 4C)
        x = ln_linear(h, mlp.c_proj.weight, mlp.c_proj.bias, residual=x,
                      stats_out=stats[2 * i + 2] if i + 1 < n_layer else None, pdl=True)  # (B, C)
    # The LM head (V x C, by far the largest matrix) is a bandwidth-bound GEMV that cuBLAS streams faster than
    # the fused kernel (bench/NOTES.md).
    return model.lm_head(tr.ln_f(x)).float()                                             # (B, V)
