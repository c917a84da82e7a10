"""Kernel sweep: naive, flash and sdpa attention over sequence lengths, with the I/O model next to each.

For every N and backend: forward and forward+backward time, peak memory and the HBM bytes of the standard I/O
model (ablation/io_model.py). On CUDA: triton.testing.do_bench medians and torch.cuda.max_memory_allocated above
the inputs; naive is run until it runs out of memory. On CPU: medians of a few perf_counter runs (flash runs
through Triton's interpreter, so its CPU times say nothing about the GPU) and the analytical activation memory.
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field

import torch

from . import io_model

BACKENDS = ("naive", "flash", "sdpa")


@dataclass
class SweepSettings:
    device: torch.device
    dtype: torch.dtype
    B: int
    H: int
    D: int
    seq_lens: list[int]
    causal: bool = True
    cpu_reps: int = 3          # CPU: timed runs per measurement (at least; up to 25 while under 0.2 s)
    deadline: float = 0.0      # time.time() after which no new N is started (0 = none)
    tiles: dict = field(default_factory=dict)  # filled in by run_sweep: the flash tiles used

    @property
    def elem(self) -> int:
        return torch.finfo(self.dtype).bits // 8


def default_settings(device: torch.device, full: bool) -> SweepSettings:
    """GPU: B=4, H=16, D=64, bf16, N = 256 … 16384. CPU (reduced): B=1, H=2, D=16, fp32, N = 64 … 512."""
    if device.type == "cuda" and full:
        return SweepSettings(device, torch.bfloat16, 4, 16, 64, [256 * 2 ** i for i in range(7)])
    if device.type == "cuda":
        return SweepSettings(device, torch.bfloat16, 2, 8, 64, [256, 512, 1024, 2048])
    if full:
        return SweepSettings(device, torch.float32, 1, 4, 32, [128, 256, 512, 1024])
    return SweepSettings(device, torch.float32, 1, 2, 16, [64, 128, 256, 512])


def flash_tiles(device: torch.device, dtype: torch.dtype, D: int) -> dict:
    """The (BLOCK_M, BLOCK_N, warps, stages) of each flash kernel: the default (first) GPU config, or the
    interpreter's. The sweep pins these (no autotuning), so the I/O model knows the tile sizes."""
    from kernels.flash import configs
    if device.type != "cuda":
        return {k: configs.INTERPRET_CONFIG for k in ("fwd", "dkdv", "dq")}
    return {k: configs.gpu_configs(k, dtype, D)[0] for k in ("fwd", "dkdv", "dq")}


def model_bytes(backend: str, s: SweepSettings, N: int) -> tuple[int, int]:
    """(forward bytes, forward+backward bytes) of the I/O model. sdpa is modelled as flash with our tiles."""
    if backend == "naive":
        fwd = io_model.naive_fwd_bytes(s.B, s.H, N, s.D, s.elem)
        return fwd, fwd + io_model.naive_bwd_bytes(s.B, s.H, N, s.D, s.elem)
    t = s.tiles
    fwd = io_model.flash_fwd_bytes(s.B, s.H, N, s.D, s.elem, block_m=t["fwd"][0], block_n=t["fwd"][1],
                                   causal=s.causal)
    bwd = io_model.flash_bwd_bytes(s.B, s.H, N, s.D, s.elem, dq_tiles=t["dq"][:2], dkdv_tiles=t["dkdv"][:2],
                                   causal=s.causal)
    return fwd, fwd + bwd


def analytical_memory(backend: str, s: SweepSettings, N: int) -> int:
    if backend == "naive":
        return io_model.naive_activation_bytes(s.B, s.H, N, s.D, s.elem)
    return io_model.flash_activation_bytes(s.B, s.H, N, s.D, s.elem)


def _fn(backend: str, causal: bool):
    from kernels import attention
    return lambda q, k, v: attention(q, k, v, backend=backend, causal=causal)


def _time_ms(fn, s: SweepSettings, grad_to_none=None) -> float:
    if s.device.type == "cuda":
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median"))
    fn()  # warm-up
    times = []
    while len(times) < s.cpu_reps or (sum(times) < 200 and len(times) < 25):  # cheap ops: more runs
        if grad_to_none:
            for t in grad_to_none:
                t.grad = None
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _peak_bytes(fn, s: SweepSettings) -> int:
    """Peak allocated memory above what was allocated before (CUDA only)."""
    torch.cuda.synchronize(s.device)
    base = torch.cuda.memory_allocated(s.device)
    torch.cuda.reset_peak_memory_stats(s.device)
    fn()
    torch.cuda.synchronize(s.device)
    return torch.cuda.max_memory_allocated(s.device) - base


def copy_bandwidth(device: torch.device) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (bytes read + written): the roofline for bytes."""
    n = (256 << 20) if device.type == "cuda" else (32 << 20)
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), SweepSettings(device, torch.float32, 1, 1, 1, [], cpu_reps=5))
    return 2 * n / (ms * 1e-3)


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def measure_one(row: dict, s: SweepSettings, N: int, ref: torch.Tensor | None) -> None:
    """Fill one (backend, N) row in place; raises torch.cuda.OutOfMemoryError when it does not fit (what was
    measured before, e.g. the forward, stays in the row)."""
    backend = row["backend"]
    g = torch.Generator(device=s.device).manual_seed(N)
    q, k, v = (torch.randn(s.B, s.H, N, s.D, device=s.device, dtype=s.dtype, generator=g).requires_grad_()
               for _ in range(3))
    do = torch.randn(s.B, s.H, N, s.D, device=s.device, dtype=s.dtype, generator=g)
    attn = _fn(backend, s.causal)

    def fwd():
        with torch.no_grad():
            return attn(q, k, v)

    def fwd_bwd():
        attn(q, k, v).backward(do)

    out = fwd()
    row["err_vs_sdpa"] = None if ref is None else (
        (out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
    row["out"] = out  # dropped by the caller after use as the reference
    row["fwd_ms"] = _time_ms(fwd, s)
    if s.device.type == "cuda":
        row["mem_fwd"] = _peak_bytes(fwd, s)
    row["fwdbwd_ms"] = _time_ms(fwd_bwd, s, grad_to_none=[q, k, v])
    if s.device.type == "cuda":
        for t in (q, k, v):
            t.grad = None
        row["mem_fwdbwd"] = _peak_bytes(fwd_bwd, s)


def run_sweep(s: SweepSettings, log=print) -> dict:
    """All rows, plus where naive ran out of memory and the copy bandwidth."""
    s.tiles = flash_tiles(s.device, s.dtype, s.D)
    rows, oom, skipped = [], {}, []
    threads = torch.get_num_threads()
    if s.device.type == "cpu":  # one thread: tiny ops, and a busy core would stall a second thread's barrier
        torch.set_num_threads(1)
    try:
        bandwidth = copy_bandwidth(s.device)
        _sweep_rows(s, rows, oom, skipped, log)
    finally:
        torch.set_num_threads(threads)
    return {"rows": rows, "oom": oom, "skipped": skipped, "copy_bandwidth": bandwidth,
            "settings": {"B": s.B, "H": s.H, "D": s.D, "dtype": str(s.dtype).replace("torch.", ""),
                         "causal": s.causal, "seq_lens": s.seq_lens, "device": str(s.device),
                         "tiles": {k: list(v) for k, v in s.tiles.items()},
                         "timing": "triton.testing.do_bench median" if s.device.type == "cuda"
                         else f"median of {s.cpu_reps}-25 perf_counter runs after one warm-up, one CPU thread",
                         "memory": "measured: torch.cuda.max_memory_allocated above the inputs"
                         if s.device.type == "cuda" else "analytical (ablation/io_model.py *_activation_bytes)"}}


def _sweep_rows(s: SweepSettings, rows: list, oom: dict, skipped: list, log) -> None:
    from kernels.flash import forced_configs
    with forced_configs(**s.tiles):
        for N in s.seq_lens:
            if s.deadline and time.time() > s.deadline:
                skipped.append(N)
                continue
            ref = None
            for backend in ("sdpa", "flash", "naive"):  # sdpa first: it is the reference output
                row, failed = {"N": N, "backend": backend}, False
                try:
                    if backend in oom:
                        row["status"] = f"not run (OOM from N={oom[backend]})"
                    else:
                        measure_one(row, s, N, ref)
                        row["status"] = "ok"
                except RuntimeError as e:
                    if not _is_oom(e):
                        raise
                    failed = True
                if failed:  # outside the except block, so its frames (and tensors) are freed
                    oom[backend] = N
                    row["status"] = f"OOM at N={N}" + (" in fwd+bwd" if "fwd_ms" in row else "")
                    row.pop("out", None)
                    gc.collect()
                    if s.device.type == "cuda":
                        torch.cuda.empty_cache()
                out = row.pop("out", None)
                if backend == "sdpa":
                    ref = out
                row["model_fwd_bytes"], row["model_fwdbwd_bytes"] = model_bytes(backend, s, N)
                if s.device.type != "cuda" or row["status"] != "ok":
                    row["mem_analytical"] = analytical_memory(backend, s, N)
                rows.append(row)
                log(_row_line(row))
            del ref
            gc.collect()
            if s.device.type == "cuda":
                torch.cuda.empty_cache()


def _row_line(r: dict) -> str:
    if r["status"] != "ok":
        return f"  N={r['N']:6d} {r['backend']:5s} {r['status']}" + (
            f" (fwd {r['fwd_ms']:.3f} ms)" if "fwd_ms" in r else "")
    mem = r.get("mem_fwdbwd", r.get("mem_analytical", 0))
    return (f"  N={r['N']:6d} {r['backend']:5s} fwd {r['fwd_ms']:9.3f} ms  fwd+bwd {r['fwdbwd_ms']:9.3f} ms  "
            f"mem {io_model.fmt_bytes(mem):>10s}  model bytes fwd {io_model.fmt_bytes(r['model_fwd_bytes'])}")
