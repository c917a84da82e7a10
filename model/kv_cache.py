"""A static, preallocated KV cache per attention layer, with gpt-fast's `input_pos` API.

    cache = KVCache(batch, n_kv_head, max_len, head_dim, dtype, device)
    y = cache.attend(q, k, v, input_pos, backend)   # writes k, v at input_pos, then attends

input_pos holds the positions of the new tokens: (T,) shared by the batch (prefill, or a chunk of it) or
(B, T) per sequence (decode of prompts of different lengths). The new tokens of sequence b must end at the
highest position it holds: the cache keeps positions 0..input_pos[b, -1] valid.

window > 0 (a model with attention_window): the token at position p attends to positions p - window + 1 .. p
only. Prefill chunks run the attention backend with that window; decode steps (up to DECODE_MAX_TOKENS new
tokens) on the flash backend pass it to the split-KV decode kernel, which then reads only the window's key
blocks, and on the other backends attend through an explicit mask over the cache (a fixed-shape call that CUDA
graphs and torch.compile take as they are). A window that covers the whole cache cuts nothing and is dropped.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels

DECODE_MAX_TOKENS = 16  # up to this many new tokens per call go through the split-KV decode kernel


class KVCache(nn.Module):
    def __init__(self, batch: int, n_kv_head: int, max_len: int, head_dim: int, dtype, device, window: int = 0):
        super().__init__()
        shape = (batch, n_kv_head, max_len, head_dim)
        self.window = window if 0 < window < max_len else 0
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def attend(self, q, k, v, input_pos: torch.Tensor, backend: str) -> torch.Tensor:
        """q: (B, Hq, T, D); k, v: (B, Hkv, T, D) for the new tokens → (B, Hq, T, D)."""
        B, T = q.shape[0], q.shape[2]
        if input_pos.dim() == 1:  # (T,): the same positions for every sequence
            self.k[:B, :, input_pos] = k.to(self.k.dtype)
            self.v[:B, :, input_pos] = v.to(self.v.dtype)
        else:                     # (B, T): per-sequence positions, one scatter kernel each for k and v
            where = input_pos[:, None, :, None].expand(k.shape)  # (B, Hkv, T, D): the position of each element
            self.k[:B].scatter_(2, where, k.to(self.k.dtype))
            self.v[:B].scatter_(2, where, v.to(self.v.dtype))
        k_all, v_all = self.k[:B], self.v[:B]  # (B, Hkv, max_len, D)
        decode = T <= DECODE_MAX_TOKENS
        if backend == "flash" and decode and q.dtype == k_all.dtype:
            # (B,) valid lengths, new tokens included. A fresh contiguous tensor: the kernel reads lens[b] at
            # LENS + b, so a stride-0 .expand(B) view would make it read past the end for b > 0.
            lens = (input_pos[-1] + 1).repeat(B) if input_pos.dim() == 1 else input_pos[:, -1] + 1  # (B,)
            # The write above already refused positions outside the cache, so on CUDA the kernel's own check of
            # lens (a GPU→CPU sync per layer and step, which stalls eager decoding) is skipped.
            return _decode_attention(q, k_all, v_all, lens, check_lens=q.device.type != "cuda", window=self.window)
        if input_pos.dim() == 1 and not (self.window and decode):
            # prefill chunk: keys 0..end-1, causal mask (and window) aligned bottom-right
            end = int(input_pos[-1]) + 1
            return kernels.attention(q, k_all[:, :, :end], v_all[:, :, :end], backend=backend, causal=True,
                                     window=self.window)
        # per-sequence positions without the decode kernel, or a windowed decode step: an explicit mask over the
        # whole cache
        visible = self._visible(input_pos)  # (T, L) or (B, T, L)
        return masked_attention(q, k_all, v_all, visible if input_pos.dim() == 1 else visible[:, None],
                                exact=backend == "naive")

    def _visible(self, input_pos: torch.Tensor) -> torch.Tensor:
        """Which cache positions each new token sees: input_pos (T,) → (T, L), (B, T) → (B, T, L) bool."""
        j = torch.arange(self.max_len, device=input_pos.device)  # (L,)
        pos = input_pos[..., None]  # (T, 1) or (B, T, 1)
        visible = j <= pos
        return visible & (j > pos - self.window) if self.window else visible


@torch.compiler.disable  # a torch.compile'd decode step calls the kernel as is (dynamo need not trace its launch)
def _decode_attention(q, k_all, v_all, lens, check_lens: bool, window: int) -> torch.Tensor:
    from kernels.decode import decode_attention
    return decode_attention(q, k_all, v_all, lens, check_lens=check_lens, window=window)  # (B, Hq, T, D)


def masked_attention(q, k, v, visible: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """softmax(Q Kᵀ/√D, visible) V with GQA; visible broadcasts to (B, Hq, T, L). exact: the naive reference."""
    k, v = k.to(q.dtype), v.to(q.dtype)
    if exact:
        return kernels.naive_attention(q, k, v, causal=False, mask=visible)  # (B, Hq, T, D)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=q.shape[1] != k.shape[1])
