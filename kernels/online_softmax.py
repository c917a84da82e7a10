"""Online softmax, step by step: the blockwise update at the heart of FlashAttention.

Attention for one query q over keys k_1..k_N with values v_1..v_N is

    out = sum_j softmax(s)_j v_j,    s_j = scale * (q . k_j)

Plain softmax needs every score before it can normalise. FlashAttention instead walks over the keys one
block at a time and keeps only three running quantities:

    m  the largest score seen so far                       (a number)
    l  sum_j exp(s_j - m) over the keys seen so far         (a number: the softmax denominator)
    O  sum_j exp(s_j - m) * v_j over the keys seen so far   (shaped like a value: NOT yet divided by l)

When a new block arrives with scores s_B, the maximum may grow from m_old to m_new; every term already in l and
O was computed relative to m_old, so both are multiplied by the rescaling factor exp(m_old - m_new) before the
new block's terms are added:

    m_new = max(m_old, max(s_B))
    l_new = l_old * exp(m_old - m_new) + sum_{j in B} exp(s_j - m_new)
    O_new = O_old * exp(m_old - m_new) + sum_{j in B} exp(s_j - m_new) * v_j

After the last block, out = O / l. At every step O / l is exactly the softmax-weighted average over the keys
seen so far; this module checks that after every block and at the end, against plain softmax.

Run it:
    python -m kernels.online_softmax                     # the classic two-block example
    python -m kernels.online_softmax --q 1,2 --keys "0,1;1,0;1,1;1,0" --values "4;5;6;7" --block-size 2
    python -m kernels.online_softmax --help

Vectors are comma-separated numbers; lists of vectors are separated by ';'. Values may be numbers ("4;5") or
vectors of any common length ("4,0;5,1"). Everything is computed in float64 with numpy.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import numpy as np

# The classic example (no scaling): two blocks of two keys.
EXAMPLE_Q = "1,2"
EXAMPLE_KEYS = "0,1;1,0;1,1;1,0"
EXAMPLE_VALUES = "4;5;6;7"
EXAMPLE_BLOCK_SIZE = 2

ROUNDING_REMARK = (
    "Note: hand-rounded write-ups of this example show O = 5.840 after block 1 and l = 1.638, O = 9.094 after "
    "block 2, because they round exp(-1) to 0.368 (and exp(-2) to 0.135) before using it: 4 + 5*0.368 = 5.840, "
    "1.368*0.368 + 1 + 0.135 = 1.638, 5.840*0.368 + 6 + 7*0.135 = 9.094. Carrying full precision gives "
    "5.839, 1.639 and 9.096, as printed above; both round to the same final answer, 5.55.")


@dataclass
class BlockState:
    """The running state (m, l, O) after one block of keys."""
    index: int              # 1-based block number
    first: int              # 1-based index of the block's first key
    last: int               # 1-based index of the block's last key
    scores: np.ndarray      # (n,) the block's scaled scores s_j
    m_old: float            # the maximum before this block (-inf before the first)
    rescale: float          # exp(m_old - m): how much the old l and O shrink
    m: float
    l: float
    O: np.ndarray           # (dv,) unnormalised accumulator sum exp(s_j - m) v_j


def plain_softmax_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float) -> np.ndarray:
    """The reference: all scores at once, softmax, weighted sum. Returns (dv,)."""
    s = scale * (keys @ q)          # (N,)
    p = np.exp(s - s.max())
    p /= p.sum()                    # softmax(s)
    return p @ values               # (dv,)


def online_softmax(q: np.ndarray, keys: np.ndarray, values: np.ndarray, block_size: int,
                   scale: float = 1.0) -> list[BlockState]:
    """Walk over the keys block by block, returning the state after each block; the answer is O / l of the last.

    q: (d,); keys: (N, d); values: (N, dv).
    """
    m, l = -math.inf, 0.0
    O = np.zeros(values.shape[1])
    states = []
    for b, start in enumerate(range(0, len(keys), block_size), start=1):
        k_blk, v_blk = keys[start:start + block_size], values[start:start + block_size]
        s = scale * (k_blk @ q)                 # (n,) this block's scores
        m_new = max(m, float(s.max()))          # the new running maximum
        alpha = math.exp(m - m_new)             # rescale factor for the old state (exp(-inf) = 0 at the start)
        p = np.exp(s - m_new)                   # (n,) this block's unnormalised weights
        l = l * alpha + float(p.sum())
        O = O * alpha + p @ v_blk               # (dv,)
        states.append(BlockState(b, start + 1, start + len(k_blk), s, m, alpha, m_new, l, O.copy()))
        m = m_new
    return states


# ----------------------------------------------------------------------------------------------- printing
def fmt(x) -> str:
    """A number with 3 decimals and no trailing zeros (2.000 -> 2), or a vector of such numbers."""
    if isinstance(x, np.ndarray) or isinstance(x, (list, tuple)):
        items = [fmt(float(v)) for v in np.ravel(x)]
        return items[0] if len(items) == 1 else "[" + ", ".join(items) + "]"
    if math.isinf(x):
        return "-inf" if x < 0 else "inf"
    text = f"{x:.3f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def walkthrough(q, keys, values, block_size, scale, out=print) -> bool:
    """Print every block's state and the checks against plain softmax. Returns True if all checks pass."""
    states = online_softmax(q, keys, values, block_size, scale)
    tol = 1e-9 * (1.0 + float(np.abs(values).max()))  # float64 round-off, relative to the values' size
    out(f"q = {fmt(q)}, {len(keys)} keys in blocks of {block_size}, scale = {fmt(scale)}")
    ok = True
    for st in states:
        out(f"block {st.index} (keys {st.first}..{st.last}): scores s = {fmt(st.scores)}")
        out(f"  m = {fmt(st.m)}    (max of previous m = {fmt(st.m_old)} and the block's scores;"
            f" rescale factor exp(m_old - m) = {fmt(st.rescale)})")
        out(f"  l = {fmt(st.l)}")
        out(f"  O = {fmt(st.O)}")
        running = st.O / st.l
        expected = plain_softmax_attention(q, keys[:st.last], values[:st.last], scale)
        good = np.allclose(running, expected, rtol=0, atol=tol)
        ok &= good
        out(f"  O / l = {fmt(running)}  vs plain softmax over keys 1..{st.last}: {fmt(expected)}"
            f"  {'OK' if good else 'MISMATCH'}")
    last = states[-1]
    result = last.O / last.l
    expected = plain_softmax_attention(q, keys, values, scale)
    good = np.allclose(result, expected, rtol=0, atol=tol)
    ok &= good
    out(f"result = O / l = {fmt(result)}")
    out(f"check: plain softmax gives {fmt(expected)} (max difference {np.abs(result - expected).max():.1e})"
        f" {'OK' if good else 'MISMATCH'}")
    return ok


# ----------------------------------------------------------------------------------------------- the CLI
def parse_vector(text: str, what: str) -> np.ndarray:
    """'1,2' -> array([1., 2.])."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(p == "" for p in parts):
        raise ValueError(f"{what}: expected comma-separated numbers, got {text!r}")
    try:
        return np.array([float(p) for p in parts])
    except ValueError:
        raise ValueError(f"{what}: not a number in {text!r}") from None


def parse_rows(text: str, what: str) -> np.ndarray:
    """'0,1;1,0' -> array([[0., 1.], [1., 0.]]); every row must have the same length."""
    if not text.strip():
        raise ValueError(f"{what}: empty")
    rows = [parse_vector(r, f"{what} row {i + 1}") for i, r in enumerate(text.strip().strip(";").split(";"))]
    if len({len(r) for r in rows}) != 1:
        raise ValueError(f"{what}: rows have different lengths {[len(r) for r in rows]}")
    return np.stack(rows)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m kernels.online_softmax",
        description="Replay the online-softmax update (m, l, O) block by block and check it against plain "
                    "softmax. Without options it runs the classic two-block example.",
        epilog='example: --q 1,2 --keys "0,1;1,0;1,1;1,0" --values "4;5;6;7" --block-size 2 --scale 1')
    parser.add_argument("--q", default=EXAMPLE_Q, help="the query vector, comma-separated (default %(default)s)")
    parser.add_argument("--keys", default=EXAMPLE_KEYS,
                        help="key vectors separated by ';', each comma-separated (default %(default)r)")
    parser.add_argument("--values", default=EXAMPLE_VALUES,
                        help="one value per key, separated by ';'; a value may be a comma-separated vector "
                             "(default %(default)r)")
    parser.add_argument("--block-size", type=int, default=EXAMPLE_BLOCK_SIZE,
                        help="keys per block (default %(default)s)")
    parser.add_argument("--scale", default="1",
                        help="score scale: a number, or 'auto' for 1/sqrt(d) as in attention "
                             "(default %(default)s: no scaling)")
    return parser.parse_args(argv)


def load_inputs(args: argparse.Namespace):
    """Validate the CLI inputs. Returns (q, keys, values, block_size, scale) or raises ValueError."""
    q = parse_vector(args.q, "--q")
    keys = parse_rows(args.keys, "--keys")
    values = parse_rows(args.values, "--values")
    if keys.shape[1] != len(q):
        raise ValueError(f"--keys have {keys.shape[1]} components but --q has {len(q)}")
    if len(values) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(values)} values")
    if args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {args.block_size}")
    if args.scale == "auto":
        scale = 1.0 / math.sqrt(len(q))
    else:
        try:
            scale = float(args.scale)
        except ValueError:
            raise ValueError(f"--scale: expected a number or 'auto', got {args.scale!r}") from None
    if not all(np.isfinite(a).all() for a in (q, keys, values)) or not math.isfinite(scale):
        raise ValueError("inputs must be finite numbers")
    return q, keys, values, args.block_size, scale


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        q, keys, values, block_size, scale = load_inputs(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ok = walkthrough(q, keys, values, block_size, scale)
    is_example = (args.q, args.keys, args.values, block_size, scale) == (
        EXAMPLE_Q, EXAMPLE_KEYS, EXAMPLE_VALUES, EXAMPLE_BLOCK_SIZE, 1.0)
    if is_example:
        print(ROUNDING_REMARK)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
