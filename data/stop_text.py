"""Stop strings: a reply ends where its text first holds one of them (generate.py --stop), whatever tokens spell it.

    check = stop_check(tok.decode, stops)   # check(b, reply tokens so far) -> True once the text holds a stop
    cut(text, stops) -> text                # the reply's text up to the first stop string (excluded)
    held_back(text, stops) -> int           # characters at the end that may still become a stop string: a
                                            # stream prints all but these
"""
from __future__ import annotations

from typing import Callable, Sequence

TAIL_SLACK = 8  # tokens decoded beyond the longest stop's length in characters (a token may decode to none)


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the earliest of `stops` starts in text, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def cut(text: str, stops: Sequence[str]) -> str:
    """text up to the first stop string (excluded); all of it where none occurs."""
    i = first_stop(text, stops)
    return text if i is None else text[:i]


def held_back(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of text that is the start of a stop string (shorter than it)."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def stop_check(decode: Callable[[list[int]], str], stops: Sequence[str]) -> Callable[[int, list[int]], bool]:
    """For model.generation.generate's stop_check: whether a sequence's reply tokens now hold a stop string in their
    text. Only the last tokens are decoded (enough for the longest stop plus TAIL_SLACK): an occurrence that ends
    before them was found at an earlier step."""
    window = max(len(s) for s in stops) + TAIL_SLACK

    def check(b: int, reply: list[int]) -> bool:
        return first_stop(decode(reply[-window:]), stops) is not None
    return check
