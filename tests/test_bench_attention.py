"""bench/attention.py on the CPU: which peers run or are skipped (and why), FA4's layout, and the report."""
import sys
import types

import pytest
import torch

import bench.attention as ba
from kernels.naive import naive_attention


@pytest.fixture
def hopper(monkeypatch):
    """A CUDA machine with an sm_90 GPU, as far as the provider checks can tell."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def fake_fa4(monkeypatch, returns_tuple: bool):
    """Install a stand-in flash_attn.cute whose flash_attn_func takes (B, N, H, D) as FA4 does; returns the list
    of the q shapes it was called with."""
    calls = []

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False):
        calls.append(tuple(q.shape))
        o = naive_attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=causal).transpose(1, 2)  # (B, N, H, D)
        return (o, None) if returns_tuple else o
    pkg, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = flash_attn_func
    pkg.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    return calls


@pytest.mark.parametrize("returns_tuple", [True, False], ids=["out_lse", "out"])
@pytest.mark.parametrize("causal", [True, False])
def test_fa4_gets_bnhd_views_and_gives_bhnd_results(hopper, monkeypatch, causal, returns_tuple):
    calls = fake_fa4(monkeypatch, returns_tuple)
    B, H, N, D = 2, 3, 5, 4  # all different: a layout mix-up changes the result
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, generator=g) for _ in range(4))
    fn = ba.make_provider("fa4", N, causal, q=q.to(torch.bfloat16))  # dtype checked on a bf16 probe
    got = ba.fwd_bwd(fn, *(t.clone().requires_grad_() for t in (q, k, v)), do)
    want = ba.fwd_bwd(lambda a, b, c: naive_attention(a, b, c, causal=causal),
                      *(t.clone().requires_grad_() for t in (q, k, v)), do)
    assert calls == [(B, N, H, D)]
    for a, b in zip(got, want):  # out, dq, dk, dv
        assert a.shape == (B, H, N, D)
        torch.testing.assert_close(a, b)


def test_fa4_skipped_when_not_installed(hopper, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # import raises ImportError
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    why = ba.skip_reason("fa4", q, True)
    assert why.startswith("flash-attn-4 is not installed (flash_attn.cute: ") and "\n" not in why
    with pytest.raises(ba.Unavailable, match="not installed"):
        ba.make_provider("fa4", 8, True, q=q)


def test_fa4_skipped_off_hopper_and_blackwell_and_for_float32(monkeypatch, hopper):
    fake_fa4(monkeypatch, True)
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    assert ba.skip_reason("fa4", q, False) is None
    assert "float32" in ba.skip_reason("fa4", q.float(), False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert ba.skip_reason("fa4", q, False) == "FA4's kernels are for sm_90 / sm_100 GPUs, this one is sm_80"


def test_peers_skipped_without_cuda_and_others_never(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    assert ba.skip_reason("fa4", q, True) == ba.skip_reason("sdpa-cudnn", q, True) == "no CUDA device"
    assert all(ba.skip_reason(p, q, True) is None for p in ("flash", "sdpa-flash", "flex", "naive"))
    with pytest.raises(ba.Unavailable, match="no CUDA device"):
        ba.make_provider("sdpa-cudnn", 8, True, q=q)


def test_cudnn_skipped_where_its_backend_refuses_the_inputs(hopper, monkeypatch):
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    assert ba.skip_reason("sdpa-cudnn", q, True) == "cuDNN is not available in this torch build"
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    seen = []

    def can_use(params, debug=False):
        seen.append(params)
        return usable
    monkeypatch.setattr(torch.backends.cuda, "can_use_cudnn_attention", can_use)
    usable = False
    assert ba.skip_reason("sdpa-cudnn", q, True) == ("SDPA's cuDNN backend does not take bfloat16 (B, H, N, D) = "
                                                     "(1, 2, 8, 16) causal=True here")
    usable = True
    assert ba.skip_reason("sdpa-cudnn", q, True) is None and len(seen) == 2


def test_naive_is_skipped_past_its_memory_limit():
    with pytest.raises(ba.Unavailable, match="O\\(N\\^2\\) memory"):
        ba.make_provider("naive", ba.NAIVE_MAX_N + 1, True)


def _measured(fwd, bwd):
    return dict(fwd_tflops=fwd, bwd_tflops=bwd, peak_gib=0.1, diff=1e-3)


def test_report_lists_each_skip_reason_once_and_the_fa4_ratios():
    meta = dict(gpu="GPU", command="python bench/attention.py", date="today", torch="t", triton="tr")
    skip = dict(skipped="flash-attn-4 is not installed (flash_attn.cute: ModuleNotFoundError: nope)")
    results = [
        dict(shape=[4, 16, 4096, 64], causal=True, providers={
            "flash": _measured(300, 200), "sdpa-flash": dict(_measured(200, 100), diff=None),
            "sdpa-cudnn": _measured(400, 250), "fa4": skip}),
        dict(shape=[4, 16, 4096, 64], causal=False, providers={
            "flash": _measured(300, 200), "sdpa-flash": dict(_measured(200, 100), diff=None), "fa4": skip,
            "sdpa-cudnn": dict(skipped="SDPA's cuDNN backend does not take ...")}),
        dict(shape=[1, 16, 16384, 128], causal=True, providers={
            "flash": _measured(300, 200), "sdpa-flash": dict(_measured(200, 100), diff=None),
            "fa4": _measured(600, 500)}),
    ]
    md = ba.render(results, meta)
    assert "| vs cudnn fwd / bwd | vs fa4 fwd / bwd | met |" in md
    assert "| 4,16,4096,64 | yes | — / — | 1.50 / 2.00 | 0.75 / 0.80 | — / — |" in md
    assert "| 1,16,16384,128 | yes | — / — | 1.50 / 2.00 | — / — | 0.50 / 0.40 |" in md
    assert md.count("flash-attn-4 is not installed") == 1
    assert "- fa4: flash-attn-4 is not installed (flash_attn.cute: ModuleNotFoundError: nope) (2 of 3 cases)" in md
    assert "- sdpa-cudnn: SDPA's cuDNN backend does not take ... (1 of 3 cases)" in md
    assert "Not measured" not in md  # skips are not errors
