"""A KV cache that outlives one generate call: a chat's turns share their history, so each turn prefills only the
tokens its prompt does not share with what the cache already holds.

    cache = PrefixCache()
    archlab.generate(model, turn_1_ids, 64, prefix_cache=cache)     # prefills the whole prompt
    archlab.generate(model, turn_2_ids, 64, prefix_cache=cache)     # prefills only what turn 2 adds
    cache.reused, cache.prefilled                                   # the last call's split

The prompt is compared token by token with the ids the cache holds (the last prompt and the tokens decoded after
it): the cache is cropped to the longest common prefix and the rest prefilled, so a template that rewrites earlier
text, or a conversation that dropped its oldest turns, costs a longer prefill, never a wrong answer. At least the
prompt's last token is always fed (its logits choose the first new token). One row, no padding; the cache keeps
every slot of windowed layers (StaticKVCache(rolling=False)) so it can be cropped anywhere.

The cache holds what the calls so far needed (prompt + new tokens), in capacities doubling from CHUNK up to the
model's context: a first turn does not allocate and zero the whole context (377 MB in float32 for SmolLM2's 8,192
positions x 30 layers), and each growth copies the held keys once. `ahead(tokens)` grows between calls, before the
next one needs it (the chat does after each answer), so the growth is not paid inside a turn's time to first token.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np
import torch

from archlab.nn.kv_cache import StaticKVCache

CHUNK = 128      # the least capacity a cache starts with (slots); it doubles from there

def common_prefix(held: Sequence[int], ids: Sequence[int], limit: int | None = None) -> int:
    """How many leading tokens `held` and `ids` share, at most `limit`.
    Example: common_prefix([1, 2, 3], [1, 2, 4]) == 2"""
    n = min(len(held), len(ids), len(ids) if limit is None else limit)
    if n <= 0:
        return 0
    differ = np.flatnonzero(np.asarray(held[:n], dtype=np.int64) != np.asarray(ids[:n], dtype=np.int64))
    return int(differ[0]) if len(differ) else n


def capacity(need: int, limit: int, have: int = CHUNK) -> int:
    """Slots for `need` tokens: `have` doubled until it holds them, at most `limit`.
    Example: capacity(300, 8192) == 512; capacity(300, 8192, have=512) == 512"""
    size = max(have, 1)
    while size < need:
        size *= 2
    return min(size, limit)


class PrefixCache:
    """The KV cache of one sequence kept across generate / stream calls (one model; another model, dtype or device
    starts it afresh; call reset() after changing the model's weights, whose old keys and values it still holds).
    Example: cache = PrefixCache(); archlab.generate(model, ids, 32, prefix_cache=cache)"""

    def __init__(self) -> None:
        self.cache: StaticKVCache | None = None
        self._held: list[int] = []                       # ids whose keys and values the cache holds, in order
        self._pending: list[torch.Tensor] = []           # fed since, as (1, m) tensors (no host sync per step)
        self._owner: weakref.ref | None = None
        self._kind: tuple | None = None
        self.reused = 0                                  # the last call: prompt tokens found in the cache
        self.prefilled = 0                               # ... and prompt tokens prefilled

    def reset(self) -> None:
        """Forget everything held (the next call prefills its whole prompt)."""
        self.cache, self._held, self._pending, self._owner, self._kind = None, [], [], None, None

    @property
    def ids(self) -> list[int]:
        """The token ids the cache holds."""
        if self._pending:
            self._held.extend(torch.cat(self._pending, 1)[0].tolist())
            self._pending = []
        return self._held

    def open(self, model, prompt: torch.Tensor, dtype: torch.dtype, device: torch.device,
             need: int | None = None) -> StaticKVCache:
        """The cache for `model`, cropped to its longest common prefix with `prompt` (1, t) (at most t - 1 tokens),
        with at least `need` slots (the prompt and the tokens to come; None: the model's whole context); sets `reused`
        and `prefilled`."""
        config = model.config
        kind = (config.max_seq_len, dtype, str(device))
        need = config.max_seq_len if need is None else min(need, config.max_seq_len)
        if self.cache is None or self._owner is None or self._owner() is not model or self._kind != kind:
            self.reset()
            self.cache = StaticKVCache(config, 1, capacity(need, config.max_seq_len), dtype=dtype, device=device,
                                       rolling=False)
            self._owner, self._kind = weakref.ref(model), kind
        held, ids = self.ids, prompt[0].tolist()
        common = common_prefix(held, ids, len(ids) - 1)
        assert self.cache is not None
        self.cache.crop(common)
        self.cache.grow(capacity(need, config.max_seq_len, self.cache.max_len))   # the kept tokens copied once
        del held[common:]
        self.reused, self.prefilled = common, len(ids) - common
        return self.cache

    def ahead(self, tokens: int) -> None:
        """Grow now, between calls, to hold the tokens held plus `tokens` more (at most the context), so that a next
        call needing no more does not grow inside its own time to first token: a growth copies every held key (14 ms
        of a 190 ms turn crossing 1,024 slots on SmolLM2-135M). `archlab chat` calls it after each answer with twice
        the last turn's prefill plus its --max-new-tokens: what the next turn needs if its message is at most about
        twice as long (a longer one still grows in its own turn). Example: cache.ahead(2 * cache.prefilled + 256)"""
        if self.cache is None or self._kind is None:
            return
        limit = self._kind[0]                                                  # the model's max_seq_len
        self.cache.grow(capacity(min(len(self.ids) + tokens, limit), limit, self.cache.max_len))

    def fed(self, tokens: torch.Tensor) -> None:
        """Tokens (1, m) just written to the cache."""
        self._pending.append(tokens.detach())

    def dropped(self, n: int) -> None:
        """The last n tokens written were cropped from the cache (rejected drafts)."""
        ids = self.ids
        del ids[len(ids) - n:]
