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

Longformer's two additions ride on the same blocks:
  dilated window (d)   the keys i, i-d, i-2d, ... of query i share its residue mod d, so each residue class is
                       a plain window over a sequence d times shorter: the classes become batch rows
  global tokens (G)    their keys are appended to every block's keys (masked where the block's range already
                       holds them), and their own query rows, which see every key, run as one dense call
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from archlab.nn.attention_backends import AttnCall, Backend, dense_choice, register
from archlab.nn.masks import MaskSpec

__all__ = ["BLOCK", "BlockLocal", "n_blocks", "key_blocks", "query_blocks", "unblock", "block_positions",
           "block_spec", "dilate", "undilate"]

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
    q = F.pad(pos, (0, nb * block - t), value=-1).reshape(r * nb, block)
    k = F.pad(pos, (before, nb * block - t + after), value=-1).unfold(1, span, block)   # (r, nb, K)
    return q, k.reshape(r * nb, span)


def block_spec(spec: MaskSpec, rows: int, t: int, block: int, before: int, after: int) -> MaskSpec:
    """`spec` for the (rows·nb) blocks: per-row fields repeated per block, key padding cut into key ranges,
    segment ids (self-attention's, one per token) cut into query blocks and key ranges alike."""
    nb, span = n_blocks(t, block), block + before + after
    prefix, padding, seg = spec.prefix_lengths, spec.key_padding, spec.segment_ids
    if prefix is not None:
        prefix = prefix.expand(rows).repeat_interleave(nb)                        # (rows·nb,)
    if padding is not None:
        padding = F.pad(padding.expand(rows, -1), (before, nb * block - t + after), value=False)
        padding = padding.unfold(1, span, block).reshape(rows * nb, span)          # (rows·nb, K)
    key_seg = None
    if seg is not None:                       # padded slots in segment -1: their positions (-1) rule them out
        seg = seg.expand(rows, -1)
        key_seg = F.pad(seg, (before, nb * block - t + after), value=-1).unfold(1, span, block)
        key_seg = key_seg.reshape(rows * nb, span)                                 # (rows·nb, K)
        seg = F.pad(seg, (0, nb * block - t), value=-1).reshape(rows * nb, block)  # (rows·nb, B)
    return replace(spec, prefix_lengths=prefix, key_padding=padding, segment_ids=seg, key_segment_ids=key_seg)


def dilate(x: torch.Tensor, d: int, fill: float | bool = 0) -> torch.Tensor:
    """(b, ..., t, [e]) -> (b·d, ..., ceil(t/d), [e]) for a tensor whose time axis is dim -2 (heads) or
    -1 (positions, padding): residue class r of batch row i becomes row i·d + r, the tail padded with `fill`."""
    time = x.dim() - 2 if x.dim() == 4 else x.dim() - 1
    t = x.shape[time]
    pad = [0, 0] * (x.dim() - 1 - time) + [0, n_blocks(t, d) * d - t]
    x = F.pad(x, pad, value=fill)
    x = x.unflatten(time, (-1, d)).movedim(time + 1, 1)                       # (b, d, ..., t/d, [e])
    return x.flatten(0, 1)


def undilate(out: torch.Tensor, d: int, t: int) -> torch.Tensor:
    """(b·d, h, t/d, e) -> (b, h, t, e): dilate undone for a call's output."""
    out = out.unflatten(0, (-1, d)).movedim(1, 3)                             # (b, h, t/d, d, e)
    return out.flatten(2, 3)[:, :, :t]


def _positions_are_indices(call: AttnCall) -> bool:
    """Every row's positions are 0..t-1: the plain path, or (a direct call) one such row."""
    if call.inputs is not None:
        return call.inputs.plain
    pos = call.q_pos
    return pos is not None and pos.shape[0] == 1 and torch.equal(pos[0], torch.arange(pos.shape[1], device=pos.device))


@register(priority=300)
class BlockLocal(Backend):
    """A call whose queries reach a bounded key range (a sliding window, dilated or not, with global
    tokens; a fixed sparse pattern) as dense calls over query blocks, each with only the keys it can reach:
    O(n·(B + w)) for a window, O(n·(l + n·c/l)) for a fixed pattern, not O(n²)."""

    name = "block_local"
    block = BLOCK                      # query rows per block (tests set it small)
    min_saving = 1.0                   # chosen when the full call visits at least this many times the pairs

    def supports(self, call: AttnCall) -> str | None:
        spec = call.spec
        if spec is None or not call.aligned or call.q_pos is None:
            return "a layer's spec over aligned queries and keys (no cache, or a fresh cache's prefill)"
        if spec.key_segment_ids is not None or call.keep_probs or call.bias is not None:
            return "no keys' own segment ids, kept probabilities or bias tensor (a position bias as a function is fine)"
        if spec.segment_ids is not None and (spec.global_indices or spec.pattern == "fixed"):
            return "segment ids without global tokens or a fixed pattern (their keys are indexed by position)"
        layout = self._layout(spec)
        if isinstance(layout, str):
            return layout
        if spec.dilation > 1 and (spec.prefix_lengths is not None or spec.global_indices):
            return "a dilated window without a prefix or global tokens"
        if (spec.global_indices or spec.pattern == "fixed") and not _positions_are_indices(call):
            return "global tokens and fixed patterns index keys by position: positions 0..t-1 (no padding)"
        return None

    def _layout(self, spec: MaskSpec) -> tuple[int, int, int] | str:
        """(query rows per block, keys before and after a block, in index units), or why there is none. A
        fixed pattern's blocks align with its own: each sees its block, and the summary keys as extra keys."""
        if spec.pattern == "fixed" and spec.block_size is not None:
            if spec.prefix_lengths is not None:
                return "a fixed pattern without a prefix"
            return spec.block_size * max(1, self.block // spec.block_size), 0, 0
        before, after = spec.reach()
        if before is None or after is None:
            return "a key range bounded on both sides (a sliding window), or a fixed pattern"
        return self.block, before // spec.dilation, after // spec.dilation

    def prefers(self, call: AttnCall) -> bool:
        """Where the pairs the full call visits (half of them under a causal mask) are `min_saving` times the
        blocks' pairs. Measured forward + backward, 4 heads of 32, 2 cores, window 256: SDPA with the window's
        dense mask 7.4 / 38 / 99 / 476 ms at 512 / 1k / 2k / 4k tokens, blocks of 64: 8.3 / 14 / 19 / 49 ms
        (and below SDPA's mask-free causal kernel from 1k on: 21 / 71 / 144 ms at 1k / 2k / 4k)."""
        assert call.spec is not None
        layout = self._layout(call.spec)
        assert not isinstance(layout, str)
        block, before, after = layout
        t = call.q.shape[2]
        full = t / 2 if call.spec.causal else t
        return full >= self.min_saving * (block + before + after + len(self._extra_indices(call.spec, t)))

    def __call__(self, call: AttnCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        spec = call.spec
        assert spec is not None and call.q_pos is not None
        d, t = spec.dilation, call.q.shape[2]
        if d == 1:
            out = self._blocks(call)
        else:   # each residue class mod d a plain window, as batch rows (positions stay the real ones)
            padding, seg, q_pos = spec.key_padding, spec.segment_ids, call.q_pos
            rows = max(x.shape[0] for x in (q_pos, padding, seg) if x is not None)
            if rows > q_pos.shape[0]:      # per-row padding or documents: per-row positions, dilated alike
                q_pos = q_pos.expand(rows, t)
            q_pos = dilate(q_pos, d, -1)
            padding = None if padding is None else dilate(padding.expand(rows, t), d, False)
            seg = None if seg is None else dilate(seg.expand(rows, t), d, -1)
            classes = replace(call, q=dilate(call.q, d), k=dilate(call.k, d), v=dilate(call.v, d), q_pos=q_pos,
                              spec=replace(spec, key_padding=padding, segment_ids=seg))
            out = undilate(self._blocks(classes), d, t)
        if spec.global_indices:
            out = self._global_rows(call, out)
        return out, None

    def _blocks(self, call: AttnCall) -> torch.Tensor:
        """The blocked computation: (b, h, t, e) out, every query row from its block's keys (+ extra keys)."""
        blocks = self.blocked(call)
        out, _ = dense_choice(blocks)(blocks)                                # (b·nb, h, B, e)
        return unblock(out, call.q.shape[0], call.q.shape[2])

    def blocked(self, call: AttnCall) -> AttnCall:
        """The (b·nb) dense call of the blocks: queries (b·nb, h, B, e), the keys each block reaches
        (b·nb, k, [G +] K, e), their mask and bias; `unblock` maps its output back."""
        assert call.spec is not None
        layout = self._layout(call.spec)
        assert not isinstance(layout, str)
        block, before, after = layout
        t = call.q.shape[2]
        mask, q_pos, k_pos, bias = self._blocked_mask(call, block, before, after)   # (rows·nb, 1|h, B, K)
        k, v = (key_blocks(z, t, block, before, after) for z in (call.k, call.v))   # (b·nb, k, K, e)
        g = self._extra_keys(call)
        if g is not None:                   # every block also sees the extra keys: (b·nb, k, G + K, e)
            nb = n_blocks(t, block)
            k, v = (torch.cat((z[:, :, g].repeat_interleave(nb, 0), blocks), 2) for z, blocks
                    in ((call.k, k), (call.v, v)))
        if mask.shape[0] != k.shape[0]:                                      # one row of positions for b
            copies = k.shape[0] // mask.shape[0]
            mask = mask.repeat(copies, 1, 1, 1)
            bias = None if bias is None else bias.repeat(copies, 1, 1, 1)
        return AttnCall(query_blocks(call.q, block), k, v, call.scale, mask=mask, bias=bias,
                        softcap=call.softcap, sinks=call.sinks, dropout=call.dropout)

    @staticmethod
    def _extra_indices(spec: MaskSpec, t: int) -> list[int]:
        """Keys every block sees beside its own range: the global tokens, and a fixed pattern's summary keys
        (the last c of each pattern block), inside this sequence (aligned: index = position)."""
        extra = {i for i in spec.global_indices if i < t}
        if spec.pattern == "fixed" and spec.block_size is not None:
            extra.update(j for j in range(t) if j % spec.block_size >= spec.block_size - spec.summary)
        return sorted(extra)

    @classmethod
    def _extra_keys(cls, call: AttnCall) -> torch.Tensor | None:
        assert call.spec is not None
        extra = cls._extra_indices(call.spec, call.q.shape[2])
        return torch.tensor(extra, device=call.q.device) if extra else None

    @staticmethod
    def _global_keys(call: AttnCall) -> torch.Tensor | None:
        """Indices of the global tokens inside this sequence, whose own rows see every key, or None."""
        assert call.spec is not None
        inside = [i for i in call.spec.global_indices if i < call.q.shape[2]]
        return torch.tensor(inside, device=call.q.device) if inside else None

    def _blocked_mask(self, call: AttnCall, block: int, before: int, after: int):
        """(mask (rows·nb, 1, B, [G +] K), query positions (rows·nb, B), key positions (rows·nb, [G +] K), bias
        or None) of the blocks, built once per forward for every layer with the same spec (through call.inputs;
        the bias per layer: it has weights)."""
        assert call.spec is not None and call.q_pos is not None
        t = call.q.shape[2]
        key = ("blocks", call.spec.key, tuple(call.q_pos.shape), block)
        shared = call.inputs.shared if call.inputs is not None else {}
        hit = shared.get(key)
        if hit is None:
            spec = call.spec
            per_row = (call.q_pos, spec.prefix_lengths, spec.key_padding, spec.segment_ids)
            rows = max(x.shape[0] for x in per_row if x is not None)             # 1 (plain positions) or b
            q_pos, k_pos = block_positions(call.q_pos.expand(rows, t), t, block, before, after)
            blocked = block_spec(spec, rows, t, block, before, after)
            mask = blocked.allows(q_pos, k_pos)                                  # (rows·nb, 1, B, K)
            g = self._extra_keys(call)
            if g is not None:   # extra keys first; masked where the block's own range already holds them
                g_pos = g.expand(q_pos.shape[0], -1)                             # (rows·nb, G)
                held = (g_pos[:, :, None] == k_pos[:, None, :]).any(-1)          # (rows·nb, G)
                g_padding = spec.key_padding
                if g_padding is not None:                                        # (rows·nb, G)
                    g_padding = g_padding.expand(rows, -1)[:, g].repeat_interleave(n_blocks(t, block), 0)
                g_spec = replace(blocked, key_padding=g_padding)
                g_mask = g_spec.allows(q_pos, g_pos) & ~held[:, None, None, :]
                mask, k_pos = torch.cat((g_mask, mask), -1), torch.cat((g_pos, k_pos), -1)
            hit = shared[key] = (mask, q_pos, k_pos)
        mask, q_pos, k_pos = hit
        bias = None if call.position_bias is None else call.position_bias(q_pos, k_pos)   # (rows·nb, h, B, K)
        return mask, q_pos, k_pos, bias

    @staticmethod
    def _global_rows(call: AttnCall, out: torch.Tensor) -> torch.Tensor:
        """The global tokens' own rows, which see every key: one dense call over all keys, written into out."""
        g = BlockLocal._global_keys(call)
        if g is None:
            return out
        assert call.spec is not None and call.q_pos is not None and call.k_pos is not None
        q_pos = call.q_pos[:, g]                                                   # (rows, G)
        rows = replace(call, q=call.q[:, :, g], q_pos=q_pos, inputs=None, aligned=False)
        mask, bias = call.spec.allows(q_pos, call.k_pos), rows.dense_bias()         # (rows, 1, G, s)
        dense = AttnCall(rows.q, call.k, call.v, call.scale, mask=mask, bias=bias, softcap=call.softcap,
                         sinks=call.sinks, dropout=call.dropout)
        out_g, _ = dense_choice(dense)(dense)                                       # (b, h, G, e)
        return out.index_copy(2, g, out_g)
