"""Summarise an nvidia-smi log of clocks and power: is the GPU power-capped while a benchmark runs?

    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
        --format=csv,noheader -lms 25 > smi.csv &      # while the benchmark runs
    python bench/power_summary.py smi.csv [--min-watts 300] [--bucket-s 0.5]

Prints one row per time bucket in which the power reached --min-watts: SM clock range, power range, and the
share of samples with the software power cap active (bit 0x4 of clocks_event_reasons.active).
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys

SW_POWER_CAP = 0x4


def read(path: str) -> list[tuple]:
    """(time, SM MHz, watts, °C, event-reason bits) per sample; lines that do not parse are skipped."""
    rows = []
    with open(path) as f:
        for line in f:
            p = [x.strip() for x in line.split(",")]
            try:
                rows.append((dt.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f"), int(p[1].split()[0]),
                             float(p[3].split()[0]), int(p[4]), int(p[5], 16)))
            except (ValueError, IndexError):
                continue
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--min-watts", type=float, default=300.0)
    ap.add_argument("--bucket-s", type=float, default=0.5)
    args = ap.parse_args(argv)
    try:
        rows = read(args.csv)
    except OSError as e:
        print(f"error: cannot read {args.csv!r}: {e.strerror}", file=sys.stderr)
        return 1
    if not rows:
        print(f"error: no nvidia-smi samples in {args.csv!r}", file=sys.stderr)
        return 1
    t0 = rows[0][0]
    buckets: dict[int, list] = {}
    for r in rows:
        buckets.setdefault(int((r[0] - t0).total_seconds() / args.bucket_s), []).append(r)
    print("| t (s) | time | SM clock (MHz) | power (W) | power cap active |")
    print("| --- | --- | --- | --- | --- |")
    for k in sorted(buckets):
        b = buckets[k]
        if max(x[2] for x in b) < args.min_watts:
            continue
        capped = sum(1 for x in b if x[4] & SW_POWER_CAP) / len(b)
        print(f"| {k * args.bucket_s:.1f} | {b[0][0]:%H:%M:%S} | {min(x[1] for x in b)}–{max(x[1] for x in b)} | "
              f"{min(x[2] for x in b):.0f}–{max(x[2] for x in b):.0f} | {capped:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
