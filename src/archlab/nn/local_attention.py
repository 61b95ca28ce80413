"""Block-local attention: a windowed call as dense calls over query blocks, at O(n·w) instead of O(n²).

Where no query may reach further than `before` keys back and `after` keys ahead (a sliding window; Beltagy
et al. 2020, Longformer; Child et al. 2019 for the blocked form), the queries split into blocks of B rows
and each block sees only the key range its rows can reach:

    queries  [i·B, (i+1)·B)   ->   keys [i·B - before, (i+1)·B + after)      K = B + before + after keys

so a causal window of w keys (before = w - 1) costs B + w - 1 keys per query instead of ~n/2, and memory
is linear in n. The blocks are views (`unfold`) of the zero-padded keys, gathered into one batch of
(b·nb) small dense calls that any dense backend (SDPA, or the eager reference for soft-capping and sinks)
runs with its own forward and backward; the mask and a position bias are computed per block from the same
predicate (MaskSpec.allows) and bias function the dense path uses, so the math has one implementation.
Padded key slots carry position -1, which the predicate never lets a real query see.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from archlab.nn.masks import MaskSpec

__all__ = ["BLOCK", "n_blocks", "key_blocks", "query_blocks", "unblock", "block_positions", "block_spec"]

BLOCK = 64   # query rows per block: keys per query B + w - 1 (64 against 256 or 512 measured fastest at w 256)


def n_blocks(t: int, block: int) -> int:
    return -(-t // block)


def query_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """(b, n, t, e) -> (b·nb, n, B, e): rows [i·B, (i+1)·B) of batch row r at r·nb + i, the tail zero-padded."""
    b, n, t, e = x.shape
    nb = n_blocks(t, block)
    x = F.pad(x, (0, 0, 0, nb * block - t))                                   # (b, n, nb·B, e)
    return x.view(b, n, nb, block, e).transpose(1, 2).reshape(b * nb, n, block, e)


def key_blocks(x: torch.Tensor, t: int, block: int, before: int, after: int) -> torch.Tensor:
    """(b, n, s, e) keys or values (s == t) -> (b·nb, n, K, e): the keys each query block reaches."""
    b, n, s, e = x.shape
    nb, span = n_blocks(t, block), block + before + after
    x = F.pad(x, (0, 0, before, nb * block - s + after))                      # (b, n, before + nb·B + after, e)
    x = x.unfold(2, span, block)                                              # (b, n, nb, e, K), a view
    return x.permute(0, 2, 1, 4, 3).reshape(b * nb, n, span, e)


def unblock(out: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """(b·nb, h, B, e) -> (b, h, t, e): query_blocks undone, the padded tail dropped."""
    rows, h, block, e = out.shape
    nb = rows // b
    return out.view(b, nb, h, block, e).transpose(1, 2).reshape(b, h, nb * block, e)[:, :, :t]


def block_positions(pos: torch.Tensor, t: int, block: int, before: int, after: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, t) positions -> ((r·nb, B) query positions, (r·nb, K) key positions), -1 in padded slots."""
    r, nb, span = pos.shape[0], n_blocks(t, block), block + before + after
    q = F.pad(pos, (0, nb * block - t), value=-1).view(r * nb, block)
    k = F.pad(pos, (before, nb * block - t + after), value=-1).unfold(1, span, block)   # (r, nb, K)
    return q, k.reshape(r * nb, span)


def block_spec(spec: MaskSpec, rows: int, t: int, block: int, before: int, after: int) -> MaskSpec:
    """`spec` for the (rows·nb) blocks: per-row fields repeated per block, key padding cut into key ranges.
    (Segment ids, which index queries and keys alike, have no blocked form here.)"""
    nb, span = n_blocks(t, block), block + before + after
    prefix, padding = spec.prefix_lengths, spec.key_padding
    if prefix is not None:
        prefix = prefix.expand(rows).repeat_interleave(nb)                        # (rows·nb,)
    if padding is not None:
        padding = F.pad(padding.expand(rows, -1), (before, nb * block - t + after), value=False)
        padding = padding.unfold(1, span, block).reshape(rows * nb, span)          # (rows·nb, K)
    return replace(spec, prefix_lengths=prefix, key_padding=padding)
