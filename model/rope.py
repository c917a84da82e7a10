"""Rotary position embeddings (RoPE) in Hugging Face's rotate-half layout, so hub weights need no permutation.

    rotary = RotaryEmbedding(cfg)             # holds inv_freq (head_dim/2,), float32, not in the state dict
    cos, sin = rotary(pos, dtype)             # pos (T,) or (B, T) → each (T, D) or (B, T, D)
    cos, sin = rotary(pos, dtype, bound=T)    # every pos < T <= block_size: looked up in a table
    q = apply_rope(q, cos, sin)               # q (B, T, H, D), the heads of one packed projection

Head-dim pair (i, i + D/2) of a token at position p is turned by the angle p · inv_freq[i], with
inv_freq[i] = rope_theta^(-2i/D), rescaled by cfg.rope_scaling: "llama3" (Llama-3.1's bands), "linear" (all
divided by rope_factor) or "yarn" (YaRN: long wavelengths divided, short ones kept, a linear blend between,
and cos and sin multiplied by its attention factor, which scales every q·k by its square). The angles are
computed in float32 and cos/sin rounded to the activations' dtype, as transformers does.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from kernels.naive import apply_rope  # noqa: F401  (the rotation itself: model code and tests import it here)


def rope_inv_freq(cfg, device=None) -> torch.Tensor:
    """(head_dim/2,) float32 angular frequencies (radians per token) of the config's RoPE."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    if cfg.rope_scaling == "llama3":
        inv_freq = _llama3_scaled(inv_freq, cfg)
    elif cfg.rope_scaling == "linear":
        inv_freq = inv_freq / cfg.rope_factor
    elif cfg.rope_scaling == "yarn":
        inv_freq = _yarn_scaled(inv_freq, cfg)
    return inv_freq


def rope_attention_factor(cfg) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (given, or 0.1·ln(rope_factor) + 1), else 1."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.rope_attention_factor:
        return cfg.rope_attention_factor
    return 0.1 * math.log(cfg.rope_factor) + 1.0 if cfg.rope_factor > 1 else 1.0


def _yarn_scaled(inv_freq: torch.Tensor, cfg) -> torch.Tensor:
    """YaRN's frequencies: pair i keeps its frequency where it turns more than rope_beta_fast times in
    rope_original_max_pos tokens, is divided by rope_factor where it turns fewer than rope_beta_slow times, and
    blends the two linearly in i between (the band's ends rounded out to whole pairs with rope_yarn_truncate)."""
    d, base, old_len = cfg.head_dim, cfg.rope_theta, cfg.rope_original_max_pos

    def pair_turning(turns: float) -> float:  # the (fractional) pair index that turns `turns` times in old_len
        return d * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(cfg.rope_beta_fast), pair_turning(cfg.rope_beta_slow)
    if cfg.rope_yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # a band of no width: a step instead of a ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    return inv_freq / cfg.rope_factor * ramp + inv_freq * (1 - ramp)  # (D/2,): kept below low, divided above high


def _llama3_scaled(inv_freq: torch.Tensor, cfg) -> torch.Tensor:
    """Llama-3.1's rescaling: wavelengths longer than original_max_pos / low_freq_factor are stretched by
    rope_factor, those shorter than original_max_pos / high_freq_factor are kept, and the band between blends
    the two linearly in original_max_pos / wavelength."""
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_pos
    wavelen = 2 * math.pi / inv_freq                                   # (D/2,) tokens per turn
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)                  # 0 at the long end of the band, 1 at the short
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding(nn.Module):
    """cos and sin of the RoPE angles at given positions. inv_freq and the cos/sin tables of positions below
    block_size are plain float32 tensors, not buffers: they are in no state dict, DistributedDataParallel does
    not broadcast them every step, and a cast of the model (model.to(torch.bfloat16)) does not round them. They
    follow the module's moves (to, cuda, to_empty), recomputed from the config on the new device, so a model
    built on the meta device gets real values."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.inv_freq = rope_inv_freq(cfg)  # (D/2,) float32, on the default device
        self.reset()

    def reset(self, device=None) -> None:
        """Recompute inv_freq and the cos/sin tables (float32) on `device` (default: where they are)."""
        device = device if device is not None else self.inv_freq.device
        self.inv_freq = rope_inv_freq(self.cfg, device)  # (D/2,)
        # the angles of positions 0 .. block_size - 1, as forward() computes them: (block_size, D) each
        self.cos_table, self.sin_table = self._cos_sin(torch.arange(self.cfg.block_size, device=device))

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.reset(fn(self.inv_freq).device)  # where the move sends tensors; the dtype stays float32
        return self

    def _cos_sin(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos (...) integer → cos, sin (..., D) float32."""
        freqs = pos[..., None].float() * self.inv_freq   # (..., D/2) angles
        angles = torch.cat((freqs, freqs), dim=-1)       # (..., D): pair (i, i + D/2) shares angle i
        scale = rope_attention_factor(self.cfg)
        if scale != 1.0:
            return angles.cos() * scale, angles.sin() * scale
        return angles.cos(), angles.sin()

    def forward(self, pos: torch.Tensor, dtype: torch.dtype,
                bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """pos: (T,) or (B, T) integer positions → cos, sin: (T, D) or (B, T, D) in `dtype`.

        bound: a number that every position is known to be below without reading pos (a training sequence's
        length T: positions 0 .. T - 1, or restarting at each document), at most block_size. Then cos and sin
        are read from the tables instead of computed: the same values. Under torch.compile this keeps cos and
        sin out of every layer's RoPE kernel, where Inductor would otherwise recompute both for each element
        of q and k, forward and backward. Without it (generation: cache positions may pass block_size) they
        are computed.
        """
        if bound is not None and bound <= self.cfg.block_size:
            return self.cos_table[pos].to(dtype), self.sin_table[pos].to(dtype)
        cos, sin = self._cos_sin(pos)
        return cos.to(dtype), sin.to(dtype)
