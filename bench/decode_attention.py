"""Decode-attention benchmark: the split-KV kernel (its merge launched, or done inside the split kernel) against
SDPA and a copy of the same bytes, GPT-2-like shape.

    python bench/decode_attention.py                 # GPU: B in (1, 16), H=12, D=64, bf16, Nq=1, 1k..32k cache
    python bench/decode_attention.py --sweep         # GPU: also time tile configs and split counts per shape
    python bench/decode_attention.py --smoke [--sweep]   # CPU, Triton interpreter, tiny sizes: the script runs

Every (batch, length) reads a static cache of capacity --capacity (default the longest length) whose first L
positions are valid, as a decode step inside a CUDA graph does. Providers:
    split          decode_attention(..., num_splits=None): the grid sized for the capacity (what a graph
                   holds), each sequence's split plan from its length on the device
    split-merged   the same under the kernel option decode_merge_in_split (PROVIDER_OPTIONS): the last split
                   program of each (sequence, kv head, row block) merges the parts, no merge launch
    split-chunks   the same under decode_split_order="chunks": split s reads one contiguous chunk instead of
                   key blocks s, s + used, ... (the default order)
    split-nofull   the same under decode_full_grid=False: a grid whose unsplit programs fill the GPU split too
                   (kernels/decode.py), and launched as a PDL dependent
    split-dep      the same under decode_full_grid_pdl=True: a call whose unsplit programs fill the GPU launched
                   as a PDL dependent too (its programs resident while the previous call runs)
    split-noshort  the same under decode_short_splits=False: the grid holds the automatic count only, so a short
                   sequence at batch 1 gets no more splits than a long one (kernels/decode.py: short_grid_splits)
    split-long     the same under decode_full_grid_max_len=4096, decode_full_grid_long_splits=16
                   (LONG_OPTIONS): a call whose unsplit programs fill the GPU, planned for more than 4,096 keys,
                   gets 16 splits, its sequences of up to 4,096 keys unsplit on the device
    split-long-merged  split-long under decode_merge_in_split too (no merge launch)
    split-tma      the same under decode_tma=True: the split kernel reads K and V through TMA tensor descriptors
                   over the whole caches (Hopper, 16-bit caches; elsewhere the same pointer loads as split)
    split-rows32   the same under decode_min_rows=32: 32 query rows per program (two warps along the rows,
                   two along the keys: half the cross-warp softmax reductions of 16 rows)
    split-parts4   the same under decode_key_parts=4: a softmax state per warp's part of each key block, merged
                   after the key loop (no cross-warp reductions in it)
    split-rows64   the same under decode_min_rows=64: 64 query rows per program (one real row at GPT-2's shape),
                   so that sm_90 runs the two products as warpgroup MMAs with each warp's rows its own (no
                   cross-warp softmax reductions)
    split-fit      the same as split over a cache view of exactly L positions (the grid sized for L)
    nosplit        decode_attention(..., num_splits=1): one program per (sequence, kv head), the baseline
    sdpa           F.scaled_dot_product_attention(q, k[:, :, :L], v[:, :, :L])
    sdpa-mask      (--window only) SDPA over the whole capacity with the window's boolean mask: what the KV
                   cache's masked path runs (the sdpa backend's windowed decode step)
    copy           a device-to-device copy of the same bytes as K and V's valid prefixes: the bandwidth limit
--window W: a sliding window of W positions (the new token at L - 1 sees L - W .. L - 1): the decode providers
pass window=W, sdpa attends to the window's slice k[:, :, L - W:L], bytes and the copy count the window's keys,
and the positions before the window are poisoned too while outputs are checked.
Each is first checked against a float32 SDPA reference (error <= 2x bf16 SDPA's + 4e-3; the cache past L
holds NaN for this check), then timed two ways, each the median of repeated measurements after warm-up calls:
    graph   per-call µs of a CUDA graph of back-to-back calls (the GPU's time, as in the model's decode step);
            the calls rotate over copies of the cache placed side by side, enough of them that the bytes read
            between two visits of one copy exceed 3x the L2 cache, so no call finds its data in L2
    eager   triton.testing.do_bench medians of plain calls (L2 flushed before each; the host's launch time
            shows where it exceeds the flush), the median of three
The decode kernels' outputs are checked again after timing. GB/s counts the bytes of K and V read (2·B·Hkv·L·D·
bytes); the copy's GB/s counts bytes read plus written, i.e. the bandwidth a streaming kernel can reach; "of
copy" = a kernel's GB/s over the copy's. Decode calls pass check_lens=False (no host sync, as in a graph).

--sweep (once the table above is complete, per shape; graph timing): every tile config in SWEEP_TILES with the
automatic split count, then the fastest two and the default with explicit split counts from SWEEP_SPLITS, and
the automatic count under other decode_min_keys_per_split values, all of it in each split order of
--sweep-orders (--sweep-tiles, --sweep-splits and --sweep-min-keys narrow or replace the lists). Each
candidate's output is checked before it is timed; a candidate that fails to compile, run or match is recorded
with its error and skipped. Writes decode_attention_sweep.json/.md: the winner per shape and how far the
default (tile, auto splits) is from it.

Results go to --out (default bench/results/) as decode_attention.json/.md (..._smoke with --smoke), rewritten
after every shape (atomically), so a run stopped by --deadline-s or a time limit keeps what it measured.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (block_n, num_warps, num_stages, dot) candidates of --sweep; dot=False applies where a program holds one query row
SWEEP_TILES = [
    (32, 4, 3, True), (32, 4, 4, True), (64, 2, 3, True), (64, 4, 2, True), (64, 4, 3, True), (64, 4, 4, True),
    (64, 8, 3, True), (128, 4, 2, True), (128, 4, 3, True), (128, 8, 2, True), (128, 8, 3, True),
    (256, 8, 2, True),
    (32, 4, 1, False), (64, 2, 1, False), (64, 4, 1, False), (64, 8, 1, False), (128, 4, 1, False),
    (128, 8, 1, False), (256, 8, 1, False),
]
SWEEP_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 44, 64, 96, 128)
SWEEP_MIN_KEYS = (64, 128, 512, 1024)  # decode_min_keys_per_split values tried with the automatic split count
SMOKE_TILES = [(16, 4, 1, True), (32, 2, 1, False)]
SMOKE_SPLITS = (1, 3)
PROVIDER_OPTIONS = {"split-merged": dict(decode_merge_in_split=True),  # kernel options a provider runs under
                    "split-chunks": dict(decode_split_order="chunks"),
                    "split-nofull": dict(decode_full_grid=False),
                    "split-dep": dict(decode_full_grid_pdl=True),
                    "split-noshort": dict(decode_short_splits=False),
                    "split-long": dict(decode_full_grid_max_len=4096, decode_full_grid_long_splits=16),
                    "split-long-merged": dict(decode_full_grid_max_len=4096, decode_full_grid_long_splits=16,
                                              decode_merge_in_split=True),
                    "split-tma": dict(decode_tma=True),
                    "split-rows32": dict(decode_min_rows=32),
                    "split-parts4": dict(decode_key_parts=4),
                    "split-rows64": dict(decode_min_rows=64)}
# the decode providers are checked again after timing
DECODE_PROVIDERS = ("split", "split-merged", "split-chunks", "split-nofull", "split-dep", "split-noshort",
                    "split-long", "split-long-merged", "split-tma", "split-rows32", "split-parts4", "split-rows64",
                    "split-fit", "nosplit")
PROVIDERS = (*DECODE_PROVIDERS, "sdpa", "sdpa-mask", "copy")
# kernels.options.DECODE_SPLIT_ORDERS (the default first), named here for the arguments: importing kernels before
# --smoke has switched on the interpreter would decorate the kernels for a GPU
SPLIT_ORDERS = ("strided", "chunks")
TARGET_LEN, TARGET_COPY_FRACTION, TARGET_VS_SDPA = 32768, 0.75, 1.0
L2_FACTOR = 3  # bytes read between two visits of one cache copy, in L2 sizes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="directory for JSON + markdown (default bench/results/)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU through the Triton interpreter")
    p.add_argument("--sweep", action="store_true", help="also time tile configs and split counts per shape")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,16)")
    p.add_argument("--lens", default=None, help="comma-separated cache lengths (default 1024,...,32768)")
    p.add_argument("--capacity", type=int, default=None, help="cache capacity (default: the longest length)")
    p.add_argument("--heads", type=int, default=12, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads, i.e. MHA)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--window", type=int, default=0,
                   help="sliding window of this many positions (0: none; sdpa-mask is timed only with one)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="start nothing new after this many seconds (what was measured is written)")
    p.add_argument("--providers", default=",".join(PROVIDERS),
                   help=f"comma-separated providers of the table (default all: {','.join(PROVIDERS)})")
    p.add_argument("--sweep-tiles", default=None,
                   help="--sweep's tiles as BLOCK_N:WARPS:STAGES[:vec], comma-separated (default SWEEP_TILES)")
    p.add_argument("--sweep-splits", default=None, help="--sweep's explicit split counts (default SWEEP_SPLITS)")
    p.add_argument("--sweep-min-keys", default=None,
                   help="--sweep's decode_min_keys_per_split values ('' for none; default SWEEP_MIN_KEYS)")
    p.add_argument("--sweep-orders", default="strided", help="--sweep's split orders: strided, chunks or both")
    a = p.parse_args(argv)

    def ints(text, name):
        try:
            vals = [int(x) for x in text.split(",")]
        except ValueError:
            p.error(f"{name}: expected comma-separated integers, got {text!r}")
        if not vals or min(vals) < 1:
            p.error(f"{name}: values must be >= 1, got {text!r}")
        return vals
    a.batches = ints(a.batches, "--batches") if a.batches else None
    a.providers = [x for x in a.providers.split(",") if x]
    bad = sorted(set(a.providers) - set(PROVIDERS))
    if bad or not a.providers:
        p.error(f"--providers: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(PROVIDERS)}")
    a.sweep_orders = [x for x in a.sweep_orders.split(",") if x]
    if not a.sweep_orders or set(a.sweep_orders) - set(SPLIT_ORDERS):
        p.error(f"--sweep-orders: expected some of {', '.join(SPLIT_ORDERS)}, got {','.join(a.sweep_orders)!r}")
    a.sweep_splits = ints(a.sweep_splits, "--sweep-splits") if a.sweep_splits else None
    if a.sweep_min_keys is not None:
        a.sweep_min_keys = ints(a.sweep_min_keys, "--sweep-min-keys") if a.sweep_min_keys else []
    if a.sweep_tiles:
        tiles = []
        for text in a.sweep_tiles.split(","):
            parts = text.split(":")
            try:
                if len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] != "vec"):
                    raise ValueError
                tiles.append((int(parts[0]), int(parts[1]), int(parts[2]), len(parts) == 3))
            except ValueError:
                p.error(f"--sweep-tiles: expected BLOCK_N:WARPS:STAGES[:vec], got {text!r}")
        a.sweep_tiles = tiles
    a.lens = ints(a.lens, "--lens") if a.lens else None
    if a.window < 0:
        p.error(f"--window must be >= 0, got {a.window}")
    a.kv_heads = a.kv_heads or a.heads
    if a.heads < 1 or a.kv_heads < 1 or a.heads % a.kv_heads:
        p.error(f"--heads ({a.heads}) must be a positive multiple of --kv-heads ({a.kv_heads})")
    if a.capacity is not None and a.lens and a.capacity < max(a.lens):
        p.error(f"--capacity {a.capacity} is below the longest length {max(a.lens)}")
    return a


def rotation_count(bytes_per_call: int, l2_bytes: int) -> int:
    """Cache copies to rotate over so that L2_FACTOR x L2 bytes are read between two visits of one copy."""
    return max(2, math.ceil(L2_FACTOR * l2_bytes / max(bytes_per_call, 1)) + 1)


def candidate_splits(L: int, block_n: int, splits=SWEEP_SPLITS) -> list[int]:
    """The split counts worth timing at length L: each split keeps at least one block of keys."""
    return [s for s in splits if s == 1 or s * block_n <= L]


def summarize(times: list[float]) -> dict:
    return dict(median=statistics.median(times), min=min(times), max=max(times), n=len(times))


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class ContextLost(RuntimeError):
    """A CUDA error that leaves the context unusable (an illegal address, say): nothing after it can run."""


class Bench:
    """Timing on one device: graph (CUDA graph replays, µs per call) and eager (do_bench or a CPU timer)."""

    def __init__(self, torch, device, smoke: bool):
        self.torch, self.device, self.smoke = torch, device, smoke
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def alive(self) -> bool:
        """Whether the device still runs work (after an error: an illegal address ends the CUDA context)."""
        try:
            self.sync()
            if self.cuda:
                self.torch.ones(1, device=self.device).add_(1).item()
            return True
        except Exception:  # noqa: BLE001 - any failure here means nothing more can run
            return False

    def eager_us(self, fn) -> dict:
        for _ in range(3 if self.cuda else 1):  # warm: compile, allocator, first-launch costs
            fn()
        self.sync()
        if not self.cuda:
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return summarize(times)
        from triton.testing import do_bench
        return summarize([do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3 for _ in range(3)])

    def graph_us(self, call, n_views: int, est_us: float, replays: int = 10) -> dict | None:
        """µs per call of a CUDA graph holding n calls (call(j % n_views) for j < n); None off CUDA."""
        if not self.cuda:
            return None
        torch = self.torch
        n = max(n_views, min(500, math.ceil(4000.0 / max(est_us, 1.0))))  # a replay of ~4 ms or more
        n = math.ceil(n / n_views) * n_views
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm outside capture
            for j in range(n_views):
                call(j)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for j in range(n):
                call(j % n_views)
        graph.replay()
        self.sync()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / n)
        del graph
        return summarize(times)


class Shape:
    """One (batch, length) case: q, n_views side-by-side cache copies (views of one buffer), and checks."""

    def __init__(self, torch, F, device, dtype, B, H, Hkv, D, L, capacity, n_views, window=0):
        self.torch, self.F = torch, F
        self.B, self.H, self.Hkv, self.D, self.L, self.capacity, self.n_views = B, H, Hkv, D, L, capacity, n_views
        self.window = window
        self.lo = max(L - window, 0) if window else 0  # the first key the new token (position L - 1) sees
        self.group = H // Hkv
        self.q = torch.randn(B, H, 1, D, device=device, dtype=dtype)                        # (B, H, 1, D)
        total = capacity + (n_views - 1) * L
        self.k_big = torch.randn(B, Hkv, total, D, device=device, dtype=dtype)               # (B, Hkv, total, D)
        self.v_big = torch.randn(B, Hkv, total, D, device=device, dtype=dtype)
        self.k = [self.k_big[:, :, i * L:i * L + capacity] for i in range(n_views)]          # (B, Hkv, cap, D)
        self.v = [self.v_big[:, :, i * L:i * L + capacity] for i in range(n_views)]
        self.lens = torch.full((B,), L, device=device, dtype=torch.int32)
        self.out = torch.empty_like(self.q)
        self.nbytes = 2 * B * Hkv * (L - self.lo) * D * self.q.element_size()
        # the window's mask over the whole capacity (sdpa-mask): (1, capacity) bool, True where the token sees
        pos = torch.arange(capacity, device=device)
        self.mask = ((pos >= self.lo) & (pos < L))[None]
        # the reference, with the cache past L (and before the window) of view 0 full of NaN while it is computed
        self.poison(True)
        k, v = self.k[0][:, :, self.lo:L].float(), self.v[0][:, :, self.lo:L].float()
        if self.group > 1:
            k, v = k.repeat_interleave(self.group, 1), v.repeat_interleave(self.group, 1)
        self.ref = F.scaled_dot_product_attention(self.q.float(), k, v)                     # (B, H, 1, D)
        self.sdpa_err = (self.sdpa(0).float() - self.ref).abs().max().item()
        self.poison(False)  # the other views' valid prefixes overlap view 0's tail
        self.bound = 2 * self.sdpa_err + (4e-3 if dtype != torch.float32 else 1e-5)

    def poison(self, on: bool):
        """Fill cache positions [L, capacity) and [0, lo) of view 0 with NaN (on), or back with random values
        (off)."""
        for big in (self.k_big, self.v_big):
            for part in (big[:, :, self.L:self.capacity], big[:, :, :self.lo]):
                if on:
                    part.fill_(float("nan"))
                else:
                    part.normal_()

    def sdpa(self, i):
        kw = dict(enable_gqa=True) if self.group > 1 else {}
        return self.F.scaled_dot_product_attention(self.q, self.k[i][:, :, self.lo:self.L],
                                                   self.v[i][:, :, self.lo:self.L], **kw)

    def sdpa_mask(self, i):
        """SDPA over the whole capacity with the window's mask (a masked-out NaN still poisons SDPA's P V, so this
        provider is checked with finite values past L: the KV cache's masked path holds finite ones there)."""
        kw = dict(enable_gqa=True) if self.group > 1 else {}
        return self.F.scaled_dot_product_attention(self.q, self.k[i], self.v[i], attn_mask=self.mask, **kw)

    def error(self, result) -> float:
        return (result.float() - self.ref).abs().max().item()

    def check(self, fn, poison: bool = True) -> float:
        """fn(0)'s max error with the cache tail (and what precedes the window) poisoned, unless poison=False;
        raises when over the bound (NaN included)."""
        self.poison(poison)
        try:
            err = self.error(fn(0))
        finally:
            self.poison(False)
        if not err <= self.bound:
            raise AssertionError(f"error {err:.3g} > bound {self.bound:.3g}")
        return err


def error_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


class Run:
    """One benchmark run: its settings, the kernels' module, timing, results, and their files."""

    def __init__(self, args, argv):
        import torch
        import torch.nn.functional as F
        import triton

        import kernels.decode as decode
        from kernels import _triton, options
        self.args, self.torch, self.F, self.decode, self.options = args, torch, F, decode, options
        if args.smoke:
            self.device, self.dtype = torch.device("cpu"), torch.float32  # the interpreter's tl.dot: not bf16
            batches, lens, self.H, self.Hkv, self.D = [1, 2], [64, 600], 2, 2, 16  # both sides of the unsplit limit
            self.tiles, self.splits_grid, self.min_keys_grid = SMOKE_TILES, SMOKE_SPLITS, (64,)
        else:
            self.device, self.dtype = torch.device("cuda"), torch.bfloat16
            batches, lens = [1, 16], [1024, 2048, 4096, 8192, 16384, 32768]
            self.H, self.Hkv, self.D = args.heads, args.kv_heads, args.head_dim
            self.tiles, self.splits_grid, self.min_keys_grid = SWEEP_TILES, SWEEP_SPLITS, SWEEP_MIN_KEYS
        self.tiles = args.sweep_tiles or self.tiles
        self.splits_grid = args.sweep_splits or self.splits_grid
        self.min_keys_grid = self.min_keys_grid if args.sweep_min_keys is None else args.sweep_min_keys
        self.batches, self.lens = args.batches or batches, args.lens or lens
        self.capacity = args.capacity or max(self.lens)
        self.out_dir = Path(args.out) if args.out else ROOT / "bench" / "results"
        self.stem = "decode_attention" + ("_smoke" if args.smoke else "")
        self.t_start = time.time()
        self.bench = Bench(torch, self.device, args.smoke)
        cuda = self.bench.cuda
        self.l2 = getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 64 << 20) if cuda \
            else 1 << 16
        self.elem = torch.tensor([], dtype=self.dtype).element_size()
        self.default = decode.default_tile(triton.next_power_of_2(self.D), self.elem, self.H // self.Hkv,
                                           _triton.smem_per_sm(self.device))
        self.min_keys = options.get().decode_min_keys_per_split
        self.meta = dict(
            command="python " + " ".join(["bench/decode_attention.py", *(sys.argv[1:] if argv is None else argv)]),
            date=datetime.datetime.now().isoformat(timespec="seconds"), smoke=args.smoke,
            device=torch.cuda.get_device_name(self.device) if cuda else f"CPU interpreter ({platform.machine()})",
            torch=torch.__version__, triton=triton.__version__, dtype=str(self.dtype).replace("torch.", ""), Nq=1,
            H=self.H, Hkv=self.Hkv, D=self.D, capacity=self.capacity, window=args.window, l2_bytes=self.l2,
            default_tile=str(self.default),
            min_keys_per_split=self.min_keys, single_split_max_len=decode.SINGLE_SPLIT_MAX_LEN,
            timing=("graph: CUDA-graph replays of back-to-back calls over rotating cache copies (median of 10); "
                    "eager: median of 3 do_bench medians" if cuda else "perf_counter medians (smoke)"),
            correctness_failures=[], skipped=[])
        self.rows, self.sweep = [], []

    def late(self) -> bool:
        return self.args.deadline_s is not None and time.time() - self.t_start > self.args.deadline_s

    def write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        d, stem = self.out_dir, self.stem
        write_atomic(d / f"{stem}.json", json.dumps(dict(meta=self.meta, rows=self.rows), indent=2) + "\n")
        write_atomic(d / f"{stem}.md", render_markdown(self.meta, self.rows))
        if self.args.sweep:
            write_atomic(d / f"{stem}_sweep.json", json.dumps(dict(meta=self.meta, shapes=self.sweep), indent=2) + "\n")
            write_atomic(d / f"{stem}_sweep.md", render_sweep(self.meta, self.sweep))

    def measure(self, shape, fn, est_us=None) -> dict:
        """Eager and graph timing of fn(view); graph only (eager off CUDA) when est_us is given (the sweep)."""
        m = {}
        if est_us is None or not self.bench.cuda:
            m["eager"] = self.bench.eager_us(lambda: fn(0))
            est_us = m["eager"]["median"]
        m["graph"] = self.bench.graph_us(fn, shape.n_views, est_us)
        return m

    def all_shapes(self) -> None:
        """The table at every shape, then (--sweep) the sweep at every shape: a deadline cuts the sweep first."""
        for sweep in (False, True) if self.args.sweep else (False,):
            for B in self.batches:
                for L in self.lens:
                    if self.late():
                        self.meta["skipped"].append(f"{'sweep ' if sweep else ''}B={B} L={L}: deadline reached")
                        continue
                    shape = self.shape(B, L)
                    if sweep:
                        row = next((r for r in self.rows if r["B"] == B and r["L"] == L), {"providers": {}})
                        self.sweep.append(self.sweep_shape(shape, row))
                        self.write()
                    else:
                        self.one_shape(shape)
                    del shape
                    if self.bench.cuda:
                        self.torch.cuda.empty_cache()

    def shape(self, B: int, L: int) -> Shape:
        read = min(L, self.args.window or L)  # keys a call reads
        n_views = rotation_count(2 * B * self.Hkv * read * self.D * self.elem, self.l2) if self.bench.cuda else 1
        return Shape(self.torch, self.F, self.device, self.dtype, B, self.H, self.Hkv, self.D, L, self.capacity,
                     n_views, self.args.window)

    def one_shape(self, shape) -> None:
        torch, dec, Hkv, D = self.torch, self.decode, self.Hkv, self.D
        B, L, n_views, W = shape.B, shape.L, shape.n_views, self.args.window
        block_n = self.default.block_n
        # the keys the host plans the grid for, and those a sequence plans its splits over (kernels/decode.py)
        planned = min(self.capacity, W + block_n - 1) if W else self.capacity
        span = L - shape.lo // block_n * block_n
        long_splits = 1 if dec.full_grid_unsplit(B * Hkv, planned, self.device) else \
            dec.auto_num_splits(B * Hkv, planned, self.device)
        grid_splits = dec.short_grid_splits(B * Hkv, long_splits, planned, self.device)
        used = dec.plan_splits(span, grid_splits, self.min_keys, dec.SINGLE_SPLIT_MAX_LEN, block_n,
                               long_splits)[1] if grid_splits > 1 else 1
        n_el = shape.nbytes // self.elem
        copy_src = torch.empty(n_views * n_el, device=self.device, dtype=self.dtype)  # (views * n_el,)
        copy_dst = torch.empty(n_el, device=self.device, dtype=self.dtype)
        q, lens, out = shape.q, shape.lens, shape.out
        split = lambda i: dec.decode_attention(q, shape.k[i], shape.v[i], lens, out=out, check_lens=False,  # noqa: E731
                                               window=W)
        providers = {
            "split": split,
            "split-merged": split,  # the same call, under PROVIDER_OPTIONS
            "split-chunks": split,
            "split-nofull": split,
            "split-dep": split,
            "split-noshort": split,
            "split-long": split,
            "split-long-merged": split,
            "split-tma": split,
            "split-rows32": split,
            "split-parts4": split,
            "split-rows64": split,
            "split-fit": lambda i: dec.decode_attention(q, shape.k[i][:, :, :L], shape.v[i][:, :, :L], lens, out=out,
                                                        check_lens=False, window=W),
            "nosplit": lambda i: dec.decode_attention(q, shape.k[i], shape.v[i], lens, num_splits=1, out=out,
                                                      check_lens=False, window=W),
            "sdpa": shape.sdpa,
            "sdpa-mask": shape.sdpa_mask,
            "copy": lambda i: copy_dst.copy_(copy_src[i * n_el:(i + 1) * n_el]),
        }
        row = dict(B=B, H=self.H, Hkv=Hkv, D=D, L=L, capacity=self.capacity, rotation=n_views,
                   grid_splits=grid_splits, fit_splits=dec.auto_num_splits(B * Hkv, span, self.device),
                   used_splits=used,
                   nbytes=shape.nbytes, sdpa_err=shape.sdpa_err, providers={})
        for name, fn in providers.items():
            if name not in self.args.providers or (name == "sdpa-mask" and not W):
                continue
            try:
                with self.options.use(**PROVIDER_OPTIONS.get(name, {})):
                    if name != "copy":
                        row["providers"][name] = dict(max_err=shape.check(fn, poison=name != "sdpa-mask"))
                    m = self.measure(shape, fn)
                    if name in DECODE_PROVIDERS:  # the timed launches computed the right thing too
                        err = shape.error(fn(0))
                        if not err <= shape.bound:
                            raise AssertionError(f"after timing: error {err:.3g} > bound {shape.bound:.3g}")
                row["providers"].setdefault(name, {}).update(m)
            except Exception as e:  # noqa: BLE001 - one provider's failure is reported, not fatal
                row["providers"][name] = dict(error=error_line(e))
                self.meta["correctness_failures"].append(f"B={B} L={L} {name}: {error_line(e)}")
                if not self.bench.alive():
                    raise ContextLost(error_line(e)) from e
        add_rates(row)
        self.rows.append(row)
        print(one_line(row), flush=True)
        self.write()

    def sweep_shape(self, shape, row) -> dict:
        """--sweep at one shape: every tile with the auto split count, the best two and the default over explicit
        split counts, and the auto count under other min-keys options. µs per candidate, or its error."""
        res = dict(B=shape.B, L=shape.L, candidates=[])
        est = ((row["providers"].get("split") or {}).get("graph") or {}).get("median", 50.0)
        dec = self.decode

        def run(tile, num_splits, min_keys=None, order="strided") -> dict:
            cand = dict(tile=str(tile), splits="auto" if num_splits is None else num_splits, min_keys=min_keys,
                        order=order)
            res["candidates"].append(cand)
            if self.late():
                cand["error"] = "skipped: deadline reached"
                return cand

            def fn(i):
                return dec.decode_attention(shape.q, shape.k[i], shape.v[i], shape.lens, out=shape.out,
                                            check_lens=False, num_splits=num_splits, tile=tile,
                                            window=self.args.window)
            try:
                with self.options.use(decode_split_order=order,
                                      **({} if min_keys is None else dict(decode_min_keys_per_split=min_keys))):
                    cand["max_err"] = shape.check(fn)
                    m = self.measure(shape, fn, est_us=est)
                cand["us"] = (m["graph"] or m["eager"])["median"]
            except Exception as e:  # noqa: BLE001 - a candidate that cannot run is recorded and skipped
                cand["error"] = error_line(e)
                if not self.bench.alive():
                    raise ContextLost(cand["error"]) from e
            return cand

        tiles = [dec.DecodeTile(*t) for t in self.tiles if t[3] or shape.group == 1]
        if self.default not in tiles:
            tiles.insert(0, self.default)
        stage1 = []
        for order in self.args.sweep_orders:
            stage = [run(t, None, order=order) for t in tiles]
            stage1 += stage
            fastest = [c["tile"] for c in sorted((c for c in stage if "us" in c), key=lambda c: c["us"])[:2]]
            for t in dict.fromkeys([self.default, *(t for t in tiles if str(t) in fastest)]):
                for s in candidate_splits(shape.L, t.block_n, self.splits_grid):
                    run(t, s, order=order)
            for mk in self.min_keys_grid:
                run(self.default, None, mk, order=order)
        ok = [c for c in res["candidates"] if "us" in c]
        base = next((c for c in stage1
                     if c["tile"] == str(self.default) and c["order"] == SPLIT_ORDERS[0] and "us" in c), None)
        if ok:
            res["best"] = min(ok, key=lambda c: c["us"])
            res["default_us"] = base["us"] if base else None
            res["default_over_best"] = round(base["us"] / res["best"]["us"], 3) if base else None
            b = res["best"]
            print(f"  sweep B={shape.B} L={shape.L}: best {b['tile']} splits={b['splits']} {b['us']:.2f} µs; "
                  f"default {res['default_us']} µs; {len(ok)} of {len(res['candidates'])} candidates ran", flush=True)
        return res


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before kernels.decode is imported (Triton decorates then)
    sys.path.insert(0, str(ROOT))
    import torch
    if not args.smoke and not torch.cuda.is_available():
        print("error: the benchmark needs a CUDA GPU (use --smoke on CPU)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    run = Run(args, argv)
    lost = None
    try:
        with torch.no_grad():
            run.all_shapes()
    except ContextLost as e:  # keep what was measured, then stop with one line
        lost = str(e)
        run.meta["skipped"].append(f"everything after a CUDA error that ends the context: {lost}")
    run.meta["wall_s"] = round(time.time() - run.t_start, 1)
    run.meta["target"] = targets(run.rows)
    run.write()
    print("\n" + render_markdown(run.meta, run.rows))
    if args.sweep:
        print(render_sweep(run.meta, run.sweep))
    print(f"wrote {run.out_dir / run.stem}.json and .md" + (" (and _sweep.json/.md)" if args.sweep else ""))
    if lost:
        print(f"error: the CUDA context was lost ({lost}); the results stop there", file=sys.stderr)
        return 1
    failures = [f for f in run.meta["correctness_failures"] if "AssertionError" in f]
    if failures:
        print("CORRECTNESS FAILURES:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


def add_rates(row) -> None:
    """GB/s per provider (graph and eager) and the ratios the report shows."""
    for name, m in row["providers"].items():
        for mode in ("graph", "eager"):
            t = (m.get(mode) or {}).get("median")
            if t:
                moved = 2 * row["nbytes"] if name == "copy" else row["nbytes"]  # a copy reads and writes
                m[f"{mode}_GBps"] = round(moved / (t * 1e-6) / 1e9, 1)
    p = row["providers"]
    for mode in ("graph", "eager"):
        s, d, c = (p.get(n, {}).get(mode) or {} for n in ("split", "sdpa", "copy"))
        row[f"{mode}_split_vs_sdpa"] = round(d["median"] / s["median"], 3) if s and d else None
        cg, sg = p.get("copy", {}).get(f"{mode}_GBps"), p.get("split", {}).get(f"{mode}_GBps")
        row[f"{mode}_split_of_copy"] = round(sg / cg, 3) if sg and cg else None


def targets(rows) -> dict:
    """The targets, per timing mode: split >= SDPA at every (B, L), and >= 75% of the copy's GB/s at 32k."""
    out = {}
    for mode in ("graph", "eager"):
        vs = [(r["B"], r["L"], r.get(f"{mode}_split_vs_sdpa")) for r in rows]
        cp = [(r["B"], r.get(f"{mode}_split_of_copy")) for r in rows if r["L"] == TARGET_LEN]
        out[mode] = dict(
            vs_sdpa=dict(rule=f"split >= {TARGET_VS_SDPA}x SDPA at every length",
                         met=bool(vs) and all(x is not None and x >= TARGET_VS_SDPA for _, _, x in vs),
                         misses=[f"B={b} L={L}: {x}" for b, L, x in vs if x is None or x < TARGET_VS_SDPA]),
            copy=dict(rule=f"split >= {TARGET_COPY_FRACTION:.0%} of the copy's GB/s at L={TARGET_LEN}",
                      results=[dict(B=b, fraction=x, met=x is not None and x >= TARGET_COPY_FRACTION)
                               for b, x in cp]))
    return out


def _t(m, mode):
    t = (m.get(mode) or {}).get("median") if m else None
    return "—" if t is None else f"{t:.1f}"


def one_line(row) -> str:
    p = row["providers"]
    cells = "  ".join(f"{n} {_t(p.get(n), 'graph')}/{_t(p.get(n), 'eager')}" for n in p)
    return (f"B={row['B']:3d} L={row['L']:6d} splits grid {row['grid_splits']:3d} used {row['used_splits']:3d}  "
            f"µs graph/eager: {cells}  split/sdpa graph {row['graph_split_vs_sdpa']} "
            f"eager {row['eager_split_vs_sdpa']}"
            f"  of copy {row['graph_split_of_copy']}")


def render_markdown(meta, rows) -> str:
    names = [n for n in PROVIDERS if any(n in r["providers"] for r in rows)] or list(PROVIDERS)
    window = f", window {meta['window']}" if meta.get("window") else ""
    lines = [f"# Decode attention: split-KV vs SDPA vs a copy ({meta['dtype']}, Nq=1, H={meta['H']}, "
             f"Hkv={meta['Hkv']}, D={meta['D']}, cache capacity {meta['capacity']}{window})", "",
             f"`{meta['command']}` — {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, "
             f"{meta['date']}; {meta['timing']}. Default tile {meta['default_tile']}, min keys per split "
             f"{meta['min_keys_per_split']}; GB/s = bytes of K and V read (the copy: read + written).", "",
             "µs per call, graph (the GPU's time; eager in the second table):", "",
             "| B | cache len | splits grid / used | " + " | ".join(names)
             + " | split GB/s | sdpa GB/s | copy GB/s | split of copy | split vs sdpa |",
             "| --- | --- | --- | " + " | ".join("---" for _ in names) + " | --- | --- | --- | --- | --- |"]

    def gb(r, n, mode):
        x = r["providers"].get(n, {}).get(f"{mode}_GBps")
        return "—" if x is None else f"{x:.0f}"

    def ratio(x, pct=False):
        return "—" if x is None else (f"{x:.0%}" if pct else f"{x:.2f}x")
    for r in rows:
        lines.append(f"| {r['B']} | {r['L']} | {r['grid_splits']} / {r['used_splits']} | "
                     + " | ".join(_t(r["providers"].get(n), "graph") for n in names)
                     + f" | {gb(r, 'split', 'graph')} | {gb(r, 'sdpa', 'graph')} | {gb(r, 'copy', 'graph')} | "
                     f"{ratio(r['graph_split_of_copy'], True)} | {ratio(r['graph_split_vs_sdpa'])} |")
    lines += ["", "µs per call, eager (host launch time included where it exceeds do_bench's L2 flush):", "",
              "| B | cache len | " + " | ".join(names) + " | split vs sdpa |",
              "| --- | --- | " + " | ".join("---" for _ in names) + " | --- |"]
    for r in rows:
        lines.append(f"| {r['B']} | {r['L']} | " + " | ".join(_t(r["providers"].get(n), "eager") for n in names)
                     + f" | {ratio(r['eager_split_vs_sdpa'])} |")
    lines.append("")
    for mode, t in meta.get("target", {}).items():
        v, c = t["vs_sdpa"], t["copy"]
        lines.append(f"Targets ({mode}): {v['rule']}: {'met' if v['met'] else 'NOT met'}"
                     + (f" (misses: {'; '.join(v['misses'])})" if v["misses"] else "") + f"; {c['rule']}: "
                     + (", ".join(f"B={x['B']}: {ratio(x['fraction'], True)} {'met' if x['met'] else 'NOT met'}"
                                  for x in c["results"]) or "not measured") + ".")
    if meta["correctness_failures"]:
        lines.append("Failures: " + "; ".join(meta["correctness_failures"]))
    else:
        lines.append("Correctness: every provider within 2x SDPA's error (+ floor) of a float32 SDPA reference, "
                     "with the cache past the valid length full of NaN; the decode kernels again after timing.")
    if meta["skipped"]:
        lines.append("Not measured: " + "; ".join(meta["skipped"]))
    return "\n".join(lines) + "\n"


def render_sweep(meta, shapes) -> str:
    lines = [f"# Decode attention sweep ({meta['dtype']}, H={meta['H']}, Hkv={meta['Hkv']}, D={meta['D']}, "
             f"capacity {meta['capacity']})", "",
             f"`{meta['command']}` — {meta['device']}, {meta['date']}. µs per call (graph timing); tiles are "
             "`n<BLOCK_N> w<warps> s<stages> dot|vec`; splits `auto` = the automatic count (min keys per split "
             f"{meta['min_keys_per_split']} unless noted). Default: {meta['default_tile']}, auto.", "",
             "| B | cache len | best tile | best splits | best µs | default µs | default / best | candidates "
             "(ok / failed) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in shapes:
        ok = [c for c in s["candidates"] if "us" in c]
        bad = [c for c in s["candidates"] if "error" in c]
        b = s.get("best")
        if b:
            splits = (f"{b['splits']}" + ("" if b.get("min_keys") is None else f" (min keys {b['min_keys']})")
                      + ("" if b.get("order", "strided") == "strided" else f", {b['order']}"))
            default_us = "—" if s.get("default_us") is None else f"{s['default_us']:.2f}"
            cells = f"{b['tile']} | {splits} | {b['us']:.2f} | {default_us} | {s.get('default_over_best') or '—'}"
        else:
            cells = "— | — | — | — | —"
        lines.append(f"| {s['B']} | {s['L']} | {cells} | {len(ok)} / {len(bad)} |")
    lines += ["", "Every candidate (µs; an error instead where it failed):", ""]
    for s in shapes:
        lines.append(f"- B={s['B']} L={s['L']}: " + ", ".join(
            f"{c['tile']} {c['splits']}{'' if c.get('min_keys') is None else '/mk' + str(c['min_keys'])}"
            f"{'' if c.get('order', 'strided') == 'strided' else ' ' + c['order']}: "
            + (f"{c['us']:.2f}" if "us" in c else c.get("error", "?")) for c in s["candidates"]))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
