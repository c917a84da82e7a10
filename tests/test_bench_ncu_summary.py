"""bench/ncu_summary.py: the per-kernel table and the most-stalled instructions from Nsight Compute's CSV
exports (small hand-written exports in its format), --help, and bad input as one line with exit 2."""
from __future__ import annotations

import gzip

from tests.util import run_entry

RAW = (
    '"ID","Kernel Name","gpu__time_duration.sum","sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",'
    '"derived__local_spilling_requests","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"\n'
    '"","","usecond","%","",""\n'
    '"0","kern_a","1,500.00","56.4","5881856","3.61"\n'
    '"1","kern_b","250.00","0","0","70.75"\n')
SOURCE = (
    '"Kernel Name","kern_a",\n'
    '"Address","Source","Warp Stall Sampling (All Samples)","stall_long_sb","stall_barrier",'
    '"stall_long_sb (Not Issued)"\n'
    '"0x10","NOP","30","0","30","0"\n'
    '"0x20","LOP3.LUT R1, R1, 0x80000000, RZ, 0x3c, !PT","60","55","0","55"\n'
    '"0x30","FFMA R2, R3, R4, R5","10","1","0","1"\n')


def run(*args):
    return run_entry("bench/ncu_summary.py", *args, timeout=60)


def test_table_and_top_instructions(tmp_path):
    raw = tmp_path / "raw.csv.gz"
    with gzip.open(raw, "wt") as f:
        f.write(RAW)
    src = tmp_path / "source.csv"
    src.write_text(SOURCE)
    r = run(str(raw), "--source", str(src), "--top", "2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "| kernel | ms | tensor active % | spill requests | stall long_scoreboard |"
    assert lines[2] == "| kern_a | 1.500 | 56.40 | 5,881,856 | 3.61 |"  # µs → ms, thousands separated
    assert lines[3] == "| kern_b | 0.250 | 0.00 | 0.00 | 70.75 |"
    assert "launch 1: 100 samples; the 2 instructions with the most" in r.stdout
    top = [ln for ln in lines if ln.startswith("| 60.0") or ln.startswith("| 30.0") or ln.startswith("| 10.0")]
    assert top == ["| 60.0 | `LOP3.LUT R1, R1, 0x80000000, RZ, 0x3c, !PT` | long_sb 55.0 |",
                   "| 30.0 | `NOP` | barrier 30.0 |"]  # the third is past --top


def test_help_and_bad_input(tmp_path):
    r = run("--help")
    assert r.returncode == 0 and "Nsight Compute" in r.stdout
    bad = tmp_path / "bad.csv"
    bad.write_text('"a","b"\n"1","2"\n')
    r = run(str(bad))
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: {bad}: not an `ncu --page raw --csv` export (no Kernel Name column)"
    raw = tmp_path / "raw.csv"
    raw.write_text(RAW)
    r = run(str(raw), "--source", str(bad))
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: {bad}: not an `ncu --page source --csv` export (no Kernel Name line)"
    r = run(str(tmp_path / "missing.csv"))
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "missing.csv" in r.stderr
    r = run(str(raw), "--top", "0")
    assert r.returncode == 2 and r.stderr.strip() == "error: --top 0: must be at least 1"
