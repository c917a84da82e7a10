"""bench/profile_step.py: kernel kinds, the busy-time union, the report, and a case process on a CPU."""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import profile_step as ps  # noqa: E402


@pytest.mark.parametrize("name,kind", [
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "communication"),
    ("_attn_fwd", "attention"), ("_attn_bwd_dkdv", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "attention"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("triton_per_fused__to_copy_add_native_layer_norm_3", "Inductor fused"),
    ("_ce_loss_fwd_kernel", "loss"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("Memcpy DtoD (Device -> Device)", "copies"),
    ("void at::native::vectorized_elementwise_kernel<4, add>", "other ATen"),
])
def test_kernel_kinds(name, kind):
    assert ps.kind_of(name) == kind


def test_busy_time_is_the_union_of_intervals():
    assert ps.busy_us([]) == 0
    assert ps.busy_us([(0, 10), (5, 12), (20, 25)]) == 17      # overlap counted once, the gap not at all
    assert ps.busy_us([(20, 25), (0, 10), (2, 3)]) == 15       # unsorted, one inside another


def test_idle_gaps_are_counted_against_the_kernels_around_them():
    kernels = [(0, 10, "a"), (12, 20, "b"), (15, 30, "c"), (100, 110, "a"), (110.5, 111, "d")]  # µs
    gaps = ps.idle_gaps(kernels, steps=2)
    # gaps: 10 -> 12 (a, then b), 30 -> 100 (c ends the union, then a), 110 -> 110.5 (a, then d); c overlaps b
    assert gaps["total_ms"] == (2 + 70 + 0.5) / 1e3 / 2
    assert [(r["kernel"], r["ms"], r["gaps"]) for r in gaps["before"]] == [
        ("a", 0.035, 0.5), ("b", 0.001, 0.5), ("d", 0.00025, 0.5)]
    assert [(r["kernel"], r["gaps"]) for r in gaps["after"]] == [("c", 0.5), ("a", 1.0)]
    assert [b["gaps"] for b in gaps["by_size"]] == [1.0, 0, 0.5]  # < 5 µs: two gaps; >= 50 µs: one
    assert ps.idle_gaps([], 1) == {"total_ms": 0, "before": [], "after": [],
                                   "by_size": [{"ms": 0, "gaps": 0}] * (len(ps.GAP_SIZES_US) + 1)}
    assert len(ps.idle_gaps([(i * 10, i * 10 + 5, f"k{i}") for i in range(9)], 1, top=3)["before"]) == 3


def _api(name, ts, dur, corr=None):
    return {"cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def _gpu(name, ts, dur, corr, cat="kernel"):
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def test_launch_waits_split_each_gap_between_host_and_device():
    trace = [
        _api("cudaLaunchKernel", 0, 5, 1), _gpu("a", 10, 20, 1),             # a runs 10..30
        _api("cudaLaunchKernel", 40, 5, 2), _gpu("b", 50, 10, 2),            # b launched at 45: 15 of 20 host's
        _api("cudaLaunchKernel", 46, 4, 3), _gpu("c", 70, 10, 3),            # c issued at 50: the 10 µs device's
        _api("cudaMemcpyAsync", 50, 100, 4), _gpu("Memcpy HtoD", 150, 2, 4, "gpu_memcpy"),  # a blocking copy
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},         # neither: ignored
    ]
    w = ps.launch_waits(trace, steps=1)
    # gaps: 30->50 (b issued at 45: host 15, device 5), 60->70 (c issued at 50: device 10), 80->150 (the copy
    # returned at 150: host 70)
    assert w["host_ms"] == pytest.approx((15 + 70) / 1e3) and w["device_ms"] == pytest.approx((5 + 10) / 1e3)
    assert [(r["kernel"], r["per_step"]) for r in w["host_by_kernel"]] == [("Memcpy HtoD", 1), ("b", 1)]
    assert w["blocking_calls"] == [{"call": "cudaMemcpyAsync", "ms": 0.1, "per_step": 1}]
    assert ps.launch_waits([_gpu("a", 0, 5, 1)], 1) is None  # a trace without API calls says nothing
    halved = ps.launch_waits(trace, steps=2)
    assert halved["host_ms"] == pytest.approx(w["host_ms"] / 2)


def _case(name, step, kinds, kernels):
    return {"name": name, "overrides": [f"--x={name}"], "step_ms": step, "profiled_step_ms": step + 1,
            "gpu_busy_ms": step - 2, "warmup_s": 30.0, "peak_gib": 10.0, "tokens_per_step": 131072,
            "kinds": kinds, "kernels": [{"name": n, "kind": ps.kind_of(n), "ms": ms, "calls": c}
                                        for n, ms, c in kernels]}


def test_report_lists_differences_from_the_first_case():
    a = _case("ddp", 240.0, {"matmul": 150.0, "Inductor fused": 40.0},
              [("nvjet_a", 150.0, 96), ("triton_poi_fused_1", 40.0, 8)])
    b = _case("fsdp", 250.5, {"matmul": 151.0, "communication": 3.0},
              [("nvjet_a", 151.0, 96), ("ncclDevKernel_AllGather", 3.0, 24)])
    b["gaps"] = ps.idle_gaps([(0, 10, "nvjet_a"), (70, 80, "ncclDevKernel_AllGather")], 1)
    b["waits"] = ps.launch_waits([_api("cudaLaunchKernel", 0, 1, 1), _gpu("nvjet_a", 0, 10, 1),
                                  _api("cudaStreamSynchronize", 1, 75, None),
                                  _api("cudaLaunchKernel", 76, 1, 2), _gpu("ncclDevKernel_AllGather", 77, 3, 2)], 1)
    text = ps.report([a, b], "python bench/profile_step.py X", "abc1234", top=2)
    assert "| ≥ 50 µs | 0.06 (1) |" in text and "| all | 0.06 |" in text  # the one case with gaps
    assert "| `ncclDevKernel_AllGather` | 0.060 | 1 | | `nvjet_a` | 0.060 | 1 |" in text
    assert "| step (timed, synchronised) | 240.00 | 250.50 | +10.50 |" in text
    assert "| kernels: communication | 0.00 | 3.00 | +3.00 |" in text
    lines = [line for line in text.splitlines() if line.startswith("| `") and " | | " not in line]  # kernel rows
    assert lines[0].startswith("| `triton_poi_fused_1` | Inductor fused | 40.000 (8) | – |")  # largest spread first
    assert "| GPU waiting for a launch (host-bound) | 0.07 |" in text  # 10 -> 77, the launch returned at 77
    assert "| `ncclDevKernel_AllGather` | 0.067 | 1 | | `cudaStreamSynchronize` | 0.075 | 1 |" in text
    lines = [line for line in text.splitlines() if line.startswith("| `") and " | | " not in line]  # kernel rows
    assert len(lines) == 2 and "Commit abc1234" in text


def test_case_process_runs_the_trainer_steps_on_a_cpu(tmp_path):
    out = tmp_path / "one.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "profile_step.py"), str(ROOT / "configs" / "demo.toml"),
                        f"--one={out}", "--warmup=1", "--timed=2", "--profiled=1", "--device=cpu", "--compile=false",
                        "--n_layer=1", "--n_embd=32", "--n_head=2", "--block_size=32", "--batch_size=2",
                        "--cprofile=1", "--top=3"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["step_ms"] > 0 and result["tokens_per_step"] == 2 * 32
    assert result["kernels"] == [] and result["gpu_busy_ms"] == 0  # a CPU has no kernels to count
    host = result["host"]  # --top bounds the host functions listed
    assert host["wall_ms"] > 0 and len(host["by_own"]) == len(host["by_cum"]) == 3


def test_case_command_passes_every_measuring_option_on():
    args = argparse.Namespace(config="configs/demo.toml", warmup=2, timed=3, profiled=1, cprofile=4, top=7,
                              host_ops=False)
    cmd = ps.case_command(args, "/tmp/x.json", ["--attention=sdpa"])
    assert cmd[2:] == ["configs/demo.toml", "--one=/tmp/x.json", "--warmup=2", "--timed=3", "--profiled=1",
                       "--cprofile=4", "--top=7", "--attention=sdpa"]
    args.host_ops = True
    assert ps.case_command(args, "/tmp/x.json", [])[-1] == "--host-ops"


def test_host_ops_are_summed_by_name_per_step_and_call():
    trace = [{"cat": "cpu_op", "name": "flashgpt::flash_attn_fwd", "ts": 0, "dur": 40},
             {"cat": "cpu_op", "name": "aten::empty", "ts": 5, "dur": 3},       # inside the one above: counted too
             {"cat": "cpu_op", "name": "flashgpt::flash_attn_fwd", "ts": 100, "dur": 60},
             {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 10, "dur": 5},  # not an operator
             {"cat": "kernel", "name": "_attn_fwd", "ts": 20, "dur": 50}]
    rows = ps.host_ops(trace, steps=2)
    assert rows == [{"op": "flashgpt::flash_attn_fwd", "ms": 0.05, "calls": 1.0, "us_per_call": 50.0},
                    {"op": "aten::empty", "ms": 0.0015, "calls": 0.5, "us_per_call": 3.0}]
    assert len(ps.host_ops(trace, 1, top=1)) == 1 and ps.host_ops([], 1) == []
    case = _case("flash", 100.0, {}, [])
    case["host_ops"] = rows
    text = ps.report([case], "python bench/profile_step.py X", "abc1234", top=2)
    assert "| `flashgpt::flash_attn_fwd` | 0.05 | 1 | 50.0 |" in text


def test_bad_arguments_are_one_line_errors():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "profile_step.py"), "configs/demo.toml",
                        "--case", "nocolon"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()[-1]
    assert "error:" in err and "NAME:OVERRIDES" in err
