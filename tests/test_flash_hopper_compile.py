"""The Gluon Hopper forward (kernels/flash_hopper) compiles for sm_90 with the Triton installed, and the host side
takes exactly the inputs it documents; checked on any machine.

Gluon kernels do not run in Triton's interpreter, so the kernel is compiled ahead of time through Triton's GPU
compiler to PTX and a cubin, in a child process (TRITON_INTERPRET=0, an empty Triton cache) that stands in for an
sm_90 device with 132 SMs and takes CPU tensors (device checks off; nothing is launched, tests/gpu_compile.py).
The launches come from kernels.flash_attention with the hopper_forward option on — the hook in
kernels/flash/launch.py, the packed form and the model's (B, N, H, D) strides included — so what compiles is
what a GPU would launch. The child prints a JSON list with a record per compiled variant.

Skipped, with the reason, where the installed Triton lacks the Gluon names the kernel uses.
"""
from __future__ import annotations

import re

import pytest
import torch
import triton

import kernels._triton as kt
from kernels import flash_hopper, options
from kernels.flash_hopper import launch as hopper_launch
from tests.util import CompiledStandIn, recording_jit

H200_SMS = 132
SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KB)
needs_gluon = pytest.mark.skipif(not flash_hopper.AVAILABLE, reason=f"{flash_hopper.UNAVAILABLE_REASON}")


# --------------------------------------------------------------------- the child: compile what the hook launches

def _record(c) -> dict:
    from tests.gpu_compile import ptxas_usage
    names = c.src.fn.arg_names
    consts = {names[path[0]]: v for path, v in c.src.constants.items() if isinstance(v, (bool, int, str))}
    ptx = c.asm["ptx"]
    desc = str(c.src.signature["q_desc"])  # e.g. "tensordesc<bf16[1, 1, 64, 64],...>"
    return dict(consts=consts, dtype=desc[desc.index("<") + 1:desc.index("[")], shared=c.metadata.shared,
                num_warps=c.metadata.num_warps, cubin_bytes=len(c.asm.get("cubin") or b""),
                ptx_entry=f".entry {c.name}(" in ptx,
                wgmma="wgmma.mma_async" in ptx, tma_load="cp.async.bulk.tensor.4d.shared" in ptx,
                tma_store="cp.async.bulk.tensor.4d.global.shared" in ptx, mbarrier="mbarrier.try_wait" in ptx,
                regs_to_consumers=re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+%d;"
                                            % (240 if consts.get("CONSUMERS") == 2 else 160), ptx) is not None,
                regs_from_producer=re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx) is not None,
                **ptxas_usage(c))


# the child processes' shares of the variants (tests/util.py: compiled_records): each dtype's consumer counts
# (and the packed call), and the row-sum forms
PARTS = ("bfloat16", "float16", "lane_sums")


def compile_hopper_launches(part: str | None = None) -> list[dict]:
    """Run in a process started with TRITON_INTERPRET=0: every variant the hook launches, compiled for sm_90;
    with a part of PARTS, its share."""
    import kernels
    from kernels.flash_hopper import forward
    from tests.gpu_compile import compiling_instead_of_launching

    kt.check_device = lambda device, what: None  # CPU tensors stand in for the GPU's; nothing is launched
    kt.sm_count = lambda device: H200_SMS
    hopper_launch._is_sm90 = lambda device: True
    with compiling_instead_of_launching(forward._attn_fwd_hopper) as compiled, torch.no_grad(), \
            options.use(hopper_forward="on", fast_launch=False):
        for dtype in (torch.bfloat16, torch.float16):
            for D in (64, 128):
                for causal in (True, False):
                    q = torch.randn(2, 4, 113, D).to(dtype)                     # (B, Hq, Nq, D)
                    kv = torch.randn(2, 2, 203, D).to(dtype)                    # (B, Hkv, Nk, D): GQA, Nk != Nq
                    if part in (None, str(dtype).removeprefix("torch.")):
                        for count in ((2, 3) if D == 64 else (0,)):  # head dim 64: both consumer counts
                            with options.use(hopper_consumers_d64=count):
                                kernels.flash_attention(q, kv, kv, causal=causal)
                    if dtype == torch.bfloat16 and part in (None, "lane_sums"):  # both row-sum forms, two consumers
                        for mode in ("on", "off"):
                            with options.use(hopper_consumers_d64=2, hopper_lane_sums=mode):
                                kernels.flash_attention(q, kv, kv, causal=causal)
                        if D == 64 and causal:  # three consumers with lane sums: the long causal calls' default
                            with options.use(hopper_consumers_d64=3, hopper_lane_sums="on"):
                                kernels.flash_attention(q, kv, kv, causal=causal)
        if part in (None, "bfloat16"):
            qkv = torch.randn(2, 77, (4 + 2 * 2) * 64).to(torch.bfloat16)       # (B, N, (Hq + 2·Hkv)·D)
            kernels.flash_attention_qkvpacked(qkv, 4, 2)                        # (B, N, H, D) strides
    return [_record(c) for c in compiled]


# --------------------------------------------------------------------- the tests

@needs_gluon
def test_hopper_forward_compiles_for_sm90(tmp_path):
    """Each variant (bf16 and fp16, head dims 64 and 128, causal or not) compiles to a cubin with wgmma, 4-d TMA
    loads and stores, mbarrier waits and the producer-to-consumer register reallocation; 12 warps with two
    consumer warpgroups (240 registers each) and no spills, 16 with three (head dim 64, 160 each; at most 128
    bytes of spills per thread under the Triton whose three consumers were measured faster, elsewhere not
    chosen by default); shared memory within sm_90's limit; ptxas does not serialise its wgmmas. The row sums
    as per-thread partial sums or whole (hopper_lane_sums on, off; auto: on at head dim 128) compile with two
    consumers at both head dims, bf16, likewise, and with three at head dim 64, causal (the default from
    D64_CAUSAL_THREE_FROM_KEYS keys)."""
    from tests.util import compiled_records

    records = compiled_records("tests.test_flash_hopper_compile", tmp_path, PARTS)
    for rec in records:
        assert rec["cubin_bytes"] > 0 and rec["wgmma"] and rec["tma_load"] and rec["tma_store"], rec
        assert rec["mbarrier"] and rec["regs_to_consumers"] and rec["regs_from_producer"], rec
        three = rec["consts"]["CONSUMERS"] == 3
        assert rec["num_warps"] == (16 if three else 12) and 0 < rec["shared"] <= SMEM_LIMIT, rec
        if not three or triton.__version__.startswith(hopper_launch.THREE_CONSUMERS_TRITON):
            assert rec["spill_stores"] <= (128 if three else 0), rec
        assert not rec["wgmma_serialized"], rec  # ptxas serialising the wgmmas undoes the overlap the kernel is for
    got = {(rec["dtype"], rec["consts"]["HEAD_D"], rec["consts"]["CAUSAL"], rec["consts"]["CONSUMERS"],
            rec["consts"]["LANE_SUMS"]) for rec in records}
    assert got == {(dt, D, causal, n, D == 128) for dt in ("bf16", "fp16") for D in (64, 128)
                   for causal in (True, False) for n in ((2, 3) if D == 64 else (2,))} | {
        ("bf16", D, causal, 2, lane) for D in (64, 128) for causal in (True, False) for lane in (True, False)} | {
        ("bf16", 64, True, 3, True)}


def _inputs(D=64, dtype=torch.bfloat16, Hq=4, Hkv=2):
    q = torch.randn(2, Hq, 17, D).to(dtype)
    kv = torch.randn(2, Hkv, 33, D).to(dtype)
    return q, kv, kv


@pytest.mark.parametrize("change,reason", [
    (dict(dtype=torch.float32), "dtype torch.float32"),
    (dict(D=96), "head dim 96"),
    (dict(D=256), "head dim 256"),
])
def test_unsupported_inputs_name_the_reason(change, reason, monkeypatch):
    """On an sm_90 device (stood in for) the kernel takes bf16/fp16, head dims 64 and 128 and TMA-aligned
    strides; anything else goes to the tl kernel, with the reason."""
    monkeypatch.setattr(hopper_launch, "_is_sm90", lambda device: True)
    monkeypatch.setattr(kt, "INTERPRET", False)
    if not flash_hopper.AVAILABLE:
        assert hopper_launch.unsupported(*_inputs()) == flash_hopper.UNAVAILABLE_REASON
        return
    assert hopper_launch.unsupported(*_inputs()) is None
    assert hopper_launch.unsupported(*_inputs(Hq=4, Hkv=1)) is None  # MQA
    assert reason in hopper_launch.unsupported(*_inputs(**change))


def test_unsupported_layouts_masks_and_devices(monkeypatch):
    monkeypatch.setattr(hopper_launch, "_is_sm90", lambda device: True)
    monkeypatch.setattr(kt, "INTERPRET", False)
    if not flash_hopper.AVAILABLE:
        pytest.skip(flash_hopper.UNAVAILABLE_REASON)
    q, k, v = _inputs()
    assert "window" in hopper_launch.unsupported(q, k, v, window=8)
    assert "documents" in hopper_launch.unsupported(q, k, v, docs=torch.zeros(2, 2, 17, dtype=torch.int32))
    # the model's layout: q, k, v as (B, N, H, D) memory seen as (B, H, N, D), taken as is
    qkv = torch.randn(2, 17, 8 * 64).to(torch.bfloat16)  # (B, N, (Hq + 2·Hkv)·D), Hq = 4, Hkv = 2
    views = [t.transpose(1, 2) for t in qkv.view(2, 17, 8, 64).split([4, 2, 2], dim=2)]  # (B, H, N, D)
    assert hopper_launch.unsupported(*views) is None
    # a row stride of 68 elements (136 bytes) or a start 2 bytes off: not TMA-aligned
    assert "16-byte" in hopper_launch.unsupported(q, k, torch.randn(2, 2, 33, 64 + 4).bfloat16()[..., :64])
    assert "16-byte" in hopper_launch.unsupported(q, k, torch.randn(2 * 2 * 33 * 64 + 1).bfloat16()[1:].view(
        2, 2, 33, 64))
    assert "empty" in hopper_launch.unsupported(q[:, :, :0], k, v)
    monkeypatch.setattr(hopper_launch, "_is_sm90", lambda device: False)
    assert "compute capability 9.0" in hopper_launch.unsupported(q, k, v)


def test_the_switch_falls_back_to_the_tl_kernel_where_the_gluon_kernel_cannot_run(monkeypatch):
    """With hopper_forward on, inputs the Gluon kernel does not take (here: head dim 16; on a CPU also the
    interpreter's tensors) run the tl forward, with the same result as with the switch off."""
    import kernels
    from kernels.flash import launch

    launched = []
    real = launch._launch
    monkeypatch.setattr(launch, "_launch", lambda name, *a: launched.append(name) or real(name, *a))
    monkeypatch.setattr(launch, "_plan_key", lambda *args: None)  # no replays: every launch goes through _launch
    q, k, v = (torch.randn(1, 2, 9, 16, device="cuda" if torch.cuda.is_available() else "cpu") for _ in range(3))
    assert hopper_launch.unsupported(q, k, v) is not None  # head dim 16 (and, on a CPU, the device)
    with options.use(hopper_forward="on"):
        on = kernels.flash_attention(q, k, v)
    off = kernels.flash_attention(q, k, v)
    assert launched == ["fwd", "fwd"]
    assert torch.equal(on, off)


if __name__ == "__main__":
    from tests.util import compile_child
    compile_child("tests.test_flash_hopper_compile", PARTS, compile_hopper_launches)


@pytest.mark.parametrize("mode, D, causal, Nq, Nk, heads, takes", [
    ("auto", 128, True, 1024, 1024, 256, True),     # 16 x 16 heads of 1024: the measured rows
    ("auto", 128, False, 2048, 2048, 128, True),
    ("auto", 128, True, 1024, 1024, 255, False),    # fewer rows than measured below 4096 tokens
    ("auto", 128, True, 4096, 4096, 1, True),       # from 4096 tokens any batch and head count
    ("auto", 128, False, 16384, 16384, 16, True),
    ("auto", 128, True, 1023, 4096, 256, False),    # fewer queries than the measured lengths
    ("auto", 128, True, 4096, 1023, 256, False),    # fewer keys
    ("auto", 64, True, 2048, 2048, 256, False),     # head dim 64, causal, below 4096: the tl forward as fast
    ("auto", 64, True, 4096, 4096, 1, True),        # from 4096: level or faster
    ("auto", 64, False, 4096, 4096, 1, True),       # not causal: three consumer warpgroups, faster
    ("auto", 64, False, 2048, 2048, 128, True),
    ("auto", 64, False, 2048, 2048, 127, False),    # fewer rows than measured below 4096 tokens
    ("auto", 64, False, 1024, 1024, 1024, False),   # shorter than measured
    ("on", 64, True, 113, 113, 1, True),
    ("off", 128, False, 4096, 4096, 256, False),
])
def test_auto_sends_only_the_measured_shapes_to_the_gluon_kernel(mode, D, causal, Nq, Nk, heads, takes,
                                                                 monkeypatch):
    """The dispatch rule alone (the Gluon kernel's own checks stubbed to say yes): auto takes head dim 128 with
    at least 1024 queries and keys, head dim 64 without a causal mask with at least 2048 (with one from 4096),
    and below 4096 tokens
    at least 16 x 16 x 1024 query rows in all (B · Hq · Nq); on takes whatever the kernel takes, off nothing;
    and whatever the mode, an input the kernel refuses stays with the tl kernel."""
    from kernels.flash import launch
    q = torch.empty(1, heads, Nq, D)
    k = v = torch.empty(1, heads, Nk, D)
    asked = []
    monkeypatch.setattr(launch._hopper, "unsupported", lambda *a: asked.append(1) and None)
    assert launch._hopper_takes(mode, q, k, v, 0, None, causal) is takes
    if mode == "auto" and not takes:
        assert asked == []  # the shape test answers first: no per-call cost for the shapes auto leaves alone
    monkeypatch.setattr(launch._hopper, "unsupported", lambda *a: "refused")
    assert launch._hopper_takes(mode, q, k, v, 0, None, causal) is False


@pytest.mark.parametrize("mode, D, Nq, Nk, extra, takes", [
    ("auto", 128, 4096, 4096, {}, True),
    ("auto", 128, 16384, 16384, {}, True),
    ("auto", 128, 4096, 4096, {"causal": True}, True),  # rows through TMA: faster causal too
    ("auto", 128, 4097, 4097, {"causal": True}, False),  # rows loaded: causal level with the tl backward
    ("on", 128, 4097, 4097, {"causal": True}, True),
    ("auto", 128, 2048, 2048, {}, True),
    ("auto", 128, 2044, 4096, {}, False),     # shorter than measured
    ("auto", 128, 4095, 4096, {}, False),     # rows loaded: from 4096
    ("auto", 128, 4096, 1024, {}, False),
    ("auto", 64, 4096, 4096, {}, True),
    ("auto", 64, 4096, 4096, {"causal": True}, True),  # head dim 64 causal: form 4 from 4096
    ("auto", 64, 2048, 2048, {"causal": True}, False),
    ("on", 64, 113, 113, {}, True),
    ("on", 128, 4096, 4096, {"window": 256}, False),  # masks and RoPE tables are the tl kernels'
    ("on", 128, 4096, 4096, {"docs": torch.zeros(2, dtype=torch.int32)}, False),
    ("on", 128, 4096, 4096, {"rope": (None, None)}, False),
    ("off", 128, 4096, 4096, {}, False),
])
def test_backward_dispatch_rule(mode, D, Nq, Nk, extra, takes, monkeypatch):
    """The backward's rule alone (the Gluon kernel's own checks stubbed to say yes): auto takes the shapes of
    launch.HOPPER_BWD_AUTO_MIN_LEN (head dim 128 from 2048 queries and keys, causal or not, where the rows go
    through TMA; not causal from 4096 otherwise; head dim 64 from 4096, causal or not), on whatever the kernel takes,
    off nothing; windows,
    documents and RoPE tables stay with the tl kernels, and so does any input the kernel refuses."""
    from kernels.flash import launch
    q = torch.empty(1, 2, Nq, D)
    k = v = torch.empty(1, 2, Nk, D)
    bwd = launch._hopper_bwd_launch
    monkeypatch.setattr(bwd, "unsupported_backward", lambda *a: None)
    args = dict(causal=False, window=0, docs=None, rope=None, out=None) | extra
    assert launch._hopper_bwd_takes(mode, q, q, k, v, q, **args) is takes
    monkeypatch.setattr(bwd, "unsupported_backward", lambda *a: "refused")
    assert launch._hopper_bwd_takes(mode, q, q, k, v, q, **args) is False


def test_hopper_backward_option_values():
    assert options.KernelOptions().hopper_backward == "auto"
    assert options.from_env({"FLASHGPT_HOPPER_BWD": "off"}).hopper_backward == "off"
    with pytest.raises(ValueError, match="FLASHGPT_HOPPER_BWD='1': expected one of auto, on, off"):
        options.from_env({"FLASHGPT_HOPPER_BWD": "1"})


def test_hopper_forward_option_values():
    assert options.KernelOptions().hopper_forward == "auto"
    assert options.from_env({"FLASHGPT_HOPPER_FWD": "off"}).hopper_forward == "off"
    with pytest.raises(ValueError, match="FLASHGPT_HOPPER_FWD='1': expected one of auto, on, off"):
        options.from_env({"FLASHGPT_HOPPER_FWD": "1"})


def test_repeated_launches_call_the_compiled_kernel_directly(monkeypatch):
    """The first launch of a signature goes through the JIT (which compiles and returns the kernel); a repeat
    calls the compiled kernel's launcher with the arguments then the constexprs; another dtype, mask or pointer
    alignment is a new signature; with fast_launch off every launch goes through the JIT."""
    from kernels.flash_hopper import forward

    names = list(forward._attn_fwd_hopper.arg_names)
    jit_calls, direct = [], []
    monkeypatch.setattr(hopper_launch._forward, "_attn_fwd_hopper", recording_jit(names, jit_calls))
    monkeypatch.setattr(hopper_launch, "_compiled", {})
    monkeypatch.setattr(kt, "INTERPRET", False)
    monkeypatch.setattr(kt, "launch_compiled", lambda kernel, grid, vals: direct.append((kernel, grid, vals)))

    def launch(dtype=torch.bfloat16, causal=True, lists=True, lse_offset=0):
        q = torch.zeros(1, 1, 8, 64, dtype=dtype)
        lse = torch.zeros(64)[lse_offset:lse_offset + 8]
        lists_t = torch.zeros(8, dtype=torch.int32) if lists else lse
        args = ("qd", "kd", "vd", "od", lse, 1, 1, 8, 8, 0, 0.1, 1, 1, 1, lists_t, lists_t)
        consts = dict(BLOCK_M=64, BLOCK_N=128, HEAD_D=64, STAGES=3, CAUSAL=causal, LISTS=lists, EARLY_Q=True,
                      CONSUMERS=2, OWN_BLOCKS=True, LANE_SUMS=False)
        hopper_launch._launch((5,), args, consts, q, options.get().fast_launch)
        return args, consts

    launch()
    assert len(jit_calls) == 1 and not direct
    args, consts = launch()
    assert len(jit_calls) == 1 and len(direct) == 1
    kernel, grid, vals = direct[0]
    assert isinstance(kernel, CompiledStandIn) and grid == (5,) and vals == (*args, *consts.values())
    assert len(vals) == len(names)
    for change in (dict(dtype=torch.float16), dict(causal=False, lists=False), dict(lse_offset=1)):
        launch(**change)
        launch(**change)
    assert len(jit_calls) == 4 and len(direct) == 4
    with options.use(fast_launch=False):
        launch()
    assert len(jit_calls) == 5 and len(direct) == 4


def test_consumer_count_by_head_dim_mask_option_and_triton(monkeypatch):
    """Three consumers only at head dim 64: by default without a causal mask and under the Triton they were
    measured faster with; the option forces a count; head dim 128 always two."""
    monkeypatch.setattr(hopper_launch.triton, "__version__", "3.6.0")
    assert hopper_launch.consumer_count(64, False) == 3 and hopper_launch.consumer_count(64, True) == 2
    assert hopper_launch.consumer_count(128, False) == 2
    monkeypatch.setattr(hopper_launch.triton, "__version__", "3.9.0")
    assert hopper_launch.consumer_count(64, False) == 2
    for count in (2, 3):
        with options.use(hopper_consumers_d64=count):
            assert hopper_launch.consumer_count(64, True) == count == hopper_launch.consumer_count(64, False)
            assert hopper_launch.consumer_count(128, False) == 2
    with pytest.raises(ValueError, match="hopper_consumers_d64"):
        options.KernelOptions(hopper_consumers_d64=4)


def test_long_causal_head_dim_64_takes_three_consumers_with_lane_sums(monkeypatch):
    """Causal at head dim 64 from D64_CAUSAL_THREE_FROM_KEYS keys: three consumers and lane sums by default
    (below it two and whole-row sums); a forced consumer count or row-sum form is kept; under a Triton not
    measured, two consumers and whole-row sums at any length; head dim 128 and calls without a mask unchanged."""
    long = hopper_launch.D64_CAUSAL_THREE_FROM_KEYS
    monkeypatch.setattr(hopper_launch.triton, "__version__", "3.6.0")
    assert hopper_launch.consumer_count(64, True, Nk=long) == 3 and hopper_launch.lane_sums(64, None, True, long)
    assert hopper_launch.consumer_count(64, True, Nk=long - 1) == 2
    assert not hopper_launch.lane_sums(64, None, True, long - 1)
    assert hopper_launch.consumer_count(64, False, Nk=long) == 3
    assert not hopper_launch.lane_sums(64, None, False, long)
    assert hopper_launch.consumer_count(128, True, Nk=long) == 2 and hopper_launch.lane_sums(128, None, True, long)
    with options.use(hopper_consumers_d64=2):
        assert hopper_launch.consumer_count(64, True, Nk=long) == 2
        assert not hopper_launch.lane_sums(64, None, True, long)
    with options.use(hopper_lane_sums="off"):
        assert hopper_launch.consumer_count(64, True, Nk=long) == 3
        assert not hopper_launch.lane_sums(64, None, True, long)
    monkeypatch.setattr(hopper_launch.triton, "__version__", "3.9.0")
    assert hopper_launch.consumer_count(64, True, Nk=long) == 2 and not hopper_launch.lane_sums(64, None, True, long)
