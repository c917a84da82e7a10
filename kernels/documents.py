"""Documents packed into sequences: their bounds per token, as every attention backend takes them.

    docs = document_bounds(idx, eot_token)     # (B, T) token ids → (B, 2, T) int32
    docs = bounds_from_cu_seqlens(cu, total)   # FlashAttention's cu_seqlens → (1, 2, total) int32
    pos = document_positions(docs)             # (B, T) int64: each token's position within its document
    visible = document_mask(docs)              # (B, 1, T, T) bool: query i may see key j (same document)

The bounds: docs[b, 0, i] and docs[b, 1, i] are the first token and one past the last token of the document
that holds token i of row b. A row's first token starts a document, so no document crosses a row. Built on the
tensors' device without reading anything back to the host, and traceable by torch.compile; the kernels read
them as they are (kernels/flash: key blocks outside a tile's documents are never loaded).
"""
from __future__ import annotations

import torch


def document_bounds(idx: torch.Tensor, eot_token: int) -> torch.Tensor:
    """(B, 2, T) int32 bounds of the documents in token rows idx (B, T): a document ends after each end-of-text
    token eot_token (the token belongs to the document it ends) and at the end of the row."""
    if idx.dim() != 2:
        raise ValueError(f"document_bounds expects (B, T) token ids, got shape {tuple(idx.shape)}")
    B, T = idx.shape
    pos = torch.arange(T, device=idx.device, dtype=torch.int32)  # (T,)
    ends_here = idx == eot_token  # (B, T): the document ends after this token
    # a document starts at 0 and after every end-of-text token: the start of token i is the last such place <= i
    starts = torch.zeros((B, T), dtype=torch.int32, device=idx.device)
    starts[:, 1:] = torch.where(ends_here[:, :-1], pos[1:], 0)
    starts = starts.cummax(dim=1).values
    # its end is one past the first end-of-text token at or after i (T when none)
    ends = torch.where(ends_here, pos + 1, T).to(torch.int32)
    ends = ends.flip(1).cummin(dim=1).values.flip(1)
    return torch.stack((starts, ends), dim=1)  # (B, 2, T)


def bounds_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """(1, 2, total) int32 bounds of the sequences [cu_seqlens[s], cu_seqlens[s + 1]) of a packed batch
    (cu_seqlens as check_cu_seqlens accepts it)."""
    cu = cu_seqlens.to(torch.int64)
    token = torch.arange(total, device=cu.device)  # (total,)
    seq = torch.searchsorted(cu[1:], token, right=True)  # (total,) the sequence of each token
    return torch.stack((cu[seq], cu[seq + 1]))[None].to(torch.int32)  # (1, 2, total)


def document_positions(docs: torch.Tensor) -> torch.Tensor:
    """(B, N) int64: each token's position within its document (0 at every document start)."""
    N = docs.shape[-1]
    return torch.arange(N, device=docs.device) - docs[:, 0].to(torch.int64)


def document_mask(docs: torch.Tensor) -> torch.Tensor:
    """(B, 1, N, N) bool: True where query i and key j are in the same document (no causal mask)."""
    N = docs.shape[-1]
    j = torch.arange(N, device=docs.device)[None, None, :]  # (1, 1, N) key index
    inside = (j >= docs[:, 0, :, None]) & (j < docs[:, 1, :, None])  # (B, N, N)
    return inside[:, None]


def check_docs(docs, batch: int, n: int, device: torch.device, what: str) -> None:
    """ValueError (one line) unless docs is a (batch, 2, n) int32 tensor on `device`. Its values are not read."""
    if not isinstance(docs, torch.Tensor):
        raise ValueError(f"{what}: docs must be a (B, 2, N) int32 tensor, got {type(docs).__name__}")
    if docs.dtype != torch.int32 or tuple(docs.shape) != (batch, 2, n):
        raise ValueError(f"{what}: docs must be ({batch}, 2, {n}) int32 document bounds (document_bounds), got "
                         f"{tuple(docs.shape)} {docs.dtype}")
    if docs.device != device:
        raise ValueError(f"{what}: docs are on {docs.device}, the inputs on {device}")


def check_cu_seqlens(cu_seqlens, total: int, device: torch.device, max_seqlen: int | None = None,
                     check_values: bool = True) -> None:
    """ValueError (one line) unless cu_seqlens is a (n + 1,) int32/int64 tensor on `device` holding 0, then
    non-decreasing offsets, then total (values read back only with check_values), with every sequence at most
    max_seqlen long when that is given."""
    what = "flash_attention_varlen"
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{what}: cu_seqlens must be a 1-d tensor of n + 1 >= 2 offsets, got "
                         f"{tuple(cu_seqlens.shape) if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens!r}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what}: cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.device != device:
        raise ValueError(f"{what}: cu_seqlens is on {cu_seqlens.device}, q on {device}")
    if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int)
                                   or max_seqlen < 1):
        raise ValueError(f"{what}: max_seqlen must be a positive int (or None), got {max_seqlen!r}")
    if not check_values:
        return
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != total:
        raise ValueError(f"{what}: cu_seqlens must run from 0 to the token count {total}, got {cu[0]} .. {cu[-1]}")
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    if min(lengths) < 0:
        at = lengths.index(min(lengths))
        raise ValueError(f"{what}: cu_seqlens must not decrease, got {cu[at]} then {cu[at + 1]} at {at}")
    if max_seqlen is not None and max(lengths) > max_seqlen:
        raise ValueError(f"{what}: a sequence of {max(lengths)} tokens is longer than max_seqlen={max_seqlen}")
