"""Stop strings (data/stop_text.py): where a reply's text is cut, what a stream holds back, and the check that
ends a sequence in model.generation.generate."""
from __future__ import annotations

from data.stop_text import cut, first_stop, held_back, stop_check


def test_cut_at_the_earliest_stop_string():
    assert cut("one\n\ntwo END three", ("END", "\n\n")) == "one"
    assert cut("no stop here", ("END",)) == "no stop here"
    assert first_stop("abcabc", ("ca", "bc")) == 1 and first_stop("abc", ("x",)) is None


def test_held_back_is_the_longest_end_that_may_become_a_stop():
    assert held_back("the en", ("END", " end.")) == 3      # " en" starts " end."
    assert held_back("the E", ("END",)) == 1
    assert held_back("the END", ("END",)) == 0             # a whole stop is not held back: it is cut
    assert held_back("nothing", ("END",)) == 0


def test_stop_check_decodes_only_the_tail():
    decoded = []

    def decode(ids):
        decoded.append(len(ids))
        return "".join(chr(ord("a") + i) for i in ids)
    check = stop_check(decode, ("cd",))
    reply = list(range(30))
    assert not check(0, reply[:3]) and check(0, reply[:4])  # "abc", then "abcd"
    assert check(0, [0, 1, 2, 3] + [20] * 40) is False      # the stop lies before the decoded tail
    assert max(decoded) == len("cd") + 8
