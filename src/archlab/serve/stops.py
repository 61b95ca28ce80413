"""Stop strings in a streamed completion, as vLLM handles them: the text is cut just before the first stop
string anywhere in it (OpenAI's rule), and a delta never carries text that a later token could turn into the
start of a stop, so the streamed deltas join to exactly the non-streamed text.

    text so far  " ant at th"   stops [" the"]   ->  releasable 7: " ant at" goes out, " th" waits
    next token   " ant at the"                   ->  first_stop 7: the completion ends as " ant at"

A stop found in the text ends the completion only once no stop that starts earlier can still form
(`settled_stop`): with stops [" ", "a a"], the text "a " waits, since "a a" may come and its start is leftmost.
"""
from __future__ import annotations

from collections.abc import Sequence

__all__ = ["first_stop", "releasable", "settled_stop"]

UNFINISHED = "\ufffd"      # what a partly decoded multi-byte character decodes to, until its last byte comes


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the completion ends: the start of the earliest stop string in `text`, or None."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(found) if found else None


def settled_stop(text: str, stops: Sequence[str]) -> int | None:
    """`first_stop`, once it is final: None while a tail that starts before the found stop is still the
    beginning of a longer stop string (the next tokens may complete it, and the leftmost occurrence wins)."""
    cut = first_stop(text, stops)
    if cut is None:
        return None
    for start in range(cut):
        tail = text[start:].rstrip(UNFINISHED)
        if any(len(stop) > len(tail) and stop.startswith(tail) for stop in stops):
            return None
    return cut


def releasable(text: str, stops: Sequence[str]) -> int:
    """How much of `text` (in which no stop occurs) may be sent: all but a trailing partly decoded character
    and, before it, the longest tail that is the beginning of a stop string (it may still become one)."""
    end = len(text.rstrip(UNFINISHED))
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, end), held, -1):     # longest first; shorter than `held` cannot win
            if text.startswith(stop[:k], end - k):
                held = k
                break
    return end - held
