"""The online-softmax walkthrough: the classic example's numbers, random inputs vs plain softmax, and the CLI."""
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kernels.online_softmax import (EXAMPLE_BLOCK_SIZE, EXAMPLE_KEYS, EXAMPLE_Q, EXAMPLE_VALUES, main,
                                    online_softmax, parse_rows, parse_vector, plain_softmax_attention)

ROOT = Path(__file__).resolve().parents[1]


def classic():
    q = parse_vector(EXAMPLE_Q, "q")
    keys, values = parse_rows(EXAMPLE_KEYS, "keys"), parse_rows(EXAMPLE_VALUES, "values")
    return q, keys, values


def test_classic_example_matches_its_published_figures():
    q, keys, values = classic()
    s1, s2 = online_softmax(q, keys, values, EXAMPLE_BLOCK_SIZE, scale=1.0)
    # The example's figures as the walkthrough states them (full precision), tolerance 1e-3.
    assert s1.m == pytest.approx(2, abs=1e-3)
    assert s1.l == pytest.approx(1.368, abs=1e-3)
    assert s1.O[0] == pytest.approx(5.839, abs=1e-3)
    assert s2.m == pytest.approx(3, abs=1e-3)
    assert s2.l == pytest.approx(1.639, abs=1e-3)
    assert s2.O[0] == pytest.approx(9.096, abs=1e-3)
    assert s2.O[0] / s2.l == pytest.approx(5.551, abs=1e-3)
    # ... and they are exactly the closed forms.
    e1, e2 = math.exp(-1), math.exp(-2)
    assert s1.l == pytest.approx(1 + e1, rel=1e-14)
    assert s2.O[0] == pytest.approx((4 + 5 * e1) * e1 + 6 + 7 * e2, rel=1e-14)
    assert s2.O[0] / s2.l == pytest.approx(plain_softmax_attention(q, keys, values, 1.0)[0], rel=1e-14)


def test_hand_rounded_figures_come_from_rounding_the_factor():
    # Rounding exp(-1) to 0.368 and exp(-2) to 0.135 reproduces the hand-written 5.840 / 1.638 / 9.094.
    r1, r2 = 0.368, 0.135
    O1 = 4 + 5 * r1
    l2 = (1 + r1) * r1 + 1 + r2
    O2 = O1 * r1 + 6 + 7 * r2
    assert (round(O1, 3), round(l2, 3), round(O2, 3)) == (5.840, 1.638, 9.094)


@pytest.mark.parametrize("block_size", [1, 2, 3, 7, 64, 1000])
@pytest.mark.parametrize("dv", [1, 5])
def test_random_inputs_match_plain_softmax(block_size, dv):
    rng = np.random.default_rng(block_size * 10 + dv)
    N, d = 37, 8
    q, keys, values = rng.normal(size=d), rng.normal(size=(N, d)) * 3, rng.normal(size=(N, dv))
    scale = 1 / math.sqrt(d)
    states = online_softmax(q, keys, values, block_size, scale)
    assert len(states) == math.ceil(N / block_size)
    for st in states:  # every intermediate O / l is the softmax average over the keys seen so far
        np.testing.assert_allclose(st.O / st.l, plain_softmax_attention(q, keys[:st.last], values[:st.last], scale),
                                   rtol=1e-12, atol=1e-12)
    # the final m is the global max and l the softmax denominator relative to it
    s = scale * keys @ q
    assert states[-1].m == pytest.approx(s.max(), rel=1e-14)
    assert states[-1].l == pytest.approx(np.exp(s - s.max()).sum(), rel=1e-12)


def test_large_scores_do_not_overflow():
    q = np.array([1.0])
    keys = np.array([[1000.0], [2000.0], [-3000.0]])
    values = np.array([[1.0], [2.0], [3.0]])
    (*_, last) = online_softmax(q, keys, values, 1)
    assert last.O[0] / last.l == pytest.approx(2.0)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "kernels.online_softmax", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_cli_classic_example():
    r = run_cli()
    assert r.returncode == 0, r.stderr
    lines = [line.strip() for line in r.stdout.splitlines()]
    for expected in ["m = 2", "l = 1.368", "O = 5.839", "m = 3", "l = 1.639", "O = 9.096", "result = O / l = 5.551"]:
        assert any(line.startswith(expected) for line in lines), (expected, r.stdout)
    assert "check: plain softmax gives 5.551" in r.stdout and "OK" in r.stdout
    assert "MISMATCH" not in r.stdout
    assert "5.840" in r.stdout and "1.638" in r.stdout and "9.094" in r.stdout  # the rounding remark


def test_cli_explicit_options_and_vector_values():
    r = run_cli("--q", "1,2", "--keys", "0,1;1,0;1,1;1,0", "--values", "4;5;6;7", "--block-size", "2",
                "--scale", "1")
    assert r.returncode == 0, r.stderr
    assert "result = O / l = 5.551" in r.stdout
    r = run_cli("--q", "1,0,2", "--keys", "1,1,1;0,2,0;3,0,1", "--values", "1,0;0,1;2,2", "--block-size", "2",
                "--scale", "auto")
    assert r.returncode == 0, r.stderr
    assert "MISMATCH" not in r.stdout and r.stdout.count("OK") == 3


def test_cli_help():
    r = run_cli("--help")
    assert r.returncode == 0 and "--block-size" in r.stdout and "--values" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--q", "1,2", "--keys", "0,1;1,0,1", "--values", "4;5"], "different lengths"),
    (["--q", "1,2,3", "--keys", "0,1;1,0", "--values", "4;5"], "components"),
    (["--q", "1,2", "--keys", "0,1;1,0", "--values", "4;5;6"], "values"),
    (["--q", "", "--keys", "0,1", "--values", "4"], "--q"),
    (["--keys", "", "--values", "4"], "empty"),
    (["--q", "1,x"], "not a number"),
    (["--block-size", "0"], "--block-size"),
    (["--scale", "big"], "--scale"),
])
def test_bad_input_is_one_line_error(args, message, capsys):
    # In-process (each subprocess pays for importing torch via kernels/__init__); one subprocess case below.
    assert main(args) != 0
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], captured.err
    assert captured.out == ""


def test_cli_bad_input_exits_nonzero_with_one_line():
    r = run_cli("--q", "1,2", "--keys", "0,1;1,0", "--values", "4;5;6")
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == ""


def test_main_in_process(capsys):
    assert main(["--block-size", "4"]) == 0
    assert "result = O / l = 5.551" in capsys.readouterr().out
