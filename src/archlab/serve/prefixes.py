"""The server's prefix cache: which token ids each row of the slot KV cache holds, and which row a new request takes.

A finished request leaves its keys and values in its row. A new request's prompt is compared with what every row
holds (the finished ones and those still decoding); the longest common token prefix is kept and only the rest
prefilled (vLLM's automatic prefix caching and SGLang's RadixAttention do this per block of tokens; here the unit
is a row). The request takes

- the row it matched when that row is free and the prompt extends all it holds (a chat's next turn): in place;
- else the least recently used free row (an empty one first), the matched prefix copied into it from the row that
  holds it, which keeps its own tokens (another conversation sharing a system prompt, a sibling choice of n).

Memory is what the slot cache was built with (rows x context, archlab.nn.kv_cache.SlotKVCache): nothing grows,
a request evicts the least recently used row's tokens when it needs that row. At least the prompt's last token is
always prefilled (its logits choose the first new token).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from archlab.generation.prefix import common_prefix
from archlab.nn.kv_cache import SlotKVCache

__all__ = ["Placement", "SlotPrefixes"]


@dataclass(frozen=True)
class Placement:
    """Where a request goes: its row, how many prompt tokens it finds there, and the row they come from (the
    same row: kept in place; another: copied; None: nothing reused)."""
    row: int
    cached: int
    source: int | None


class SlotPrefixes:
    """The ids each row of `slots` holds, and the rows' last use (least recently used evicted first).
    enabled=False: every request takes a free row and prefills its whole prompt (the server without the cache).
    Example: place = prefixes.place(ids, free_rows, held_of_active); prefixes.apply(place)"""

    def __init__(self, slots: SlotKVCache, enabled: bool = True):
        self.slots, self.enabled = slots, enabled
        rows = len(slots.length)
        # ids a free row's keys and values are of, as arrays: a placement compares the prompt with every row
        self.held: list[Sequence[int]] = [[] for _ in range(rows)]
        self.used = [-1] * rows                                  # the clock at each row's last use; -1: never
        self._clock = 0

    def place(self, ids: list[int], free: list[int], active: dict[int, list[int]]) -> Placement:
        """The row for prompt `ids` among `free` rows; `active`: the ids each decoding row holds so far."""
        target = min(free, key=lambda r: (self.used[r], r))      # least recently used (empty rows: -1)
        if not self.enabled:
            return Placement(target, 0, None)
        best, source, prompt = 0, None, np.asarray(ids, dtype=np.int64)
        for row in sorted(range(len(self.held)), key=lambda r: -self.used[r]):   # the most recent first on a tie
            held = active[row] if row in active else self.held[row]
            common = common_prefix(held, prompt, len(ids) - 1) if len(held) and held[0] == ids[0] else 0
            if common > best:
                best, source = common, row
        if source is None:
            return Placement(target, 0, None)
        held = active.get(source, self.held[source])
        if source in free and (best == len(held) or source == target):   # nothing else of that row is lost
            return Placement(source, best, source)
        return Placement(target, best, source)

    def apply(self, place: Placement) -> None:
        """Make the row hold the placement's prefix (cropped in place or copied), and mark both rows used."""
        self._clock += 1
        if place.source is None:
            self.slots.reset(place.row)
        elif place.source == place.row:
            self.slots.crop(place.row, place.cached)
        else:
            self.slots.copy(place.source, place.row, place.cached)
            self.used[place.source] = self._clock
        self.held[place.row] = []                                # decoding: its ids come from its request
        self.used[place.row] = self._clock

    def release(self, row: int, ids: list[int] | None) -> None:
        """A request left `row`: its keys and values are of `ids` (every token fed), or None: not to be trusted
        (a failed forward), the row is emptied."""
        if ids is None or not self.enabled:
            self.slots.reset(row)
            self.held[row], self.used[row] = [], -1
            return
        self._clock += 1
        self.held[row], self.used[row] = np.asarray(ids, dtype=np.int64), self._clock

    @property
    def held_tokens(self) -> int:
        """Tokens the free rows hold for later requests."""
        return sum(len(h) for h in self.held)
