"""A GPT-2-style decoder-only transformer (nanoGPT-sized), with one hop to the attention kernels.

Parameter names follow GPT-2 (transformer.wte, transformer.h.N.attn.c_attn, ...). Attention goes through
`kernels.attention(q, k, v, backend=...)`: "flash" (Triton), "sdpa" (PyTorch) or "naive" (the reference).
With a KV cache attached (see model/kv_cache.py) the same forward runs prefill and decode steps.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
from .config import GPTConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        # q for every head, k and v for every kv head, in one matmul
        self.c_attn = nn.Linear(cfg.n_embd, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.backend = cfg.attention
        self.kv_cache = None  # set by GPT.setup_kv_cache for inference

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.c_attn(x)  # (B, T, (nh + 2·nkv)·hd)
        backend = kernels.resolve_backend(self.backend, x.device)
        if self.kv_cache is None:
            # packed: flash's backward then writes d(qkv) in one buffer, no concatenation of dq, dk, dv
            y = kernels.attention_qkvpacked(qkv, self.n_head, self.n_kv_head, backend=backend,
                                           causal=True)  # (B, nh, T, hd)
        else:
            q, k, v = kernels.split_qkv(qkv, self.n_head, self.n_kv_head)  # (B, nh | nkv, T, hd) views
            y = self.kv_cache.attend(q, k, v, input_pos, backend=backend)  # (B, nh, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x, input_pos=None):
        x = x + self.attn(self.ln_1(x), input_pos)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        cfg.validate()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (train.py fills it in from the tokenizer)")
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by 1/sqrt(2·n_layer)
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @staticmethod
    def from_hf_gpt2(model_or_state_dict, **kwargs) -> "GPT":
        """A transformers GPT2LMHeadModel (or its state dict) → GPT with the same logits; see model/hf.py."""
        from .hf import from_hf_gpt2
        return from_hf_gpt2(model_or_state_dict, **kwargs)

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def setup_kv_cache(self, batch: int, max_len: int, dtype=None, device=None) -> None:
        """Attach a static KVCache of (batch, n_kv_head, max_len, head_dim) to every attention layer."""
        from .kv_cache import KVCache
        if max_len > self.config.block_size:
            raise ValueError(f"cache length {max_len} exceeds block_size={self.config.block_size}")
        p = self.lm_head.weight
        for block in self.transformer.h:
            a = block.attn
            a.kv_cache = KVCache(batch, a.n_kv_head, max_len, a.head_dim, dtype or p.dtype, device or p.device)

    def clear_kv_cache(self) -> None:
        for block in self.transformer.h:
            block.attn.kv_cache = None

    def set_attention_backend(self, backend: str) -> None:
        for block in self.transformer.h:
            block.attn.backend = backend
        self.config.attention = backend

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                input_pos: torch.Tensor | None = None):
        """idx: (B, T) token ids → (logits (B, T, vocab), loss or None).

        input_pos: None for training (positions 0..T-1, no cache); with a KV cache attached, the
        positions of idx's tokens: (T,) shared by the batch, or (B, T) per sequence.
        With targets the loss is the differentiable output and the logits come back detached (for logging or
        accuracy; a loss of your own on the logits: call without targets). Under torch.compile an output that
        requires grad gets a gradient input of its own in the backward graph — zeros added to the loss's
        d(logits), a full extra pass over (B, T, vocab) (bench/NOTES.md). The loss runs the kernel that
        config.loss_kernel names (kernels.cross_entropy).
        """
        B, T = idx.shape
        if input_pos is None:
            if T > self.config.block_size:
                raise ValueError(f"sequence of length {T} is longer than block_size={self.config.block_size}")
            pos = torch.arange(T, device=idx.device)  # (T,)
        else:
            pos = input_pos
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x, input_pos)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = kernels.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1,
                                         kernel=self.config.loss_kernel)
            logits = logits.detach()
        return logits, loss

    def configure_optimizer(self, weight_decay: float, lr: float, betas: tuple[float, float], device_type: str):
        """AdamW with decay on matrices only (not biases, LayerNorm or position tables); fused on CUDA."""
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=device_type == "cuda")

    def flops_per_token(self) -> float:
        """nanoGPT's count: 6·params + 12·layers·heads·head_dim·T (forward + backward)."""
        c = self.config
        return 6 * self.num_params() + 12 * c.n_layer * c.n_head * c.head_dim * c.block_size
