"""Every kernel variant of the fused decode path compiles for a Hopper GPU (sm_90), checked on any machine.

Triton's interpreter, which runs the kernel tests on a CPU, accepts kernels that its compiler rejects, so the
decode kernels (kernels/ln_linear.py, kernels/decode.py) are compiled here ahead of time through Triton's GPU
compiler to PTX and, with the ptxas Triton ships, to a cubin. The argument lists are not written out by hand:
the project's own wrappers and fused_decode_step run with each launch turned into a compile
(tests/gpu_compile.py), so every variant compiled is one that a GPU would launch, with the same constexprs,
tile configs and argument specialisations. Compiling happens in a child process started with
TRITON_INTERPRET=0 and an empty Triton cache; the child prints a JSON list with a record per compiled variant.

The child stands in for an sm_90 device with programmatic dependent launch (pdl on and off through the pdl
option) and 132 SMs (H100 / H200), and takes CPU tensors (device checks off; nothing is launched). It also runs
a layer of SmolLM2-135M's, Qwen2-0.5B's and Qwen3-0.6B's shape (and two of Gemma 3 270M's) in bf16 at batch 1,
8 and 16, and reports `ptxas -v`'s registers and spills of every paired (SwiGLU, RoPE-QKV) variant: none may
spill but the whole-K tiles that the paired launches keep under PDL above PDL_FEW_ROWS rows (kernels/ln_linear.py:
measured faster there).
"""
from __future__ import annotations

import re

H200_SMS = 132
DTYPES = ("float16", "bfloat16")
GPT2 = dict(n_head=8, n_embd=512)  # head dim 64, MLP 2048: the down projection's K splits with and without PDL
LLAMA = dict(n_head=4, n_kv_head=2, n_embd=512, head_size=128, intermediate_size=2048, pos_emb="rope",
             norm="rmsnorm", mlp="swiglu", bias=False)  # GQA (2 query heads per kv head), head dim 128
LLAMA_MODELS = {  # one layer of each, as the paired tiles were chosen for (kernels/ln_linear.py)
    "smollm2-135m": dict(n_head=9, n_kv_head=3, n_embd=576, intermediate_size=1536),
    "qwen2-0.5b": dict(n_head=14, n_kv_head=2, n_embd=896, intermediate_size=4864, qkv_bias=True),
    # Qwen3-0.6B: q and k heads RMS-normalised in the QKV kernel, one head (64 pairs) per tile
    "qwen3-0.6b": dict(n_head=16, n_kv_head=8, n_embd=1024, head_size=128, intermediate_size=3072, qk_norm=True),
}


# --------------------------------------------------------------------- the child: compile what the path launches

DTYPE_ARG = {"_ln_linear_kernel": "X", "_embed_kernel": "WTE", "_decode_split_kernel": "Q",
             "_decode_merge_kernel": "OUT", "_ln_mlp_kernel": "X", "_decode_stack_kernel": "X0",
             "_add_rms_norm_kernel": "X", "_qk_norm_rope_kernel": "Q"}  # the argument whose pointer dtype is the variant's dtype


def _steps(dtype, pdl: bool, batch: int = 1) -> None:
    """fused_decode_step on a GPT-2-like, a Llama-like, a Qwen2-like (qkv_bias) and a SmolLM3-like (its second
    layer without RoPE) model, the MLP blocks in one launch where the default takes them (kernels/decode_mlp.py)
    and in two."""
    import torch

    from kernels import options
    from model import GPT, GPTConfig
    from model.fused_decode import fused_decode_step
    for kw in (GPT2, LLAMA, dict(LLAMA, qkv_bias=True), dict(LLAMA, nope_interval=2)):
        model = GPT(GPTConfig(block_size=64, vocab_size=64, n_layer=2, attention="naive", **kw)).to(dtype).eval()
        model.setup_kv_cache(batch, 64)
        for fused_mlp in (True, False):
            with options.use(pdl=pdl, decode_fused_mlp=fused_mlp, decode_stack=False):
                fused_decode_step(model, torch.full((batch, 1), 3), torch.full((batch, 1), 5))


def _llama_model_steps() -> None:
    """fused_decode_step in bf16 on one layer of each of LLAMA_MODELS, at batch 1, 8 and 16, with and without PDL,
    the MLP blocks in one launch where the default takes them and in two."""
    import torch

    from kernels import options
    from model import GPT, GPTConfig
    from model.fused_decode import fused_decode_step
    for kw in LLAMA_MODELS.values():
        cfg = GPTConfig(block_size=64, vocab_size=64, n_layer=1, attention="naive", pos_emb="rope", norm="rmsnorm",
                        mlp="swiglu", bias=False, **kw)
        model = GPT(cfg).to(torch.bfloat16).eval()
        for batch in (1, 8, 16):
            model.setup_kv_cache(batch, 64)
            for pdl in (True, False):
                for fused_mlp in (True, False):
                    with options.use(pdl=pdl, decode_fused_mlp=fused_mlp, decode_stack=False):
                        fused_decode_step(model, torch.full((batch, 1), 3), torch.full((batch, 1), 5))


# Gemma 3 270M: a windowed layer (local RoPE base) and a global one; q and k norms over head dim 256 (a tile of
# 128 pairs), offset norms, GeGLU, sandwich norms (the residual add's row launch); q scaled by Gemma 3 27B's
# query_pre_attn_scalar (168; 270M's is its head dim, no scale) so that the scale compiles too
GEMMA3_270M = dict(n_head=4, n_kv_head=1, n_embd=640, head_size=256, intermediate_size=2048, pos_emb="rope",
                   norm="rmsnorm1p", mlp="geglu", bias=False, sandwich_norm=True, embed_scale=True, qk_norm=True,
                   norm_eps=1e-6, attention_window=32, full_attention_interval=2, rope_theta=1e6,
                   rope_local_theta=1e4, query_scale_dim=168)


def _gemma_model_steps() -> None:
    """fused_decode_step in bf16 on two layers of Gemma 3 270M's shape at batch 1, 8 and 16, with and without
    PDL."""
    import torch

    from kernels import options
    from model import GPT, GPTConfig
    from model.fused_decode import fused_decode_step
    model = GPT(GPTConfig(block_size=64, vocab_size=64, n_layer=2, attention="naive", **GEMMA3_270M))
    model = model.to(torch.bfloat16).eval()
    for batch in (1, 8, 16):
        model.setup_kv_cache(batch, 64)
        for pdl in (True, False):
            with options.use(pdl=pdl):
                fused_decode_step(model, torch.full((batch, 1), 3), torch.full((batch, 1), 40))


# OLMo 2 1B: no input norms, the sandwich norms' row launches with the weight in float32, q and k normalised over
# all 16 heads of 128 by a launch of their own; and one OLMo 3-like windowed layer
OLMO2_1B = dict(n_head=16, n_kv_head=16, n_embd=2048, intermediate_size=8192, pos_emb="rope", norm="rmsnorm_fp32",
                mlp="swiglu", bias=False, pre_norm=False, sandwich_norm=True, qk_norm=True, qk_norm_scope="all",
                rope_theta=5e5, norm_eps=1e-6, tie_embeddings=False, attention_window=32, full_attention_interval=2)


def _olmo_model_steps() -> None:
    """fused_decode_step in bf16 on two layers of OLMo 2 1B's shape (the first windowed, as OLMo 3's) at batch 1
    and 16, with and without PDL."""
    import torch

    from kernels import options
    from model import GPT, GPTConfig
    from model.fused_decode import fused_decode_step
    model = GPT(GPTConfig(block_size=64, vocab_size=64, n_layer=2, attention="naive", **OLMO2_1B))
    model = model.to(torch.bfloat16).eval()
    for batch in (1, 16):
        model.setup_kv_cache(batch, 64)
        for pdl in (True, False):
            with options.use(pdl=pdl):
                fused_decode_step(model, torch.full((batch, 1), 3), torch.full((batch, 1), 40))


STACK_MODELS = {  # the whole stack in one launch (kernels/decode_stack.py) at batch 1
    "gpt2": GPT2, "llama": LLAMA, "qwen": dict(LLAMA, qkv_bias=True),
    "smollm2-135m": dict(LLAMA_MODELS["smollm2-135m"], pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False),
    "gpt2-124m": dict(n_head=12, n_embd=768),
}


def _stack_steps(dtype) -> None:
    """fused_decode_step at batch 1 with the stack on, on each of STACK_MODELS (two layers; GPT-2 124M's width
    is within model.fused_decode's STACK_MAX_C, and STACK_MODES requires its variant), with the option
    decode_stack_merged_sums off and on (on: MERGED up to decode_stack.MERGED_MAX_C)."""
    import torch

    import model.fused_decode as fd
    from kernels import options
    from model import GPT, GPTConfig
    for kw in STACK_MODELS.values():
        model = GPT(GPTConfig(block_size=64, vocab_size=64, n_layer=2, attention="naive", **kw)).to(dtype).eval()
        model.setup_kv_cache(1, 64)
        for merged in (False, True):
            with options.use(decode_stack=True, decode_stack_merged_sums=merged):
                fd.fused_decode_step(model, torch.full((1, 1), 3), torch.full((1, 1), 5))


def _paired_split_k(dtype, pdl: bool) -> None:
    """SwiGLU and RoPE-into-the-cache over a K long enough to split (2048) and few output tiles."""
    import torch

    from kernels import options
    from kernels.ln_linear import ln_linear, ln_qkv_to_cache
    K, D = 2048, 64

    def t(*shape):
        return torch.randn(*shape).to(dtype)

    x, rms = t(1, K), (t(K), None, 1e-5)                                        # (1, K)
    k_cache, v_cache = t(1, 1, 64, D), t(1, 1, 64, D)                           # (B, Hkv, max_len, D)
    with options.use(pdl=pdl):
        ln_linear(x, t(128, K), ln=rms, rms=True, swiglu=True, pdl=pdl)         # [gate | up] rows of 64
        ln_qkv_to_cache(x, t(4 * D, K), None, rms, k_cache, v_cache, torch.tensor([5]), 2 * D, pdl=pdl,
                        rms=True, rope=(t(64, D), t(64, D)))                    # Hq = 2, Hkv = 1


def _split_attention(dtype) -> None:
    """decode_attention over 4 splits, with the merge launch and merged inside the split kernel: MHA with head
    dim 64, GQA with head dim 128; MHA with the broadcast-and-sum tile (dot=False)."""
    import torch

    from kernels import options
    from kernels.decode import DecodeTile, decode_attention
    for merge in (False, True):
        for hq, hkv, d in ((8, 8, 64), (4, 2, 128)):
            q = torch.randn(1, hq, 1, d).to(dtype)                              # (B, Hq, 1, D)
            cache = torch.randn(1, hkv, 1024, d).to(dtype)                      # (B, Hkv, max_len, D)
            with options.use(pdl=True, decode_merge_in_split=merge):
                decode_attention(q, cache, cache, torch.tensor([600]), num_splits=4)
        q, cache = torch.randn(1, 8, 1, 64).to(dtype), torch.randn(1, 8, 1024, 64).to(dtype)  # one row per kv head
        with options.use(pdl=True, decode_merge_in_split=merge):               # the broadcast-and-sum products
            decode_attention(q, cache, cache, torch.tensor([600]), num_splits=4,
                             tile=DecodeTile(64, 4, 1, dot=False))
        # the automatic count of GPT-2's 12 heads at batch 1 on H200_SMS SMs: 11 splits, one per SM, so the
        # four-stage tile (deep_tile); in both split orders
        q, cache = torch.randn(1, 12, 1, 64).to(dtype), torch.randn(1, 12, 4096, 64).to(dtype)
        for order in ("strided", "chunks"):
            with options.use(pdl=True, decode_merge_in_split=merge, decode_split_order=order):
                decode_attention(q, cache, cache, torch.tensor([4096]), check_lens=False)
        # TMA descriptor loads (decode_tma): that batch-1 plan, and batch 16's full grid (one split)
        with options.use(pdl=True, decode_merge_in_split=merge, decode_tma=True):
            decode_attention(q, cache, cache, torch.tensor([4096]), check_lens=False)
            q16, cache16 = torch.randn(16, 12, 1, 64).to(dtype), torch.randn(16, 12, 1024, 64).to(dtype)
            decode_attention(q16, cache16, cache16, torch.full((16,), 1000), check_lens=False)
        # 64 query rows per program (decode_min_rows: warpgroup MMAs): that batch-1 plan, batch 16's full grid and
        # GQA at head dim 128 over 4 splits
        with options.use(pdl=True, decode_merge_in_split=merge, decode_min_rows=64):
            decode_attention(q, cache, cache, torch.tensor([4096]), check_lens=False)
            decode_attention(q16, cache16, cache16, torch.full((16,), 1000), check_lens=False)
            q4, cache4 = torch.randn(1, 4, 1, 128).to(dtype), torch.randn(1, 2, 1024, 128).to(dtype)
            decode_attention(q4, cache4, cache4, torch.tensor([600]), num_splits=4)
        # a softmax state per warp's part of each key block (decode_key_parts = the default tile's 4 warps): that
        # batch-1 plan, batch 16's full grid and GQA at head dim 128 over 4 splits
        with options.use(pdl=True, decode_merge_in_split=merge, decode_key_parts=4):
            decode_attention(q, cache, cache, torch.tensor([4096]), check_lens=False)
            decode_attention(q16, cache16, cache16, torch.full((16,), 1000), check_lens=False)
            decode_attention(q4, cache4, cache4, torch.tensor([600]), num_splits=4)


# the child processes' shares of the launches (tests/util.py: compiled_records), each about a third of the time
PARTS = (*DTYPES, "models")


def compile_decode_launches(part: str | None = None) -> list[dict]:
    """Run in a process started with TRITON_INTERPRET=0: every decode launch above compiled for sm_90; with a
    part of PARTS, its share: one dtype's steps, paired split-K, split attention and stack, or the batch-8 and
    model steps."""
    import torch

    import kernels._triton as kt
    import kernels.decode as decode
    import kernels.decode_mlp as dm
    import kernels.decode_stack as dstack
    import kernels.ln_linear as ll
    import kernels.qk_norm_rope as qr
    import kernels.residual_norm as rn
    from kernels import options
    from kernels.pdl import triton_has_gdc
    from tests.gpu_compile import compiling_instead_of_launching, describe, ptxas_usage

    kt.check_device = lambda device, what: None  # CPU tensors stand in for the GPU's; nothing is launched
    kt.sm_count = lambda device: H200_SMS
    decode._tma_device = lambda device: True  # descriptors over the CPU tensors, as over a Hopper GPU's
    ll.pdl_enabled = decode.pdl_enabled = dm.pdl_enabled = rn.pdl_enabled = qr.pdl_enabled = \
        lambda device: triton_has_gdc() and options.get().pdl
    torch.manual_seed(0)
    kernels = (ll._ln_linear_kernel, ll._embed_kernel, decode._decode_split_kernel, decode._decode_merge_kernel,
               dm._ln_mlp_kernel, dstack._decode_stack_kernel, rn._add_rms_norm_kernel, qr._qk_norm_rope_kernel)
    with compiling_instead_of_launching(*kernels) as compiled, torch.no_grad():
        for dtype in (getattr(torch, name) for name in DTYPES if part in (None, name)):
            for pdl in (True, False):
                _steps(dtype, pdl)
                _paired_split_k(dtype, pdl)
            _split_attention(dtype)
            _stack_steps(dtype)
        if part in (None, "models"):
            _steps(torch.bfloat16, pdl=True, batch=8)  # more rows than PDL_FEW_ROWS: the wider PDL tiles
            _llama_model_steps()
            _gemma_model_steps()
            _olmo_model_steps()
    records = [describe(c, DTYPE_ARG) for c in compiled]
    for c, rec in zip(compiled, records):
        if rec["kernel"] == "_ln_linear_kernel" and (rec["consts"]["SWIGLU"] or rec["consts"]["ROPE"]):
            rec["ptxas"] = ptxas_usage(c)
        if rec["kernel"] in ("_ln_mlp_kernel", "_add_rms_norm_kernel", "_qk_norm_rope_kernel"):
            rec["ptxas"] = ptxas_usage(c)
        if rec["kernel"] == "_decode_stack_kernel":
            rec["ptxas"] = ptxas_usage(c)
            # the barrier: a releasing arrival (atom, or red where the count is unused: Triton 3.9), acquiring
            # polls; other programs' data read past L1
            ptx = c.asm["ptx"]
            rec["barrier_ptx"] = dict(release_add=bool(re.search(r"(atom|red)\.global\.gpu\.release\.add", ptx)),
                                      acquire_load="ld.global.acquire.gpu" in ptx, cg_loads="ld.global.cg" in ptx,
                                      warp0_polls=bool(re.search(r"SPIN_LOOP_\w+: ld\.global\.acquire\.gpu", ptx)))
        if rec["kernel"] == "_decode_split_kernel":
            rec["stages"] = c.metadata.num_stages
            rec["shared"] = c.metadata.shared
            rec["ptxas"] = ptxas_usage(c)
            rec["loop_barriers"] = _loop_barriers(c.asm["ptx"])
        if rec["consts"].get("MERGE"):  # the counter's release/acquire and the loads of other programs' parts
            ptx = c.asm["ptx"]
            rec["merge_ptx"] = dict(acq_rel_add="atom.global.gpu.acq_rel.add" in ptx, cg_loads="ld.global.cg" in ptx)
    return records


def _loop_barriers(ptx: str) -> list[int]:
    """The CTA barriers (bar.sync) in each loop of a PTX kernel: the lines from a label to a branch back to it."""
    lines = ptx.splitlines()
    labels = {ln.strip().split(":")[0]: i for i, ln in enumerate(lines) if re.match(r"\$L__\w+:", ln.strip())}
    loops = []
    for i, ln in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", ln)
        if m and labels.get(m.group(1), i) < i:
            loops.append(sum("bar.sync" in x for x in lines[labels[m.group(1)]:i]))
    return loops


# --------------------------------------------------------------------- the test: what must have compiled

def _tags(rec: dict) -> set[str]:
    """A compiled variant's modes as tags, each switch named on or off."""
    c = rec["consts"]
    tags = {rec["kernel"], rec["dtype"], "pdl" if c.get("USE_GDC") else "no_pdl"}
    if rec["kernel"] == "_ln_linear_kernel":
        tags.add(("rmsnorm" if c["RMS"] else "layernorm") if c["HAS_LN"] else "no_norm")
        tags.add("bias" if c["HAS_BIAS"] else "no_bias")
        tags.add("split_k" if c["SPLIT_K"] > 1 else "one_split")
        tags.update({f"block_n{c['BLOCK_N']}", f"block_k{c['BLOCK_K']}", f"splits{c['SPLIT_K']}"})
        tags.update(name.lower() if c[flag] else "no_" + name.lower() for flag, name in (
            ("LN_HAS_BIAS", "ln_bias"), ("GELU", "gelu"), ("SWIGLU", "swiglu"), ("ROPE", "rope"),
            ("QKV_CACHE", "qkv_cache"), ("HAS_RES", "residual"), ("LN_STATS_IN", "stats_in"),
            ("STATS_OUT_ON", "stats_out"), ("QK_NORM", "qk_norm"), ("OFFSET", "offset"), ("GEGLU", "geglu"),
            ("Q_SCALED", "q_scaled")))
    elif rec["kernel"] == "_ln_mlp_kernel":
        tags.update({"rmsnorm" if c["RMS"] else "layernorm", "swiglu" if c["SWIGLU"] else "gelu",
                     "bias" if c["HAS_FC_BIAS"] else "no_bias", "stats_out" if c["STATS_OUT_ON"] else "no_stats_out",
                     f"block_i{c['BLOCK_I']}", f"c{c['PART_A']}+{c['PART_B']}"})
    elif rec["kernel"] == "_decode_stack_kernel":
        tags.update({"rmsnorm" if c["RMS"] else "layernorm", "swiglu" if c["SWIGLU"] else "gelu",
                     "rope" if c["ROPE"] else "no_rope", "qkv_bias" if c["QKV_BIAS"] else "no_qkv_bias",
                     "bias" if c["O_BIAS"] else "no_bias", f"d{c['D']}", f"c{c['C']}",
                     "gqa" if c["HKV"] < c["HQ"] else "mha", "merged_sums" if c["MERGED"] else "sums"})
    elif rec["kernel"] == "_embed_kernel":
        tags.add("wpe" if c["HAS_WPE"] else "no_wpe")
        tags.add("scaled" if c["SCALED"] else "no_scale")
    elif rec["kernel"] == "_qk_norm_rope_kernel":
        tags.add(f"d{c['D']}")
    elif rec["kernel"] == "_add_rms_norm_kernel":
        tags.update({("rmsnorm", "offset", "fp32_gain")[c["KIND"]], "stats_out" if c["STATS_OUT_ON"] else "no_stats_out",
                     f"block_c{c['BLOCK_C']}"})
    else:
        tags.update({f"d{c['HEAD_DIM']}", "split" if c.get("SPLIT", True) else "no_split",
                     "gqa" if c.get("GROUP", 1) > 1 else "mha", "dot" if c.get("DOT", True) else "vec",
                     "merge" if c.get("MERGE") else "no_merge", "strided" if c.get("STRIDED") else "chunks",
                     "tma" if c.get("TMA") else "pointers"})
        if "BLOCK_M" in c:
            tags.add(f"rows{c['BLOCK_M']}")
        tags.add(f"parts{c.get('PARTS', 1)}")
        if "stages" in rec:
            tags.add(f"stages{rec['stages']}")
    return tags


LN_LINEAR_MODES = [  # each launched with and without PDL, in each dtype
    # GPT-2: the four launches of a layer (the last layer's down projection leaves no statistics)
    "layernorm ln_bias bias qkv_cache stats_in no_rope no_gelu no_swiglu one_split",
    "no_norm bias residual stats_out no_gelu no_swiglu one_split",
    "layernorm ln_bias bias gelu stats_in no_residual one_split",
    "no_norm bias residual stats_out split_k",
    "no_norm bias residual no_stats_out split_k",
    # Llama family: RMSNorm, RoPE into the cache, SwiGLU, no biases; qkv_bias (Qwen2); paired modes split over K
    # (under PDL the paired launches are always split: LLAMA_MODEL_MODES)
    "rmsnorm no_ln_bias no_bias qkv_cache rope stats_in",
    "rmsnorm no_ln_bias bias qkv_cache rope stats_in",
    "rmsnorm no_ln_bias no_bias qkv_cache no_rope stats_in",  # SmolLM3's NoPE layers
    "no_norm no_bias residual stats_out one_split",
    "rmsnorm no_bias swiglu no_gelu stats_in no_residual",
    "no_norm no_bias residual stats_out split_k",
    "no_norm no_bias residual no_stats_out split_k",
    "rmsnorm no_bias swiglu split_k",
    "rmsnorm no_bias qkv_cache rope split_k",
]
OTHER_MODES = [
    "_embed_kernel wpe", "_embed_kernel no_wpe",
    # unsplit (the steps' short caches) with and without PDL; split and merged over 4 splits, by the merge
    # kernel or inside the split kernel (decode_merge_in_split)
    "_decode_split_kernel mha d64 no_split pdl", "_decode_split_kernel mha d64 no_split no_pdl",
    "_decode_split_kernel gqa d128 no_split pdl", "_decode_split_kernel gqa d128 no_split no_pdl",
    "_decode_split_kernel mha d64 split pdl dot no_merge", "_decode_split_kernel gqa d128 split pdl dot no_merge",
    "_decode_split_kernel mha d64 split pdl vec no_merge",
    "_decode_merge_kernel d64", "_decode_merge_kernel d128",
    "_decode_split_kernel mha d64 split pdl dot merge", "_decode_split_kernel gqa d128 split pdl dot merge",
    "_decode_split_kernel mha d64 split pdl vec merge",
    # the automatic count at batch 1 (one split program per SM): four stages, strided blocks or chunks
    "_decode_split_kernel mha d64 split pdl dot no_merge strided stages4",
    "_decode_split_kernel mha d64 split pdl dot merge strided stages4",
    "_decode_split_kernel mha d64 split pdl dot no_merge chunks stages4",
    "_decode_split_kernel mha d64 split pdl dot no_merge strided stages3",
    # TMA descriptor loads (decode_tma): that batch-1 plan (three stages with TMA), and batch 16's full grid
    "_decode_split_kernel mha d64 split pdl dot no_merge strided stages3 tma",
    "_decode_split_kernel mha d64 split pdl dot merge strided stages3 tma",
    "_decode_split_kernel mha d64 no_split tma",
    # 64 query rows per program (decode_min_rows): the batch-1 plan, batch 16's full grid, GQA at head dim 128
    "_decode_split_kernel mha d64 split pdl dot no_merge strided stages4 rows64",
    "_decode_split_kernel mha d64 split pdl dot merge strided stages4 rows64",
    "_decode_split_kernel mha d64 no_split rows64",
    "_decode_split_kernel gqa d128 split pdl dot no_merge rows64",
    # a softmax state per part of each key block (decode_key_parts): the same three
    "_decode_split_kernel mha d64 split pdl dot no_merge strided stages4 parts4",
    "_decode_split_kernel mha d64 split pdl dot merge strided stages4 parts4",
    "_decode_split_kernel mha d64 no_split parts4",
    "_decode_split_kernel gqa d128 split pdl dot no_merge parts4",
]
PTR_DTYPES = {"float16": "fp16", "bfloat16": "bf16"}
MLP_MODES = [  # the MLP block in one launch at batch 1 (kernels/decode_mlp.py), with and without PDL, each dtype
    "layernorm gelu bias stats_out block_i16 c256+256",      # GPT-2-like, C = 512
    "layernorm gelu bias no_stats_out block_i16 c256+256",   # its last layer
    "rmsnorm swiglu no_bias stats_out block_i16 c256+256",   # Llama-like
]
MLP_MODEL_MODES = ["rmsnorm swiglu no_bias block_i16 c512+64"]  # bf16, SmolLM2-135M's C = 576
STACK_WIDE_SPILL = 64  # spill bytes per thread allowed to the stack at widths above 576 (GPT-2 124M's 768)
STACK_MODES = [  # the whole stack in one launch, each dtype: STACK_MODELS
    "layernorm gelu no_rope bias mha d64 c512 sums", "rmsnorm swiglu rope no_bias no_qkv_bias gqa d128 c512 sums",
    "rmsnorm swiglu rope no_bias qkv_bias gqa d128 c512 sums", "rmsnorm swiglu rope no_bias gqa d64 c576 sums",
    "layernorm gelu no_rope bias mha d64 c768",
    # the option decode_stack_merged_sums, up to MERGED_MAX_C
    "layernorm gelu no_rope bias mha d64 c512 merged_sums",
    "rmsnorm swiglu rope no_bias qkv_bias gqa d128 c512 merged_sums", "rmsnorm swiglu rope no_bias gqa d64 c576 merged_sums",
]


WIDE_PDL_MODES = [  # bf16 at batch 8 with PDL: one-tile launches 64 columns wide (the paired: 32 pairs)
    "_ln_linear_kernel layernorm qkv_cache one_split block_n64",
    "_ln_linear_kernel no_norm residual stats_out one_split block_n64",
    "_ln_linear_kernel rmsnorm qkv_cache rope one_split block_n32",
    "_ln_linear_kernel rmsnorm swiglu one_split block_n32",
]
LLAMA_MODEL_MODES = [  # bf16, LLAMA_MODELS: the paired launches' own PDL tiles at batch 1 (K 576: 3 shares, 896:
    # 4), the GPT-2 PDL tile halved at batch 8 and 16 (one whole-K tile), and without PDL the GPT-2 tile halved
    "pdl rmsnorm no_bias qkv_cache rope block_n32 block_k256 splits3",   # SmolLM2-135M
    "pdl rmsnorm no_bias swiglu block_n32 block_k256 splits3",
    "pdl rmsnorm bias qkv_cache rope block_n32 block_k256 splits4",      # Qwen2-0.5B (qkv_bias)
    "pdl rmsnorm no_bias swiglu block_n32 block_k256 splits4",
    "pdl rmsnorm no_bias qkv_cache rope block_n32 block_k1024 one_split",
    "pdl rmsnorm bias qkv_cache rope block_n32 block_k1024 one_split",
    "pdl rmsnorm no_bias swiglu block_n32 block_k1024 one_split",
    "no_pdl rmsnorm no_bias qkv_cache rope block_n16 block_k256 one_split",
    "no_pdl rmsnorm bias qkv_cache rope block_n16 block_k256 one_split",
    "no_pdl rmsnorm no_bias swiglu block_n16 block_k256 one_split",
    # Qwen3-0.6B's QKV with qk_norm: a tile of one head (64 pairs), its K steps narrowed in proportion
    "pdl rmsnorm no_bias qkv_cache rope qk_norm block_n64 block_k128 splits8",
    "pdl rmsnorm no_bias qkv_cache rope qk_norm block_n64 block_k512 splits2",
    "no_pdl rmsnorm no_bias qkv_cache rope qk_norm block_n64 block_k64 one_split",
]
GEMMA_MODEL_MODES = [  # bf16, GEMMA3_270M at batch 1, 8 and 16, with and without PDL
    "_ln_linear_kernel rmsnorm offset qkv_cache rope qk_norm q_scaled block_n128",   # a tile of one d256 head
    "_ln_linear_kernel rmsnorm offset swiglu geglu",
    "_ln_linear_kernel no_norm no_residual no_stats_out",                            # the projections' outputs
    "_add_rms_norm_kernel offset stats_out block_c1024", "_add_rms_norm_kernel offset no_stats_out block_c1024",
    "_decode_split_kernel gqa d256",
]
OLMO_MODEL_MODES = [  # bf16, OLMO2_1B at batch 1 and 16, with and without PDL
    "_ln_linear_kernel no_norm qkv_cache no_rope no_qk_norm", "_ln_linear_kernel no_norm swiglu",
    "_qk_norm_rope_kernel d128", "_add_rms_norm_kernel fp32_gain no_stats_out block_c2048",
]


def required_modes() -> list[set[str]]:
    out = []
    for dtype in DTYPES:
        ptr = PTR_DTYPES[dtype]
        out += [{"_ln_linear_kernel", ptr, p, *m.split()} for m in LN_LINEAR_MODES for p in ("pdl", "no_pdl")]
        out += [{ptr, *m.split()} for m in OTHER_MODES]
        out += [{"_ln_mlp_kernel", ptr, p, *m.split()} for m in MLP_MODES for p in ("pdl", "no_pdl")]
        out += [{"_decode_stack_kernel", ptr, *m.split()} for m in STACK_MODES]
    out += [{"bf16", "pdl", *m.split()} for m in WIDE_PDL_MODES]
    out += [{"_ln_linear_kernel", "bf16", *m.split()} for m in LLAMA_MODEL_MODES]
    out += [{"_ln_mlp_kernel", "bf16", p, *m.split()} for m in MLP_MODEL_MODES for p in ("pdl", "no_pdl")]
    out += [{"bf16", p, *m.split()} for m in GEMMA_MODEL_MODES for p in ("pdl", "no_pdl")]
    out.append({"_embed_kernel", "bf16", "no_wpe", "scaled"})
    out += [{"bf16", p, *m.split()} for m in OLMO_MODEL_MODES for p in ("pdl", "no_pdl")]
    return out


def test_decode_kernels_compile_for_hopper(tmp_path):
    """Each launch variant of the decode path (GPT-2 and Llama-family modes, split-K, PDL on and off, fp16 and
    bf16, GQA, head dims 64 and 128, split and unsplit attention, merged by the merge kernel or inside the split
    kernel (with its acq_rel counter and L1-bypassing loads in the PTX), dot and broadcast-and-sum tiles) compiles
    to PTX with its entry and to a cubin, the split attention kernel without the merge option with no spills
    (the automatic count's four-stage tile at batch 1 included, in both split orders, with TMA descriptor loads,
    with 64 query rows per program and with a softmax state per warp's part of each key block, whose key loop has
    only the software pipeline's CTA barriers), each split variant's shared memory within the planner's model of
    it (program_smem); the paired launches (SwiGLU, RoPE-QKV), at SmolLM2-135M's and Qwen2-0.5B's
    shapes too, do not spill, but for the whole-K tiles they keep under PDL above PDL_FEW_ROWS rows (measured
    faster there despite their spills), and never with qk_norm (Qwen3-0.6B's shape, Gemma 3 270M's head dim 256);
    the MLP block in one launch (kernels/decode_mlp.py), the sandwich norms' row launch
    (kernels/residual_norm.py) and OLMo's q / k norm launch (kernels/qk_norm_rope.py, OLMo 2 1B's shape) do not
    spill."""
    from kernels.decode import SMEM_MARGIN, WGMMA_MARGIN, WGMMA_ROWS, program_smem
    from tests.util import compiled_records

    records = compiled_records("tests.test_kernels_compile", tmp_path, PARTS)
    tagged = [_tags(rec) for rec in records]
    missing = [" ".join(sorted(m)) for m in required_modes() if not any(m <= t for t in tagged)]
    assert not missing, f"no compiled variant for: {missing}"
    merged = [rec for rec in records if "merge_ptx" in rec]
    assert merged and all(all(rec["merge_ptx"].values()) for rec in merged), [r["merge_ptx"] for r in merged]
    # the split kernel without the merge option (the default path) does not spill; with it, at d128 GQA in the
    # strided order Triton 3.9 spills 4 B (Triton 3.6, the H200's, none)
    attention = [(" ".join(sorted(t)), rec["ptxas"]) for rec, t in zip(records, tagged)
                 if rec["kernel"] == "_decode_split_kernel" and "no_merge" in t]
    assert len(attention) >= 8 and not [a for a in attention if a[1]["spill_stores"] or a[1]["spill_loads"]], \
        attention
    # the split plan's model of a program's shared memory (kernels/decode.program_smem: its pipelined K/V tiles,
    # one more with TMA loads, plus a margin; from 64 rows every stage's tiles and the Q tile, plus a smaller
    # margin) holds every compiled split variant's, tiles included
    smem = [(" ".join(sorted(t)), rec["shared"], program_smem(c["BLOCK_N"], rec["stages"], c["BLOCK_D"],
                                                              {"fp32": 4}.get(rec["dtype"], 2), bool(c.get("TMA")),
                                                              c["BLOCK_M"]),
             WGMMA_MARGIN if c["BLOCK_M"] >= WGMMA_ROWS else SMEM_MARGIN)
            for rec, t in zip(records, tagged) if rec["kernel"] == "_decode_split_kernel" for c in [rec["consts"]]]
    assert any("tma" in tags.split() for tags, *_ in smem) and any("rows64" in tags.split() for tags, *_ in smem)
    # a key loop with a softmax state per warp's part does no cross-warp reduction: its only CTA barriers are the
    # software pipeline's (two), where one state over four warps' keys takes seven (Triton 3.9)
    loops = [(" ".join(sorted(t)), rec["loop_barriers"]) for rec, t in zip(records, tagged)
             if rec["kernel"] == "_decode_split_kernel" and "no_merge" in t and "dot" in t
             and rec["consts"]["BLOCK_M"] == 16]
    parts4 = [(tags, n) for tags, n in loops if "parts4" in tags.split()]
    assert parts4 and all(n and max(n) <= 2 for _, n in parts4), parts4
    assert all(n and max(n) > 2 for tags, n in loops if "parts1" in tags.split()), loops
    assert not [m for m in smem if not m[2] - m[3] <= m[1] <= m[2]], smem
    paired = [(" ".join(sorted(t)), rec["ptxas"]) for rec, t in zip(records, tagged)
              if "ptxas" in rec and rec["kernel"] == "_ln_linear_kernel"]
    assert len(paired) >= len(LLAMA_MODEL_MODES)
    spills = [(tags, usage) for tags, usage in paired if usage["spill_stores"] or usage["spill_loads"]]
    spilled = [(tags, usage) for tags, usage in spills
               if not {"pdl", "one_split"} <= set(tags.split()) or "qk_norm" in tags.split()]
    assert not spilled, f"paired launches that spill at sm_90: {spilled}"
    rows = [(" ".join(sorted(t)), rec["ptxas"]) for rec, t in zip(records, tagged)
            if rec["kernel"] in ("_add_rms_norm_kernel", "_qk_norm_rope_kernel")]
    assert rows and not [r for r in rows if r[1]["spill_stores"] or r[1]["spill_loads"]], rows
    mlp = [(" ".join(sorted(t)), rec["ptxas"]) for rec, t in zip(records, tagged) if rec["kernel"] == "_ln_mlp_kernel"]
    assert len(mlp) >= len(MLP_MODES) + len(MLP_MODEL_MODES)
    assert not [m for m in mlp if m[1]["spill_stores"] or m[1]["spill_loads"]], f"MLP launches that spill: {mlp}"
    # the stack: its barrier's memory orders in the PTX; no spills up to SmolLM2's width, and at most
    # STACK_WIDE_SPILL bytes at GPT-2 124M's (Triton 3.6 at sm_90 spills 40 B there, 3.9 48 B; timed on an H200
    # with those 40 B: bench/results/generate_smollm2/stack/one_poller/)
    stack = [(" ".join(sorted(t)), rec) for rec, t in zip(records, tagged) if rec["kernel"] == "_decode_stack_kernel"]
    assert len(stack) >= len(STACK_MODES) * len(DTYPES)
    assert all(all(rec["barrier_ptx"].values()) for _, rec in stack), [rec["barrier_ptx"] for _, rec in stack]
    spilling = [(tags, rec["ptxas"]) for tags, rec in stack
                if max(rec["ptxas"]["spill_stores"], rec["ptxas"]["spill_loads"])
                > (0 if rec["consts"]["C"] <= 576 else STACK_WIDE_SPILL)]
    assert not spilling, f"stack launches that spill: {spilling}"


if __name__ == "__main__":
    from tests.util import compile_child
    compile_child("tests.test_kernels_compile", PARTS, compile_decode_launches)
