"""kernels/decode_stack.py: every layer of a one-sequence decode step in one launch, against float64 references.

The criterion is the fused decode tests' (tests/error_budget.py): logits and the caches written are within 2x the
error of the model's own step in the same dtype, plus a floor, of the float64 model's. On CUDA the step runs as
one persistent launch with grid barriers (bf16 included); on a CPU, in Triton's interpreter, each phase is its own
launch (the programs run one after another there, so no barrier could be passed): the same phase code. The plan's
buffers and the caches beyond each sequence's length start as NaN, so a missed write or a read of something not
yet written shows up. Each step test runs with the kernel option decode_stack_merged_sums on (the default) and off
(the norms' sums, the QKV lane halves, gate and up, and the down projection reduced over one block).
"""
import copy
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported (triton decorates then)

import pytest  # noqa: E402

import model.fused_decode as fd  # noqa: E402
from kernels import options  # noqa: E402
from kernels.decode_stack import StackPlan, decode_stack, fits, mlp_weights_after  # noqa: E402
from model.fused_decode import fused_decode_step, stack_plan  # noqa: E402
from model.generation import decode_one_token, prefill  # noqa: E402
from tests.test_fused_decode import DEVICE, check_step, oracle_step, tiny_gpt  # noqa: E402
from tests.test_fused_decode_llama import tiny_llama  # noqa: E402

FAMILIES = ["gpt2-mha", "gpt2-gqa-nobias", "llama", "qwen2", "smollm2", "llama-bias"]


def family_model(name: str, dtype, block_size: int = 48):
    if name == "gpt2-mha":
        return tiny_gpt(True, 0, dtype)
    if name == "gpt2-gqa-nobias":
        return tiny_gpt(False, 2, dtype)
    return tiny_llama(name, dtype, block_size=block_size)


class Calls:
    """Counts decode_stack calls (fused_decode_step's name for it) while passing them on."""

    def __init__(self, monkeypatch):
        self.n = 0
        monkeypatch.setattr(fd, "decode_stack", self)

    def __call__(self, *args, **kwargs):
        self.n += 1
        return decode_stack(*args, **kwargs)


def poison(plan: StackPlan) -> None:
    """Every buffer a step writes before it reads it: NaN (the barrier counters stay zero)."""
    for t in (plan.ws, plan.xm, plan.xa, plan.qbuf, plan.part):
        t.fill_(float("nan"))


def decode_one_sequence(model, length: int, max_len: int, steps: int, seed: int = 5) -> None:
    """Prefill one prompt, then decode `steps` steps three ways fed the same tokens: the stack (on a twin whose
    caches and plan buffers start as NaN), the model's own step in its dtype, the same weights in float64."""
    twin = copy.deepcopy(model)
    exact = copy.deepcopy(model).double()
    idx = torch.randint(0, 61, (1, length), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    lens = torch.tensor([length], device=DEVICE)
    for m in (model, twin, exact):
        m.setup_kv_cache(1, max_len)
    for block in twin.transformer.h:
        block.attn.kv_cache.k.fill_(float("nan"))
        block.attn.kv_cache.v.fill_(float("nan"))
    for m in (model, twin, exact):
        prefill(m, idx, lens)
    plan = stack_plan(twin)
    assert plan is not None
    poison(plan)
    pos = lens[:, None].clone()
    tok = torch.randint(0, 61, (1, 1), generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE)
    for step in range(steps):
        want = decode_one_token(model, tok, pos)
        got = fused_decode_step(twin, tok, pos)
        check_step(got, want, oracle_step(exact, tok, pos), twin, model, exact, pos, f"step {step}")
        tok = want.argmax(-1, keepdim=True)
        pos = pos + 1


CASES = [(f, torch.float32) for f in FAMILIES] + [("gpt2-mha", torch.float16), ("smollm2", torch.float16)]
if DEVICE.type == "cuda":
    CASES += [(f, torch.bfloat16) for f in FAMILIES] + [(f, torch.float16) for f in FAMILIES[1:] if f != "smollm2"]


MERGED = pytest.mark.parametrize("merged", [False, True], ids=["sums", "merged_sums"])


@MERGED
@pytest.mark.parametrize("name,dtype", CASES, ids=lambda v: str(v).replace("torch.", ""))
@torch.no_grad()
def test_stack_step_equals_the_models_step(name, dtype, merged, monkeypatch):
    """LayerNorm + GELU + biases + learned positions, MHA and GQA; RMSNorm + SwiGLU + RoPE (llama3 scaling),
    qkv_bias with head_size != C / H and MQA (qwen2), 3 query heads per kv head (smollm2), biases everywhere:
    three steps from position 9, through the stack (asserted)."""
    calls = Calls(monkeypatch)
    with options.use(decode_stack_merged_sums=merged):
        decode_one_sequence(family_model(name, dtype), 9, max_len=24, steps=3)
    assert calls.n == 3


@MERGED
@pytest.mark.parametrize("programs", [24, 12])
@torch.no_grad()
def test_long_cache_more_key_tiles_than_splits(programs, merged, monkeypatch):
    """400 cached positions: 13 key tiles of 32 over at most 12 shares per kv group (one share reads two strided
    tiles). With 12 programs the other phases take wider tiles too (8 lane pairs, 8 columns, 16 columns)."""
    monkeypatch.setattr(fd, "INTERPRETER_PROGRAMS", programs)
    calls = Calls(monkeypatch)
    model = family_model("smollm2", torch.float32, block_size=448)
    with options.use(decode_stack_merged_sums=merged):
        decode_one_sequence(model, 400, max_len=416, steps=2)
    assert calls.n == 2
    if programs == 12 and DEVICE.type == "cpu":
        assert stack_plan(model).blocks == {"PA": 8, "OC": 8, "IB": 16}


FULL_WIDTHS = {  # the benchmark models' widths (two layers each): their tiles are the ones the GPU runs
    "gpt2-124m": dict(n_head=12, n_embd=768),
    "smollm2-135m": dict(n_head=9, n_kv_head=3, n_embd=576, intermediate_size=1536, pos_emb="rope", norm="rmsnorm",
                         mlp="swiglu", bias=False),
}


@pytest.mark.skipif(DEVICE.type != "cuda", reason="full-width models are for the GPU")
@MERGED
@pytest.mark.parametrize("mlp_after", ["A", "B", "C"], ids=lambda p: f"mlp_weights_after_{p}")
@pytest.mark.parametrize("name", list(FULL_WIDTHS))
@torch.no_grad()
def test_full_width_models_through_the_stack(name, mlp_after, merged, monkeypatch):
    """GPT-2 124M's widths (16 lane pairs, 8 output and 32 h columns a program) and SmolLM2-135M's (4, 8, 16) in
    bf16: steps through the stack (served by default at both widths) against the float64 model, as the small
    families; merged sums take effect up to MERGED_MAX_C (SmolLM2's width). Phase D's weights loaded after each
    phase they can load after (mlp_weights_after: the registers they hold live through different phases)."""
    from model import GPT, GPTConfig
    calls = Calls(monkeypatch)
    torch.manual_seed(11)
    model = GPT(GPTConfig(block_size=96, vocab_size=61, n_layer=2, attention="naive", **FULL_WIDTHS[name]))
    with options.use(decode_stack_merged_sums=merged), mlp_weights_after(mlp_after):
        decode_one_sequence(model.to(DEVICE, torch.bfloat16).eval(), 40, max_len=96, steps=2)
    assert calls.n == 2


@torch.no_grad()
def test_option_off_and_batches_keep_the_per_layer_launches(monkeypatch):
    calls = Calls(monkeypatch)
    model = family_model("llama", torch.float32)
    model.setup_kv_cache(2, 16)
    with options.use(decode_stack=False):
        fused_decode_step(model, torch.tensor([[1]], device=DEVICE), torch.tensor([[0]], device=DEVICE))
    fused_decode_step(model, torch.tensor([[1], [2]], device=DEVICE), torch.tensor([[0], [3]], device=DEVICE))
    assert calls.n == 0
    fused_decode_step(model, torch.tensor([[1]], device=DEVICE), torch.tensor([[0]], device=DEVICE))
    assert calls.n == 1


@torch.no_grad()
def test_plan_is_kept_and_rebuilt_for_other_tensors():
    model = family_model("smollm2", torch.float32)
    model.setup_kv_cache(1, 16)
    plan = stack_plan(model)
    assert plan is not None and stack_plan(model) is plan
    model.setup_kv_cache(1, 32)                                  # new caches: new addresses
    again = stack_plan(model)
    assert again is not plan and again.max_len == 32
    other = family_model("smollm2", torch.float32)               # another model: its own plan
    other.setup_kv_cache(1, 32)
    assert stack_plan(other) is not again
    key = id(other)
    del other                                                    # the plan (holding its tensors) goes with it
    import gc
    gc.collect()
    assert key not in fd._stack_plans and id(model) in fd._stack_plans


@torch.no_grad()
def test_wider_models_keep_the_per_layer_launches():
    """Above STACK_MAX_C the plan is None."""
    from model import GPT, GPTConfig
    wide = GPT(GPTConfig(block_size=16, vocab_size=61, n_layer=1, n_head=2, n_embd=fd.STACK_MAX_C + 64,
                         attention="naive")).to(DEVICE).eval()
    wide.setup_kv_cache(1, 16)
    assert stack_plan(wide) is None
    narrow = family_model("gpt2-mha", torch.float32)
    narrow.setup_kv_cache(1, 16)
    assert stack_plan(narrow) is not None


def test_fits_names_what_does_not_fit():
    assert fits(576, 1536, 64, 9, 3, torch.bfloat16, 132) is None    # SmolLM2-135M
    assert fits(768, 3072, 64, 12, 12, torch.bfloat16, 132) is None  # GPT-2 124M
    assert "width" in fits(896, 4864, 64, 14, 2, torch.bfloat16, 132)  # Qwen2-0.5B
    assert "head dim" in fits(576, 1536, 48, 12, 3, torch.bfloat16, 132)
    assert "multiple" in fits(576, 1536, 64, 9, 2, torch.bfloat16, 132)
    assert "heads" in fits(768, 3072, 64, 12, 12, torch.bfloat16, 8)
    assert "dtype" in fits(576, 1536, 64, 9, 3, torch.float64, 132)


@torch.no_grad()
def test_bad_input_one_line_each():
    model = family_model("smollm2", torch.float32)
    model.setup_kv_cache(1, 16)
    plan = stack_plan(model)
    C = model.config.n_embd
    x = torch.zeros(1, C, device=DEVICE)
    pos = torch.tensor([3], device=DEVICE)
    rope = fd.rope_tables(model, 16, torch.float32)
    for call, match in [
        (lambda: decode_stack(plan, torch.zeros(2, C, device=DEVICE), pos, rope), "x must be"),
        (lambda: decode_stack(plan, x.half(), pos, rope), "x must be"),
        (lambda: decode_stack(plan, x, torch.tensor([3.0], device=DEVICE), rope), "pos must be"),
        (lambda: decode_stack(plan, x, pos, None), "rope tables"),
        (lambda: decode_stack(plan, x, pos, (rope[0][:, :4], rope[1][:, :4])), "rope must be"),
        (lambda: decode_stack(plan, x, pos, rope, final_norm=(torch.ones(C + 1, device=DEVICE), None, 1e-5)),
         "final_norm must be"),
        (lambda: decode_stack(plan, x, pos, rope, final_norm=(torch.ones(C, device=DEVICE),
                                                               torch.zeros(C, device=DEVICE), 1e-5)),
         "final_norm must be"),  # RMSNorm: no bias
        (lambda: mlp_weights_after("D").__enter__(), "phase must be one of A, B, C"),
    ]:
        with pytest.raises(ValueError, match=match) as err:
            call()
        assert "\n" not in str(err.value)
    layers = fd._stack_layers(model)
    kw = dict(n_head=6, n_kv_head=2, head_dim=16, rms=True, swiglu=True, rope=True, programs=24)
    bad = [dict(layers[0]), dict(layers[1], w_fc=layers[1]["w_fc"][:-2])]
    with pytest.raises(ValueError, match="layer 1 w_fc"):
        StackPlan(bad, **kw)
    flat = torch.zeros(layers[0]["w_o"].numel() + 1, device=DEVICE)
    shifted = flat[1:].view_as(layers[0]["w_o"])                 # 4 bytes off a 16-byte boundary
    with pytest.raises(ValueError, match="16-byte aligned"):
        StackPlan([dict(layers[0], w_o=shifted)], **kw)
    with pytest.raises(ValueError, match="caches"):
        StackPlan([dict(layers[0], k_cache=layers[0]["k_cache"][:, :1])], **kw)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the persistent launch needs a GPU")
@MERGED
@torch.no_grad()
def test_one_launch_equals_phase_by_phase_on_the_gpu(merged):
    """The grid barriers against kernel boundaries: the same phases, so the same output up to the order of the
    down projection's atomic adds; and the barrier counters are back at zero after each launch."""
    model = family_model("smollm2", torch.bfloat16)
    model.setup_kv_cache(1, 48)
    plan = stack_plan(model)
    x = torch.randn(1, model.config.n_embd, device=DEVICE).to(torch.bfloat16)
    rope = fd.rope_tables(model, 48, torch.bfloat16)
    outs = []
    for by_phase in (False, True, False):
        with options.use(decode_stack_merged_sums=merged):
            outs.append(decode_stack(plan, x, torch.tensor([7], device=DEVICE), rope, phase_by_phase=by_phase))
        assert plan.bar.tolist() == [0, 0]
    torch.testing.assert_close(outs[1].float(), outs[0].float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(outs[2].float(), outs[0].float(), rtol=2e-2, atol=2e-2)


TRAPPED = """
import torch
import model.fused_decode as fd
from kernels.decode_stack import StackPlan, decode_stack
from tests.test_decode_stack import family_model
m = family_model("smollm2", torch.bfloat16)
m.setup_kv_cache(1, 16)
attn = m.transformer.h[0].attn
sms = torch.cuda.get_device_properties(0).multi_processor_count
plan = StackPlan(fd._stack_layers(m), n_head=attn.n_head, n_kv_head=attn.n_kv_head, head_dim=attn.head_dim,
                 rms=True, swiglu=True, rope=True, programs=64 * sms)   # more programs than can be resident
decode_stack(plan, torch.zeros(1, m.config.n_embd, device="cuda", dtype=torch.bfloat16),
             torch.tensor([3], device="cuda"), fd.rope_tables(m, 16, torch.bfloat16))
torch.cuda.synchronize()
print("returned")
"""


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the persistent launch needs a GPU")
def test_a_grid_that_cannot_be_resident_fails_instead_of_hanging():
    """Programs that never become resident leave the others waiting at the first barrier: after MAX_POLLS polls
    the kernel traps, and the host sees a CUDA error (in a child process: the trap ends its CUDA context)."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", TRAPPED], cwd=root, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert proc.returncode != 0 and "returned" not in proc.stdout, proc.stdout[-2000:]
    assert "CUDA" in proc.stderr or "cuda" in proc.stderr, proc.stderr[-2000:]
