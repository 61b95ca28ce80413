"""How long the server's KV cache rows are by default: the model's context, unless that would not fit.

`SlotKVCache` keeps every row the full row length for every layer, so rows x context x bytes per token is
reserved at startup whatever the requests ask for: Gemma 3 270M's 32,768-token context at 8 rows is 9.0 GiB.
By default a row is the model's context cut to fit a budget (`cache_budget`: 2 GiB or a quarter of the free
memory, the smaller); `archlab serve --context N` sets it outright.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CachePlan", "cache_budget", "row_tokens", "DEFAULT_BUDGET", "STEP"]

DEFAULT_BUDGET = 2 * 2 ** 30     # bytes: a laptop serves a small model without flags
STEP = 256                       # a cut context is a multiple of this many tokens


@dataclass(frozen=True)
class CachePlan:
    """`tokens` a row holds; `cut`: the model's context was shortened to fit `budget` bytes."""
    tokens: int
    cut: bool
    budget: int


def cache_budget(available: int | None, budget: int = DEFAULT_BUDGET) -> int:
    """The default cache's bytes: `budget`, or a quarter of `available` (free memory) when that is less.
    Example: cache_budget(4 * 2**30) == 2**30"""
    return budget if available is None else min(budget, available // 4)


def row_tokens(context: int, rows: int, per_token: int, budget: int) -> CachePlan:
    """Tokens each of `rows` rows holds by default: the model's `context` if rows x context x `per_token`
    bytes fit in `budget`, else the most that do, rounded down to a multiple of STEP (never below STEP or
    above `context`). Example: row_tokens(32768, 8, 36864, 2 * 2**30) == CachePlan(7168, True, 2 * 2**30)"""
    if rows * context * per_token <= budget:
        return CachePlan(context, False, budget)
    fit = budget // max(1, rows * per_token) // STEP * STEP
    return CachePlan(min(context, max(STEP, fit)), True, budget)
