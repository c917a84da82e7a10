"""GPTConfig: the model's shape, validated.

The defaults are GPT-2 (learned positions, LayerNorm, GELU MLP 4·n_embd wide, biases, tied LM head), so configs
and checkpoints written before the Llama-family options exist load unchanged. A Llama-style model sets

    pos_emb = "rope", norm = "rmsnorm", mlp = "swiglu", bias = false   (+ n_kv_head for GQA)

and Qwen2 adds qkv_bias = true; Qwen3 adds qk_norm = true; SmolLM3 adds nope_interval = 4. OLMo 2 is Llama's with

    norm = "rmsnorm_fp32", pre_norm = false, sandwich_norm = true, qk_norm = true, qk_norm_scope = "all"

and Gemma 3 is

    norm = "rmsnorm1p", sandwich_norm = true, mlp = "geglu", embed_scale = true, qk_norm = true,
    attention_window = 512, full_attention_interval = 6, rope_local_theta = 10000, rope_theta = 1e6

Every option is one field; validate() names the first bad one in one line.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kernels import BACKEND_CHOICES, LLAMA_KERNELS, LOSS_KERNELS

MAX_BLOCK_SIZE = 1 << 17  # learned position embeddings: the table must fit comfortably in memory
POS_EMBS = ("learned", "rope")
NORMS = ("layernorm", "rmsnorm", "rmsnorm1p", "rmsnorm_fp32")
QK_NORM_SCOPES = ("head", "all")
MLPS = ("gelu", "swiglu", "geglu")
ROPE_SCALINGS = ("", "llama3", "linear", "yarn")
SWIGLU_MULTIPLE = 64  # the default SwiGLU width is rounded up to a multiple of this


class ConfigError(ValueError):
    """A bad configuration value; the message names the key."""


@dataclass
class GPTConfig:
    block_size: int = 256      # context length in tokens (and the size of the learned position table)
    vocab_size: int = 0        # 0 = take it from the tokenizer (GPT-2: 50257 padded to 50304)
    n_layer: int = 6
    n_head: int = 6
    n_kv_head: int = 0         # key/value heads; 0 = n_head (multi-head), fewer = GQA, 1 = MQA
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = True          # biases in every Linear and LayerNorm layer, as GPT-2
    # Llama-family options (the defaults are GPT-2's)
    head_size: int = 0         # width of one attention head; 0 = n_embd // n_head
    pos_emb: str = "learned"   # "learned" (a block_size x n_embd table, GPT-2) | "rope" (rotary, Llama)
    rope_theta: float = 10000.0  # RoPE base: head-dim pair i turns at rope_theta^(-2i/head_dim) radians per token
    rope_scaling: str = ""     # "" | "llama3" (Llama-3.1's frequency scaling) | "linear" (position interpolation:
                               # every frequency / rope_factor) | "yarn" (YaRN), with the rope_* fields below
    rope_factor: float = 8.0             # llama3, linear, yarn: long wavelengths are stretched by this factor
    rope_low_freq_factor: float = 1.0    # llama3: wavelengths above original_max_pos / this are fully scaled
    rope_high_freq_factor: float = 4.0   # llama3: wavelengths below original_max_pos / this are kept
    rope_original_max_pos: int = 8192    # llama3, yarn: the context the unscaled model was trained with
    rope_beta_fast: float = 32.0         # yarn: pairs turning more than this often in original_max_pos are kept
    rope_beta_slow: float = 1.0          # yarn: pairs turning less than this often are fully stretched
    rope_attention_factor: float = 0.0   # yarn: cos and sin multiplied by it; 0 = 0.1·ln(rope_factor) + 1
    rope_yarn_truncate: bool = True      # yarn: the blended band's ends rounded out to whole pairs
    rope_local_theta: float = 0.0  # RoPE base of the windowed layers of full_attention_interval, which then
                               # take no rope_scaling (Gemma 3: 10000 there, rope_theta 1e6 in the full layers);
                               # 0 = every layer as rope_theta and rope_scaling say
    norm: str = "layernorm"    # "layernorm" (GPT-2) | "rmsnorm" (Llama: x / rms rounded, then times the weight) |
                               # "rmsnorm1p" (Gemma: RMSNorm scaled by 1 + weight in float32, the weight stored as
                               # its offset from 1) | "rmsnorm_fp32" (OLMo 2: times the weight in float32, then
                               # rounded once)
    norm_eps: float = 1e-5     # epsilon of every norm layer
    sandwich_norm: bool = False  # a norm on the attention's and the MLP's outputs too, before each joins the
                               # residual stream (Gemma 2/3)
    pre_norm: bool = True      # a norm on the attention's and the MLP's inputs; false: on their outputs only
                               # (OLMo 2; needs sandwich_norm, the norms after)
    mlp: str = "gelu"          # "gelu" (GPT-2: GELU(x W_fc) W_proj) | "swiglu" (Llama: (SiLU(x W_g) * x W_u) W_d)
                               # | "geglu" (Gemma: (GELU_tanh(x W_g) * x W_u) W_d)
    intermediate_size: int = 0  # MLP hidden width; 0 = 4·n_embd (gelu) or 8·n_embd/3 rounded up to 64 (swiglu,
                               # geglu)
    embed_scale: bool = False  # token embeddings multiplied by sqrt(n_embd), rounded to their dtype (Gemma)
    query_scale_dim: int = 0   # attention logits scaled by 1/sqrt(query_scale_dim); 0 = head dim (Gemma's
                               # query_pre_attn_scalar)
    qkv_bias: bool = False     # biases on the QKV projection even when bias = false (Qwen2)
    tie_embeddings: bool = True  # the LM head shares the token embedding's weight
    qk_norm: bool = False      # RMSNorm over each head's q and k (weights of head_size), before RoPE (Qwen3)
    qk_norm_scope: str = "head"  # qk_norm over "head" (each head's q and k) | "all" (the whole q and k
                               # projections, n_head·head_size and n_kv_head·head_size weights: OLMo 2)
    nope_interval: int = 0     # RoPE models: every nope_interval-th layer (for 4: the 4th, 8th, ...) has no position
                               # encoding at all (NoPE, SmolLM3); 0 = RoPE in every layer
    llama_kernels: str = "auto"  # RMSNorm, SwiGLU, RoPE: "triton" | "torch"; "auto" = the llama_kernels option
    attention: str = "auto"    # "flash" | "sdpa" | "naive"; "auto" = flash on CUDA, sdpa on CPU
    attention_window: int = 0  # sliding window: each token attends to itself and the window - 1 tokens before it
                               # (0 = the whole causal prefix); part of the model: training and evaluation
    full_attention_interval: int = 0  # with attention_window: every full_attention_interval-th layer (for 6: the
                               # 6th, 12th, ...) attends to the whole causal prefix (Gemma 3); 0 = the window
                               # in every layer
    loss_kernel: str = "auto"  # "triton" | "torch"; "auto" = the kernels' loss_kernel option (Triton on CUDA)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.head_size or self.n_embd // self.n_head

    def uses_rope(self, layer: int) -> bool:
        """Whether block `layer` (0-based) rotates q and k: RoPE models, except the NoPE layers of nope_interval."""
        return self.pos_emb == "rope" and not (self.nope_interval and (layer + 1) % self.nope_interval == 0)

    def layer_window(self, layer: int) -> int:
        """Block `layer`'s sliding window (0: the whole causal prefix): attention_window, except every
        full_attention_interval-th layer."""
        if self.full_attention_interval and (layer + 1) % self.full_attention_interval == 0:
            return 0
        return self.attention_window

    def uses_local_rope(self, layer: int) -> bool:
        """Whether block `layer` rotates with rope_local_theta (unscaled) instead of rope_theta and rope_scaling:
        the windowed layers of full_attention_interval, where rope_local_theta is set."""
        return bool(self.rope_local_theta) and self.uses_rope(layer) and bool(self.layer_window(layer)) \
            and bool(self.full_attention_interval)

    @property
    def softmax_scale(self) -> float:
        """What q·k is multiplied by before the softmax: 1/sqrt(query_scale_dim or head_dim)."""
        return (self.query_scale_dim or self.head_dim) ** -0.5

    @property
    def mlp_hidden(self) -> int:
        """The MLP's hidden width: intermediate_size, or the default of the MLP kind."""
        if self.intermediate_size:
            return self.intermediate_size
        if self.mlp in ("swiglu", "geglu"):  # about the parameters of a 4·n_embd GELU MLP, in three matrices instead of two
            return math.ceil(8 * self.n_embd / 3 / SWIGLU_MULTIPLE) * SWIGLU_MULTIPLE
        return 4 * self.n_embd

    def validate(self, prefix: str = "model.") -> "GPTConfig":
        def bad(key, msg):
            raise ConfigError(f"{prefix}{key}={getattr(self, key)!r}: {msg}")
        for key in ("block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, key) <= 0:
                bad(key, "must be positive")
        if self.block_size > MAX_BLOCK_SIZE and self.pos_emb == "learned":
            bad("block_size", f"is above the largest learned position table this model allows ({MAX_BLOCK_SIZE}; "
                              "pos_emb = 'rope' has no table)")
        if self.vocab_size < 0:
            bad("vocab_size", "must be positive (or 0 to take it from the tokenizer)")
        if self.head_size < 0:
            bad("head_size", "must be positive (or 0 for n_embd // n_head)")
        if not self.head_size and self.n_embd % self.n_head:
            bad("n_embd", f"must be divisible by n_head={self.n_head} (or set head_size)")
        if self.n_kv_head < 0 or (self.n_kv_head and self.n_head % self.n_kv_head):
            bad("n_kv_head", f"must divide n_head={self.n_head} (or be 0 for n_head)")
        if not 0.0 <= self.dropout < 1.0:
            bad("dropout", "must be in [0, 1)")
        self._validate_architecture(bad)
        if self.attention_window < 0:
            bad("attention_window", "must be 0 (no window) or a positive number of tokens")
        if self.full_attention_interval < 0:
            bad("full_attention_interval", "must be 0 (the window in every layer) or a positive layer interval")
        if self.full_attention_interval and not self.attention_window:
            bad("full_attention_interval", "needs attention_window (the window of the other layers)")
        if self.query_scale_dim < 0:
            bad("query_scale_dim", "must be positive (or 0 for the head dim)")
        if self.attention not in BACKEND_CHOICES:
            bad("attention", f"must be one of {', '.join(BACKEND_CHOICES)}")
        if self.loss_kernel not in LOSS_KERNELS:
            bad("loss_kernel", f"must be one of {', '.join(LOSS_KERNELS)}")
        return self

    def _validate_architecture(self, bad) -> None:
        """The Llama-family fields: positions, norms, MLP kind and widths."""
        if self.pos_emb not in POS_EMBS:
            bad("pos_emb", f"must be one of {', '.join(POS_EMBS)}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 1.0):
            bad("rope_theta", "must be a finite number above 1")
        if self.pos_emb == "rope" and self.head_dim % 2:
            bad("head_size" if self.head_size else "n_embd", f"gives head dim {self.head_dim}: RoPE needs it even")
        if self.rope_scaling not in ROPE_SCALINGS:
            bad("rope_scaling", "must be '' (none), 'llama3', 'linear' or 'yarn'")
        if self.rope_scaling and self.pos_emb != "rope":
            bad("rope_scaling", "needs pos_emb = 'rope'")
        if not (math.isfinite(self.rope_factor) and self.rope_factor >= 1.0):
            bad("rope_factor", "must be a finite number of at least 1")
        if not (math.isfinite(self.rope_low_freq_factor) and self.rope_low_freq_factor > 0):
            bad("rope_low_freq_factor", "must be positive")
        if not (math.isfinite(self.rope_high_freq_factor) and self.rope_high_freq_factor > self.rope_low_freq_factor):
            bad("rope_high_freq_factor", f"must be above rope_low_freq_factor={self.rope_low_freq_factor}")
        if self.rope_original_max_pos <= 0:
            bad("rope_original_max_pos", "must be positive")
        if not (math.isfinite(self.rope_beta_slow) and self.rope_beta_slow > 0):
            bad("rope_beta_slow", "must be positive")
        if not (math.isfinite(self.rope_beta_fast) and self.rope_beta_fast > self.rope_beta_slow):
            bad("rope_beta_fast", f"must be above rope_beta_slow={self.rope_beta_slow}")
        if not (math.isfinite(self.rope_attention_factor) and self.rope_attention_factor >= 0):
            bad("rope_attention_factor", "must be positive (or 0 for 0.1·ln(rope_factor) + 1)")
        if not (math.isfinite(self.rope_local_theta) and (self.rope_local_theta == 0 or self.rope_local_theta > 1)):
            bad("rope_local_theta", "must be 0 (rope_theta in every layer) or a finite number above 1")
        if self.rope_local_theta and not (self.pos_emb == "rope" and self.full_attention_interval):
            bad("rope_local_theta", "needs pos_emb = 'rope' and full_attention_interval (it is the windowed "
                                    "layers' RoPE base)")
        if self.nope_interval < 0:
            bad("nope_interval", "must be 0 (RoPE in every layer) or a positive layer interval")
        if self.nope_interval and self.pos_emb != "rope":
            bad("nope_interval", "needs pos_emb = 'rope' (it leaves every nope_interval-th layer without RoPE)")
        if self.norm not in NORMS:
            bad("norm", f"must be one of {', '.join(NORMS)}")
        if not (math.isfinite(self.norm_eps) and 0 < self.norm_eps < 1):
            bad("norm_eps", "must be in (0, 1)")
        if not self.pre_norm and not self.sandwich_norm:
            bad("pre_norm", "false needs sandwich_norm = true (the norms on the sub-blocks' outputs)")
        if self.qk_norm_scope not in QK_NORM_SCOPES:
            bad("qk_norm_scope", f"must be one of {', '.join(QK_NORM_SCOPES)}")
        if self.mlp not in MLPS:
            bad("mlp", f"must be one of {', '.join(MLPS)}")
        if self.intermediate_size < 0:
            bad("intermediate_size", "must be positive (or 0 for the MLP kind's default)")
        if self.llama_kernels not in LLAMA_KERNELS:
            bad("llama_kernels", f"must be one of {', '.join(LLAMA_KERNELS)}")
