"""A decoder-only transformer: GPT-2 by default, Llama-family blocks by config, with one hop to the attention kernels.

Parameter names follow GPT-2 (transformer.wte, transformer.h.N.attn.c_attn, ...) for both families:

    transformer.wte                 token embedding (V, C)
    transformer.wpe                 learned positions (block_size, C); absent with pos_emb = "rope"
    transformer.h.N.ln_1, ln_2      LayerNorm or RMSNorm (cfg.norm); no weights without pre_norm (OLMo 2)
    transformer.h.N.attn.c_attn     fused QKV projection: rows [q heads | k heads | v heads], head_dim rows each
    transformer.h.N.attn.q_norm, k_norm   per-head RMSNorm of q and k (head_dim weights; only with qk_norm; with
                                    qk_norm_scope "all" over all heads: n_head·head_dim, n_kv_head·head_dim)
    transformer.h.N.attn.c_proj     attention output projection (C, n_head·head_dim)
    transformer.h.N.mlp.c_fc        GELU: up (I, C); SwiGLU, GeGLU: gate and up fused, rows [gate (I) | up (I)]
    transformer.h.N.mlp.c_proj      down projection (C, I)
    transformer.h.N.ln_attn_out, ln_mlp_out   norms of the attention's and the MLP's outputs (sandwich_norm only)
    transformer.ln_f, lm_head       final norm; LM head (tied to wte unless tie_embeddings = false)

Attention goes through `kernels.attention_qkvpacked(qkv, ...)` (training, no cache) or the KV cache's
`attend` (prefill and decode): "flash" (Triton), "sdpa" (PyTorch) or "naive" (the reference). RoPE models
rotate q and k inside the packed projection before that call (model/rope.py), except on the flash backend
without a cache (and without qk_norm), which takes the RoPE tables into its packed call (kernels option
rope_in_flash): its backward kernels then store the gradients of q and k rotated back. The NoPE layers of
config.nope_interval (SmolLM3) rotate nothing; the windowed layers of full_attention_interval rotate with
rope_local_theta where it is set (Gemma 3: two RoPE tables, embed() returns both pairs of cos and sin).

Documents packed into a row (forward(..., docs=...), kernels/documents.py) attend within their own document
only, and their positions (learned or RoPE) start at 0 at every document start. config.attention_window limits
every token to itself and the attention_window - 1 tokens before it, in training and in the KV cache alike (in
every layer, or all but every full_attention_interval-th).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
from .config import GPTConfig
from .norms import Fp32GainRMSNorm, OffsetRMSNorm, RMSNorm, make_norm
from .rope import RotaryEmbedding, apply_rope
from .shard_adamw import ShardLocalAdamW


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int = 0):
        super().__init__()
        self.use_rope = cfg.uses_rope(layer)  # False in the NoPE layers of config.nope_interval
        self.local_rope = cfg.uses_local_rope(layer)  # the rope_local_theta table (windowed layers, Gemma 3)
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        # q for every head, k and v for every kv head, in one matmul
        self.c_attn = nn.Linear(cfg.n_embd, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim,
                                bias=cfg.bias or cfg.qkv_bias)
        self.c_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=cfg.bias)
        # over each head (Qwen3, Gemma 3) or over the whole q and k projections (qk_norm_scope "all": OLMo 2)
        self.qk_norm_all = cfg.qk_norm and cfg.qk_norm_scope == "all"
        q_dim, k_dim = (cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim) if self.qk_norm_all else \
            (cfg.head_dim, cfg.head_dim)
        if cfg.qk_norm and cfg.norm == "rmsnorm1p":
            self.q_norm, self.k_norm = OffsetRMSNorm(q_dim, cfg.norm_eps), OffsetRMSNorm(k_dim, cfg.norm_eps)
        elif cfg.qk_norm and cfg.norm == "rmsnorm_fp32":
            self.q_norm, self.k_norm = Fp32GainRMSNorm(q_dim, cfg.norm_eps), Fp32GainRMSNorm(k_dim, cfg.norm_eps)
        elif cfg.qk_norm:
            self.q_norm = RMSNorm(q_dim, eps=cfg.norm_eps, kernel=cfg.llama_kernels)
            self.k_norm = RMSNorm(k_dim, eps=cfg.norm_eps, kernel=cfg.llama_kernels)
        self.qk_norm = cfg.qk_norm
        # q multiplied by this, so that the kernels' 1/sqrt(head_dim) gives config.softmax_scale (query_scale_dim);
        # exactly 1.0 without it (a product of the two square roots need not be)
        qsd = cfg.query_scale_dim
        self.q_scale = math.sqrt(cfg.head_dim / qsd) if qsd and qsd != cfg.head_dim else 1.0
        self.llama_kernels = cfg.llama_kernels
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.backend = cfg.attention
        self.window = cfg.layer_window(layer)
        self.kv_cache = None  # set by GPT.setup_kv_cache for inference

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                docs: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, T, C) → (B, T, C). rope: (cos, sin) of the tokens' positions, for RoPE models (with
        rope_local_theta: (cos, sin, cos_local, sin_local)). docs: (B, 2, T) int32 bounds of the documents packed
        in each row (no KV cache): attention stays within each."""
        B, T, C = x.shape
        if rope is not None:
            rope = None if not self.use_rope else rope[2:] if self.local_rope else rope[:2]
        qkv = self.c_attn(x)  # (B, T, (nh + 2·nkv)·hd)
        backend = kernels.resolve_backend(self.backend, x.device)
        # flash rotates q and k in its own packed call, its backward kernels storing d(q), d(k) rotated back
        rope_in_flash = (rope is not None and backend == "flash" and self.kv_cache is None and not self.qk_norm
                         and self.q_scale == 1.0 and kernels.options.get().rope_in_flash)
        if (rope is not None or self.qk_norm or self.q_scale != 1.0) and not rope_in_flash:
            qkv = self.rotate_qk(qkv, rope)
        if self.kv_cache is None:
            # packed: flash's backward then writes d(qkv) in one buffer, no concatenation of dq, dk, dv
            y = kernels.attention_qkvpacked(qkv, self.n_head, self.n_kv_head, backend=backend, causal=True,
                                           window=self.window, docs=docs,
                                           rope=rope if rope_in_flash else None)  # (B, nh, T, hd)
        else:
            q, k, v = kernels.split_qkv(qkv, self.n_head, self.n_kv_head)  # (B, nh | nkv, T, hd) views
            y = self.kv_cache.attend(q, k, v, input_pos, backend=backend)  # (B, nh, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * self.head_dim)  # (B, T, nh·hd)
        return self.resid_dropout(self.c_proj(y))

    def rotate_qk(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """The packed projection with q and k normalised (qk_norm) and rotated (rope), q scaled by q_scale, v as
        it was.

        qkv: (B, T, (nh + 2·nkv)·hd) → a new packed tensor of the same shape. q and k heads are adjacent in the
        packed layout, so one RoPE pass covers both; the result is packed again for the packed attention call.
        """
        B, T, _ = qkv.shape
        nh, nkv = self.n_head, self.n_kv_head
        heads = qkv.view(B, T, nh + 2 * nkv, self.head_dim)  # (B, T, nh + 2·nkv, hd)
        qk, v = heads[:, :, :nh + nkv], heads[:, :, nh + nkv:]  # (B, T, nh + nkv, hd), (B, T, nkv, hd)
        if self.qk_norm or self.q_scale != 1.0:
            q, k = qk[:, :, :nh], qk[:, :, nh:]  # (B, T, nh, hd), (B, T, nkv, hd)
            if self.qk_norm_all:  # one norm over all heads of q, one over all of k
                q = self.q_norm(q.reshape(B, T, nh * self.head_dim)).view(B, T, nh, self.head_dim)
                k = self.k_norm(k.reshape(B, T, nkv * self.head_dim)).view(B, T, nkv, self.head_dim)
            elif self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.q_scale != 1.0:
                q = q * self.q_scale  # RoPE is linear: scaling before the rotation is the same
            qk = torch.cat((q, k), dim=2)
        rewritten = self.qk_norm or self.q_scale != 1.0
        if rope is not None and kernels.resolve_llama_kernels(self.llama_kernels, qkv.device) == "triton":
            packed = torch.cat((qk.to(v.dtype), v), dim=2).view(B, T, -1) if rewritten else qkv
            return kernels.triton_rope_qkv(packed, *rope, nh, nkv)  # (B, T, (nh + 2·nkv)·hd), one launch
        if rope is not None:
            qk = apply_rope(qk, *rope)  # (B, T, nh + nkv, hd)
        return torch.cat((qk.to(v.dtype), v), dim=2).view(B, T, -1)  # (B, T, (nh + 2·nkv)·hd)


class MLP(nn.Module):
    """GELU: c_proj(GELU(c_fc(x))). SwiGLU: c_proj(SiLU(gate) * up) with [gate | up] = c_fc(x), one matmul;
    GeGLU the same with the tanh GELU in SiLU's place."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        hidden = cfg.mlp_hidden
        self.swiglu = cfg.mlp == "swiglu"
        self.geglu = cfg.mlp == "geglu"
        self.c_fc = nn.Linear(cfg.n_embd, hidden if cfg.mlp == "gelu" else 2 * hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)
        self.llama_kernels = cfg.llama_kernels

    def forward(self, x):
        h = self.c_fc(x)  # (B, T, I) or (B, T, 2I)
        if self.swiglu and kernels.resolve_llama_kernels(self.llama_kernels, h.device) == "triton":
            h = kernels.triton_swiglu(h)  # (B, T, I)
        elif self.swiglu:
            gate, up = h.chunk(2, dim=-1)  # (B, T, I) each
            h = F.silu(gate) * up
        elif self.geglu:
            gate, up = h.chunk(2, dim=-1)  # (B, T, I) each
            h = F.gelu(gate, approximate="tanh") * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    """x + attn(ln_1(x)), then + mlp(ln_2(·)); with sandwich_norm each output is normalised again (ln_attn_out,
    ln_mlp_out) before it joins the residual stream; without pre_norm (OLMo 2) ln_1 and ln_2 are identities, with
    no weights."""

    def __init__(self, cfg: GPTConfig, layer: int = 0):
        super().__init__()
        self.ln_1 = make_norm(cfg) if cfg.pre_norm else nn.Identity()
        self.attn = CausalSelfAttention(cfg, layer)
        self.ln_2 = make_norm(cfg) if cfg.pre_norm else nn.Identity()
        self.mlp = MLP(cfg)
        if cfg.sandwich_norm:
            self.ln_attn_out = make_norm(cfg)
            self.ln_mlp_out = make_norm(cfg)
        self.sandwich_norm = cfg.sandwich_norm

    def forward(self, x, input_pos=None, rope=None, docs=None):
        if self.sandwich_norm:
            x = x + self.ln_attn_out(self.attn(self.ln_1(x), input_pos, rope, docs))
            return x + self.ln_mlp_out(self.mlp(self.ln_2(x)))
        x = x + self.attn(self.ln_1(x), input_pos, rope, docs)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        cfg.validate()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (train.py fills it in from the tokenizer)")
        # the forward reads the kernel options; read them here (and the environment's overrides with them the
        # first time), so that torch.compile tracing a forward finds them set instead of reading os.environ
        # inside the graph, which breaks it in the loop over blocks and sends the whole forward to eager
        kernels.options.get()
        self.config = cfg
        layers = dict(wte=nn.Embedding(cfg.vocab_size, cfg.n_embd))
        if cfg.pos_emb == "learned":
            layers["wpe"] = nn.Embedding(cfg.block_size, cfg.n_embd)
        layers.update(drop=nn.Dropout(cfg.dropout), h=nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layer)]),
                      ln_f=make_norm(cfg))
        self.transformer = nn.ModuleDict(layers)
        self.rotary = RotaryEmbedding(cfg) if cfg.pos_emb == "rope" else None
        # the windowed layers' own RoPE (rope_local_theta, unscaled), or None
        self.rotary_local = (RotaryEmbedding(dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta,
                                                                 rope_scaling=""))
                             if any(cfg.uses_local_rope(i) for i in range(cfg.n_layer)) else None)
        # embed_scale: sqrt(n_embd) rounded to each dtype the embedding may have, as transformers' Gemma rounds it
        self.embed_scales = ({dt: torch.tensor(math.sqrt(cfg.n_embd), dtype=dt, device="cpu").item()
                              for dt in (torch.float64, torch.float32, torch.bfloat16, torch.float16)}
                             if cfg.embed_scale else None)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
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

    @staticmethod
    def from_pretrained(path_or_repo: str, *, dtype: torch.dtype | None = None, device=None) -> "GPT":
        """A Hugging Face model folder or hub id (GPT-2, Llama, Mistral, Phi-3, Qwen2, Qwen3, SmolLM3, OLMo 2,
        OLMo 3, Gemma 3)
        → GPT in eval mode, with the same logits as transformers gives; float32 on the CPU unless dtype/device
        say otherwise. Raises model.hf.HFError with one line on anything it cannot load. See model/hf.py."""
        from .hf import from_pretrained
        return from_pretrained(path_or_repo, dtype=dtype, device=device)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters; non_embedding leaves out the lookup tables (wpe, and wte when the LM head is its own)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            if "wpe" in self.transformer:
                n -= self.transformer.wpe.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.transformer.wte.weight.numel()
        return n

    def setup_kv_cache(self, batch: int, max_len: int, dtype=None, device=None) -> None:
        """Attach a static KVCache of (batch, n_kv_head, max_len, head_dim) to every attention layer (with the
        layer's sliding window, if any)."""
        from .kv_cache import KVCache
        if max_len > self.config.block_size:
            raise ValueError(f"cache length {max_len} exceeds block_size={self.config.block_size}")
        p = self.lm_head.weight
        for block in self.transformer.h:
            a = block.attn
            a.kv_cache = KVCache(batch, a.n_kv_head, max_len, a.head_dim, dtype or p.dtype, device or p.device,
                                 window=a.window)

    def clear_kv_cache(self) -> None:
        for block in self.transformer.h:
            block.attn.kv_cache = None

    def set_attention_backend(self, backend: str) -> None:
        for block in self.transformer.h:
            block.attn.backend = backend
        self.config.attention = backend

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                input_pos: torch.Tensor | None = None, docs: torch.Tensor | None = None):
        """idx: (B, T) token ids → (logits (B, T, vocab), loss or None).

        input_pos: None for training (positions 0..T-1, no cache); with a KV cache attached, the
        positions of idx's tokens: (T,) shared by the batch, or (B, T) per sequence.
        docs (training, no cache): (B, 2, T) int32 bounds of the documents packed in each row
        (kernels.document_bounds(idx, eot_token)): every token attends within its document only, and positions
        restart at 0 at each document start, so each document gets the logits it would get alone.
        With targets the loss is the differentiable output and the logits come back detached (for logging or
        accuracy; a loss of your own on the logits: call without targets). Under torch.compile an output that
        requires grad gets a gradient input of its own in the backward graph — zeros added to the loss's
        d(logits), a full extra pass over (B, T, vocab) (bench/NOTES.md). The loss runs the kernel that
        config.loss_kernel names (kernels.cross_entropy).
        """
        B, T = idx.shape
        if input_pos is None and T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size={self.config.block_size}")
        if docs is not None and (input_pos is not None or tuple(docs.shape) != (B, 2, T)):
            raise ValueError(f"docs must be ({B}, 2, {T}) document bounds of idx, without input_pos (a KV cache)"
                             f"; got {tuple(docs.shape)}")
        x, rope = self.embed(idx, input_pos, docs)  # (B, T, C); RoPE's cos, sin (and the local pair) or None
        for block in self.transformer.h:
            x = block(x, input_pos, rope, docs)
        return self.head(x, targets)

    # embed and head are the root's own work around the blocks. The model calls them as attributes, so that
    # model/parallel.py's compile_root can put compiled versions on an instance (under FSDP2, whose hooks must
    # stay outside compiled code) without changing the module tree or the parameter names.

    def embed(self, idx: torch.Tensor, input_pos: torch.Tensor | None = None,
              docs: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """The residual stream's start: idx (B, T) token ids → x (B, T, C) (token embeddings, times sqrt(n_embd)
        with embed_scale, plus learned positions, then dropout), and RoPE's (cos, sin) of the tokens' positions
        ((T | B T, hd) each) for RoPE models, followed by the rope_local_theta pair where the model has one, else
        None. Positions: 0..T-1, input_pos (a KV cache), or restarting at each document (docs)."""
        T = idx.size(1)
        if docs is not None:
            pos = kernels.document_positions(docs)  # (B, T)
        elif input_pos is None:
            pos = torch.arange(T, device=idx.device)  # (T,)
        else:
            pos = input_pos  # (T,) or (B, T)
        x = self.transformer.wte(idx)  # (B, T, C)
        if self.embed_scales is not None:
            x = x * self.embed_scales[x.dtype]
        rope = None
        if self.rotary is not None:
            dtype = (x.dtype if not torch.is_autocast_enabled(x.device.type)
                     else torch.get_autocast_dtype(x.device.type))
            bound = T if input_pos is None else None
            rope = self.rotary(pos, dtype, bound=bound)  # cos, sin: (T | B T, hd)
            if self.rotary_local is not None:
                rope = (*rope, *self.rotary_local(pos, dtype, bound=bound))  # + the local cos, sin
        else:
            x = x + self.transformer.wpe(pos)  # (B, T, C)
        return self.transformer.drop(x), rope

    def head(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        """The residual stream's end: x (B, T, C) → (logits (B, T, vocab), loss or None): final norm, LM head,
        and with targets (B, T) the mean cross-entropy (config.loss_kernel), the logits then detached."""
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = kernels.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1,
                                         kernel=self.config.loss_kernel)  # ()
            logits = logits.detach()
        return logits, loss

    def configure_optimizer(self, weight_decay: float, lr: float, betas: tuple[float, float], device_type: str):
        """AdamW with decay on matrices only (not biases or norm weights); fused on CUDA, multi-tensor (foreach)
        on the CPU, where torch would otherwise update one tensor at a time: the same numbers, bit for bit, in a
        half to a fifth of the host time (bench/fsdp_host.py). Under FSDP2 the step updates the local shards of the
        DTensor parameters (model/shard_adamw.py), with torch's AdamW state and updates."""
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return ShardLocalAdamW(groups, lr=lr, betas=betas, fused=device_type == "cuda",
                               foreach=True if device_type == "cpu" else None)

    def flops_per_token(self) -> float:
        """nanoGPT's count: 6·params + 12·layers·heads·head_dim·T (forward + backward)."""
        c = self.config
        return 6 * self.num_params() + 12 * c.n_layer * c.n_head * c.head_dim * c.block_size
