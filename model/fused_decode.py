"""One decode step of a GPT, Llama-family, Gemma 3 or OLMo model in few kernels: the fast path of generation on a GPU.

    logits = fused_decode_step(model, tok, pos)   # same contract as generation.decode_one_token

It wraps a GPT from outside (reads its weights and its attached KV caches; changes nothing else). One launch
embeds the tokens; then each layer is four fused Triton launches (three, the MLP block in one) plus the split-KV
decode attention:

    q, k→cache, v→cache = rope(N₁(x) W_attnᵀ + b)        kernels.ln_linear.ln_qkv_to_cache
    y = decode_attention(q, cache)                       kernels.decode (split-KV, GQA; 1 or 2 launches)
    x = x + y W_projᵀ + b                                kernels.ln_linear.ln_linear(residual=x)
    h = act(N₂(x) W_fcᵀ + b)                             ln_linear(ln=..., gelu=True | swiglu=True)
    x = x + h W_mlpᵀ + b                                 ln_linear(residual=x)
                                                         (both as one launch, kernels.decode_mlp.ln_mlp, where
                                                         its fusable() takes the shape; option
                                                         decode_fused_mlp)

One sequence (batch 1) of a model up to STACK_MAX_C wide runs every layer in one persistent launch instead
(kernels.decode_stack: the same phases separated by grid barriers, option decode_stack; stack_plan holds the
model's address table and buffers). Either way, then the final norm and the LM head (PyTorch: cuBLAS streams the
big matrix fastest): about 6 kernels per layer
instead of the ~16 of the eager model (norms, GEMVs, bias adds, RoPE, cache scatters, activation, residual adds),
which is what bounds a small model's decode speed (bench/NOTES.md). The blocks covered, by config:

    GPT-2        learned positions (added by the embedding launch), LayerNorm, GELU, biases
    Llama family RoPE (rotate-half, llama3 frequency scaling: the model's own cos/sin tables, applied to q and k
                 inside the QKV kernel before k is cached), RMSNorm, SwiGLU (c_fc rows [gate | up]), GQA
                 (n_kv_head), head_size != n_embd / n_head, with or without biases, qkv_bias (Qwen2), tied or
                 untied LM head, a sliding window (attention_window, Mistral: the decode kernel reads only the
                 window's key blocks), qk_norm (Qwen3: each q and k head's RMSNorm in the QKV kernel, before
                 RoPE), NoPE layers (SmolLM3: those layers' QKV launch without the RoPE tables)
    Gemma 3      RMSNorms scaled by 1 + weight (the input, q and k norms inside the kernels), embeddings times
                 sqrt(C) (in the embedding launch), q scaled for query_pre_attn_scalar (QKV epilogue), GeGLU
                 (the SwiGLU epilogue with GELU), each layer's RoPE base (windowed layers: rope_local_theta),
                 and the sandwich norms: the output projection and the down projection then store their
                 result, and one row launch adds N(result) to the stream (kernels.residual_norm)
    OLMo 2, 3    no input norms (pre_norm false: the QKV and MLP launches without a norm), the sandwich norms as
                 Gemma's with the weight applied in float32, and q and k normalised over all their heads: the
                 QKV launch stores them as projected and one more launch a layer normalises and rotates them
                 (kernels.qk_norm_rope)
Models with any of the Llama-family extras or Gemma's or OLMo's pieces take the per-layer launches, not the
one-launch stack; unsupported_reason names what is not covered (LayerNorm sandwich norms, q scaled without RoPE,
an OLMo norm elsewhere than OLMo has it).
Rounding follows the eager model in its dtype, so the logits agree to within the usual reduction-order
differences (tests compare them). Meant to be captured in a
CUDA graph (`DecodeGraph(..., step=fused_decode_step)`); generation picks it automatically where
`supported(model)`.
Each norm takes its row statistics from the kernel that wrote its input (see ln_linear's stats_out), so no kernel
waits on a pass over the residual stream before streaming its weights. On Hopper the fused kernels are launched
with programmatic dependent launch (pdl=True: nothing in this chain writes a weight), so each streams its
weights while the kernel before it finishes (kernels/pdl.py). Positions and token ids are not range-checked
here: the caller keeps them inside the cache and the vocabulary (generate() does).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from kernels import SUPPORTED_DTYPES, interpreting
from kernels import _triton
from kernels import options as kernel_options
from kernels.decode import decode_attention
from kernels.decode_mlp import fusable as mlp_fusable
from kernels.decode_mlp import ln_mlp
from kernels.decode_stack import StackPlan, decode_stack
from kernels.decode_stack import fits as stack_fits
from kernels.ln_linear import embed_with_stats, ln_linear, ln_qkv_to_cache
from kernels.qk_norm_rope import qk_norm_rope
from kernels.residual_norm import add_rms_norm

from .norms import Fp32GainRMSNorm, RMSNorm  # (OffsetRMSNorm, Gemma's, is a Fp32GainRMSNorm)


def _norm(norm) -> tuple[tuple, bool]:
    """(weight, bias or None, eps) of a norm layer, and whether it is an RMSNorm (of any kind)."""
    if isinstance(norm, (RMSNorm, Fp32GainRMSNorm)):
        return (norm.weight, None, norm.eps), True
    return (norm.weight, norm.bias, norm.eps), False


# (id of a RotaryEmbedding's inv_freq, dtype, L) -> (weak reference to that inv_freq, cos, sin): the tables of
# positions 0..L-1, kept so that a decode step reads them instead of recomputing the angles every step. A table
# is never replaced while its model lives (a captured CUDA graph may hold its address); L is a power of two, so
# a model has a few at most.
_rope_tables: dict = {}
MIN_ROPE_TABLE = 256


def rope_tables(model, length: int, dtype: torch.dtype, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: (L, head_dim) in dtype for positions 0..L-1 with L >= length, computed by the model's own
    RotaryEmbedding (the same formula, in the same dtype, as the eager model's per-step cos and sin); local: its
    windowed layers' (model.rotary_local, rope_local_theta).

    A miss while a CUDA graph is being captured computes the tables inside the graph (every replay recomputes
    them) and keeps nothing; the warm-up steps before a capture (as DecodeGraph runs them) fill the cache.
    """
    rotary = model.rotary_local if local else model.rotary
    inv_freq = rotary.inv_freq
    L = max(MIN_ROPE_TABLE, 1 << max(length - 1, 0).bit_length())  # a power of two >= length
    key = (id(inv_freq), dtype, L)
    hit = _rope_tables.get(key)
    if hit is not None and hit[0]() is inv_freq:
        return hit[1], hit[2]
    cos, sin = rotary(torch.arange(L, device=inv_freq.device), dtype)  # (L, D) each
    if not (inv_freq.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        for k in [k for k, v in _rope_tables.items() if v[0]() is None]:  # the tables of models that are gone
            del _rope_tables[k]
        _rope_tables[key] = (weakref.ref(inv_freq), cos, sin)
    return cos, sin


def unsupported_reason(model, check_cache: bool = True) -> str | None:
    """Why fused_decode_step cannot run this model, or None when it can (check_cache: its KV caches too)."""
    c = model.config
    qk_all = c.qk_norm and c.qk_norm_scope == "all"
    if c.norm == "rmsnorm_fp32" and (c.pre_norm or (c.qk_norm and not qk_all)):
        return ("norm 'rmsnorm_fp32' on the sub-blocks' inputs or on each head (the fused kernels' norms there are "
                "Llama's or Gemma's)")
    if qk_all and (c.norm != "rmsnorm_fp32" or any(b.attn.q_scale != 1.0 or not b.attn.use_rope
                                                   for b in model.transformer.h)):
        return ("qk_norm over all heads other than OLMo's (its launch normalises with the weight applied in "
                "float32, then rotates, in every layer, and scales no q)")
    if c.sandwich_norm and c.norm == "layernorm":
        return "sandwich_norm with LayerNorm (the fused residual add normalises with an RMSNorm)"
    if any(b.attn.q_scale != 1.0 and not b.attn.use_rope for b in model.transformer.h):
        return "query_scale_dim in a layer without RoPE (the QKV kernel scales q in its RoPE epilogue)"
    if c.qk_norm and not qk_all and (c.pos_emb != "rope" or c.head_dim < 32 or c.head_dim & (c.head_dim - 1)):
        return (f"qk_norm with {'head dim ' + str(c.head_dim) if c.pos_emb == 'rope' else 'learned positions'}: "
                "the QKV kernel normalises q and k heads of a power-of-two dim >= 32, with RoPE")
    w = model.lm_head.weight
    if w.device.type != "cuda" and not (w.device.type == "cpu" and interpreting()):
        return f"the model is on {w.device} (the fused step runs on CUDA)"
    if w.dtype not in SUPPORTED_DTYPES:
        return f"weights of dtype {w.dtype}"
    if model.training and model.config.dropout > 0:
        return "the model is in training mode with dropout"
    for block in model.transformer.h:
        norms = ((block.ln_1, block.ln_2) if c.pre_norm else ()) + (
            (block.ln_attn_out, block.ln_mlp_out) if block.sandwich_norm else ())
        for norm in norms:
            if not isinstance(norm, (nn.LayerNorm, RMSNorm, Fp32GainRMSNorm)) or norm.weight is None:
                return f"a norm layer {type(norm).__name__} without a gain (LayerNorm or RMSNorm with weights)"
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


# id(model) -> (weak reference to the model, StackPlan): a model's address table and buffers, built once (a
# captured CUDA graph holds their addresses) and again only when its weights or caches are other tensors
_stack_plans: dict = {}
INTERPRETER_PROGRAMS = 24  # the interpreter's grid for the stack (programs run one after another there)
# The widest model that the one-launch stack serves by default, from whole decode steps on an H200
# (bench/results/generate_smollm2/stack/one_poller/): SmolLM2-135M (C = 576) 393 against 716 us per
# step in per-layer launches; GPT-2 124M (C = 768: 16 lane pairs and 32 intermediate columns a program) 254
# against 296 us, its tiles checked against the float64 reference on the GPU
# (tests/test_decode_stack.py: test_full_width_models_through_the_stack).
STACK_MAX_C = 768


def _stack_layers(model) -> list[dict]:
    layers = []
    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        ln_1, _ = _norm(block.ln_1)
        ln_2, _ = _norm(block.ln_2)
        layers.append(dict(w_qkv=attn.c_attn.weight, b_qkv=attn.c_attn.bias, ln1=ln_1, w_o=attn.c_proj.weight,
                           b_o=attn.c_proj.bias, ln2=ln_2, w_fc=mlp.c_fc.weight, b_fc=mlp.c_fc.bias,
                           w_down=mlp.c_proj.weight, b_down=mlp.c_proj.bias, k_cache=attn.kv_cache.k,
                           v_cache=attn.kv_cache.v))
    return layers


def stack_plan(model) -> StackPlan | None:
    """The model's plan for kernels.decode_stack (one launch for every layer of a one-sequence step), or None
    where it is wider than STACK_MAX_C, its shape does not fit (decode_stack.fits), its norms mix kinds or it has
    a sliding window, qk_norm, NoPE layers or Gemma's pieces (the stack's attention phase reads every cached key,
    its QKV phase has no per-head norm and rotates every layer or none, and its phases have no sandwich norms;
    the per-layer launches take them all)."""
    tr, c = model.transformer, model.config
    attn = tr.h[0].attn
    device = model.lm_head.weight.device
    programs = INTERPRETER_PROGRAMS if interpreting() else _triton.sm_count(device)
    kinds = {(type(b.ln_1), type(b.ln_2)) for b in tr.h}
    mixed_norms = len(kinds) != 1 or next(iter(kinds))[0] is not next(iter(kinds))[1]
    if (c.attention_window or c.qk_norm or c.nope_interval or c.n_embd > STACK_MAX_C or mixed_norms
            or c.norm in ("rmsnorm1p", "rmsnorm_fp32") or c.sandwich_norm or not c.pre_norm or c.mlp == "geglu"
            or c.embed_scale or c.query_scale_dim):
        return None
    if stack_fits(c.n_embd, c.mlp_hidden, attn.head_dim, attn.n_head, attn.n_kv_head, model.lm_head.weight.dtype,
                  programs):
        return None
    layers = _stack_layers(model)
    hit = _stack_plans.get(id(model))
    if hit is not None and hit[0]() is model and hit[1].same_tensors(layers):
        return hit[1]
    try:
        plan = StackPlan(layers, n_head=attn.n_head, n_kv_head=attn.n_kv_head, head_dim=attn.head_dim,
                         rms=isinstance(tr.h[0].ln_1, RMSNorm), swiglu=c.mlp == "swiglu",
                         rope=model.rotary is not None, programs=programs)
    except ValueError:  # a layer unlike the first (shapes, biases, eps): the per-layer launches take it
        return None
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        if hit is None:  # the plan holds the model's weights and caches: it goes with the model
            weakref.finalize(model, _stack_plans.pop, id(model), None)
        _stack_plans[id(model)] = (weakref.ref(model), plan)
    return plan


def supported(model, check_cache: bool = True) -> bool:
    return unsupported_reason(model, check_cache) is None


def _add_norm(x: torch.Tensor, y: torch.Tensor, norm, kind: str, stats_out) -> torch.Tensor:
    """x + norm(y) (a sandwich norm's residual add, one launch; kind: config.norm), its row sums into stats_out
    (or None)."""
    return add_rms_norm(x, y, norm.weight, norm.eps, kind=kind, stats_out=stats_out, pdl=True)


@torch.no_grad()
def fused_decode_step(model, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """tok: (B, 1) the latest tokens, pos: (B, 1) their positions → logits (B, V) in float32.

    Writes each token's keys and values (keys rotated, for RoPE) at its position in every layer's cache (as the
    eager step does).
    """
    B = tok.shape[0]
    tr, c = model.transformer, model.config
    n_layer = len(tr.h)
    gated = c.mlp in ("swiglu", "geglu")                        # c_fc rows [gate | up]
    offset = c.norm == "rmsnorm1p"                              # norm gains stored as offsets from 1 (Gemma)
    qk_all = c.qk_norm and c.qk_norm_scope == "all"             # q and k normalised over all heads (OLMo)
    one_mlp_launch = (kernel_options.get().decode_fused_mlp and not (c.sandwich_norm or c.mlp == "geglu" or offset)
                      and mlp_fusable(B, c.n_embd, c.mlp_hidden, tok.device))
    p = pos[:, 0]                                               # (B,) positions of the new tokens
    lens = p + 1                                                # (B,) valid cache lengths after this step
    # stats[2l] / stats[2l + 1]: the row sums (Σx, Σx²) feeding layer l's first / second norm, written by the
    # kernel that produces that residual stream (the embedding, then each residual add), so no norm re-reads x
    plan = stack_plan(model) if B == 1 and kernel_options.get().decode_stack else None
    stats = torch.empty(1 if plan else 2 * n_layer, B, 2, dtype=torch.float32, device=tok.device)
    wpe = tr.wpe.weight if "wpe" in tr else None                # RoPE models have no position table
    scale = model.embed_scales[tr.wte.weight.dtype] if model.embed_scales is not None else None  # Gemma's sqrt(C)
    x = embed_with_stats(tok[:, 0], p, tr.wte.weight, wpe, stats, scale=scale)  # (B, C); stats[0] set, rest zeroed
    tables = {}                                                 # cos, sin (L, D) of positions 0..L-1
    if model.rotary is not None:
        max_len = tr.h[0].attn.kv_cache.max_len
        tables[False] = rope_tables(model, max_len, x.dtype)
        if model.rotary_local is not None:                      # the windowed layers' own base (Gemma 3)
            tables[True] = rope_tables(model, max_len, x.dtype, local=True)
    if plan is not None:  # one sequence: every layer and the final norm in one persistent launch
        ln_f, rms_f = _norm(tr.ln_f)
        if rms_f == plan.rms:
            return model.lm_head(decode_stack(plan, x, p, tables[False] if tables else None,
                                              final_norm=ln_f)).float()  # (1, V)
        return model.lm_head(tr.ln_f(decode_stack(plan, x, p, tables[False] if tables else None))).float()

    for i, block in enumerate(tr.h):
        attn, mlp, cache = block.attn, block.mlp, block.attn.kv_cache
        # the input norms (none without pre_norm, OLMo: then no statistics are read)
        (ln_1, rms_1), (ln_2, rms_2) = (_norm(block.ln_1), _norm(block.ln_2)) if c.pre_norm else ((None, False),) * 2
        stats_1, stats_2 = (stats[2 * i], stats[2 * i + 1]) if c.pre_norm else (None, None)
        qk_norm = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps) if attn.qk_norm and not qk_all else None
        rope = tables[attn.local_rope] if attn.use_rope else None  # (SmolLM3's NoPE layers rotate nothing)
        q = ln_qkv_to_cache(x, attn.c_attn.weight, attn.c_attn.bias, ln_1, cache.k, cache.v, p,
                            attn.n_head * attn.head_dim, ln_stats=stats_1, pdl=True, rms=rms_1,
                            rope=None if qk_all else rope, qk_norm=qk_norm, norm_offset=offset,
                            q_scale=attn.q_scale)               # (B, Hq·D), rotated; k (rotated), v in the cache
        if qk_all:  # q and k as projected, normalised over all heads and rotated by a launch of their own
            q = qk_norm_rope(q, cache.k, p, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, rope, pdl=True)
        y = decode_attention(q.view(B, attn.n_head, 1, attn.head_dim), cache.k[:B], cache.v[:B], lens,
                             check_lens=False, window=cache.window)  # (B, Hq, 1, D); the layer's window, if any
        stats_next = stats[2 * i + 2] if i + 1 < n_layer and c.pre_norm else None
        if block.sandwich_norm:  # each sub-block's output normalised again before it joins the stream (Gemma, OLMo)
            y = ln_linear(y.view(B, -1), attn.c_proj.weight, attn.c_proj.bias, pdl=True)  # (B, C)
            x = _add_norm(x, y, block.ln_attn_out, c.norm, stats_2)                      # (B, C)
            h = ln_linear(x, mlp.c_fc.weight, mlp.c_fc.bias, ln=ln_2, rms=rms_2, gelu=not gated, swiglu=gated,
                          geglu=c.mlp == "geglu", norm_offset=offset, ln_stats=stats_2, pdl=True)  # (B, I)
            y = ln_linear(h, mlp.c_proj.weight, mlp.c_proj.bias, pdl=True)              # (B, C)
            x = _add_norm(x, y, block.ln_mlp_out, c.norm, stats_next)                    # (B, C)
            continue
        x = ln_linear(y.view(B, -1), attn.c_proj.weight, attn.c_proj.bias, residual=x,
                      stats_out=stats[2 * i + 1], pdl=True)     # (B, C)
        if one_mlp_launch:  # the whole MLP block in one launch
            x = ln_mlp(x, mlp.c_fc.weight, mlp.c_fc.bias, mlp.c_proj.weight, mlp.c_proj.bias, ln=ln_2, rms=rms_2,
                       swiglu=gated, ln_stats=stats[2 * i + 1], stats_out=stats_next, pdl=True)  # (B, C)
            continue
        h = ln_linear(x, mlp.c_fc.weight, mlp.c_fc.bias, ln=ln_2, rms=rms_2, gelu=not gated, swiglu=gated,
                      geglu=c.mlp == "geglu", norm_offset=offset, ln_stats=stats[2 * i + 1], pdl=True)  # (B, I)
        x = ln_linear(h, mlp.c_proj.weight, mlp.c_proj.bias, residual=x, stats_out=stats_next, pdl=True)  # (B, C)
    # The LM head (V x C, by far the largest matrix) is a bandwidth-bound GEMV that cuBLAS streams faster than
    # the fused kernel (bench/NOTES.md).
    return model.lm_head(tr.ln_f(x)).float()                                             # (B, V)
