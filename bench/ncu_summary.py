"""A short table of what Nsight Compute measured per kernel, from its CSV exports.

    ncu --import REPORT.ncu-rep --page raw --csv > raw.csv
    ncu --import REPORT.ncu-rep --page source --print-source sass --csv -k regex:NAME > source.csv
    python bench/ncu_summary.py raw.csv [--source source.csv] [--top 12]

From raw.csv (gzip accepted), one row per profiled kernel: its duration, the tensor pipe's active cycles, the issue
rate, the local-memory (spill) requests, DRAM throughput, achieved occupancy and L2 hit rate (where the export
has them) and the main stall reasons per issued instruction. From source.csv (one
block per kernel launch that matched -k), the instructions with the most warp-stall samples and their main
reasons. Stall samples count every warp of a program, idle ones included (a warp-specialized kernel's producer
warpgroup parks three of its four warps at a barrier: NOP "barrier" samples).
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
import sys

RAW_METRICS = [  # (column title, metric name)
    ("ms", "gpu__time_duration.sum"),
    ("tensor active %", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"),
    ("IPC", "sm__inst_executed.avg.per_cycle_active"),
    ("instructions", "smsp__inst_executed.sum"),
    ("spill requests", "derived__local_spilling_requests"),
    ("DRAM read % of peak", "dram__bytes_read.sum.pct_of_peak_sustained_elapsed"),
    ("warps active %", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("L2 hit %", "lts__t_sector_hit_rate.pct"),
]
STALLS = ["long_scoreboard", "barrier", "wait", "mio_throttle", "gmma", "dispatch_stall", "short_scoreboard"]


def _rows(path: str) -> list[list[str]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        return list(csv.reader(io.StringIO(f.read())))


def _num(s: str) -> float:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return float("nan")


def raw_table(path: str) -> list[str]:
    rows = _rows(path)
    if len(rows) < 3 or "Kernel Name" not in rows[0]:
        raise ValueError(f"{path}: not an `ncu --page raw --csv` export (no Kernel Name column)")
    hdr, units, data = rows[0], rows[1], rows[2:]
    col = {h: i for i, h in enumerate(hdr)}
    scale = {"gpu__time_duration.sum": {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0}}
    cols = [(t, m) for t, m in RAW_METRICS if m in col]
    stalls = [(s, f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio") for s in STALLS]
    stalls = [(s, m) for s, m in stalls if m in col]
    out = ["| kernel | " + " | ".join(t for t, _ in cols) + " | " +
           " | ".join(f"stall {s}" for s, _ in stalls) + " |",
           "| --- | " + " | ".join("---:" for _ in cols + stalls) + " |"]
    for r in data:
        cells = []
        for _, m in cols:
            v = _num(r[col[m]])
            if m in scale:
                v *= scale[m].get(units[col[m]], 1.0)
                cells.append(f"{v:.3f}")
            elif v >= 1000:
                cells.append(f"{v:,.0f}")
            else:
                cells.append(f"{v:.2f}")
        cells += [f"{_num(r[col[m]]):.2f}" for _, m in stalls]
        out.append(f"| {r[col['Kernel Name']][:60]} | " + " | ".join(cells) + " |")
    return out


def source_table(path: str, top: int) -> list[str]:
    blocks: list[list[list[str]]] = []
    for r in _rows(path):
        if r and r[0] == "Kernel Name":
            blocks.append([])
        elif blocks:
            blocks[-1].append(r)
    if not blocks:
        raise ValueError(f"{path}: not an `ncu --page source --csv` export (no Kernel Name line)")
    out = []
    for n, block in enumerate(blocks):
        hdr, data = block[0], block[1:]
        i_s, i_src = hdr.index("Warp Stall Sampling (All Samples)"), hdr.index("Source")
        reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
        total = sum(_num(r[i_s] or "0") for r in data) or 1.0
        out += ["", f"launch {n + 1}: {total:,.0f} samples; the {top} instructions with the most", "",
                "| samples % | instruction | main reasons (% of all samples) |", "| ---: | --- | --- |"]
        for r in sorted(data, key=lambda r: -_num(r[i_s] or "0"))[:top]:
            main = sorted(((h[6:], _num(r[hdr.index(h)] or "0")) for h in reasons), key=lambda x: -x[1])[:2]
            why = ", ".join(f"{k} {100 * v / total:.1f}" for k, v in main if v > 0)
            out.append(f"| {100 * _num(r[i_s]) / total:.1f} | `{' '.join(r[i_src].split())[:70]}` | {why} |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("raw", help="ncu --page raw --csv export (.csv or .csv.gz)")
    p.add_argument("--source", help="ncu --page source --print-source sass --csv export (.csv or .csv.gz)")
    p.add_argument("--top", type=int, default=12, help="instructions listed per launch (default 12)")
    args = p.parse_args(argv)
    if args.top < 1:
        print(f"error: --top {args.top}: must be at least 1", file=sys.stderr)
        return 2
    try:
        lines = raw_table(args.raw)
        if args.source:
            lines += source_table(args.source, args.top)
    except (OSError, ValueError, IndexError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
