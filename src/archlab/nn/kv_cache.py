"""KV caches for incremental decoding.

Protocol every cache follows (the model and attention know nothing else about caches):
    k_all, v_all, k_pos = cache.update(layer, k, v, positions)
      k, v:       (b, k, t, e) the new keys (already rotated for RoPE) and values
      positions:  (b, t) their positions (-1 = padding)
      returns     (b, k, s, e), (b, k, s, e), (b, s) everything the queries may look at;
                  k_pos holds each returned key's position, -1 for an empty or padded slot.
Attention builds masks (causal, window, padding) and relative biases (ALiBi, T5) from the query
positions and the returned key positions, so a cache only has to return correct positions: slot
order does not matter. That is what lets a sliding-window layer use a rolling buffer.
Within one forward, layers that get the same number of keys back must get the same key positions:
attention builds each mask once per forward per (window, number of keys) and shares it.

A cache with `rotates_keys = True` (StreamingLLM) instead gets un-rotated keys and a `rotate`
callable, and returns rotated keys plus the queries' positions inside the cache:
    k_all, v_all, k_pos, q_pos = cache.update(layer, k, v, positions, rotate=rotate)
Attention calls it through `attend`, which rotates the queries too and hands back the mask structure (several tokens
fed at once that overflow the cache are scored with a band over their own positions: SinkKVCache.stretch):
    q, k_all, v_all, q_pos, k_pos, spec = cache.attend(layer, q, k, v, positions, position, spec)

`crop(length)` (KVCache, StaticKVCache) keeps the first `length` tokens written: speculative decoding
(archlab.generation.speculative) rolls the rejected draft tokens back with it. `grow(max_len)` (StaticKVCache
without rolling buffers) gives a cache more slots between forwards: a chat's cache (archlab.generation.prefix)
starts at what its first turn needs and doubles, instead of holding the whole context from the start.

Caches here:
  KVCache          grows by concatenation; the simplest reference.
  StaticKVCache    preallocated buffers (no torch.cat per step); global layers keep every token,
                   local (sliding-window) layers a rolling buffer of `window` slots (rolling=False: every
                   slot, so that `crop` can always roll back).
  SlotWrites       a compiled decode step's view of a StaticKVCache (nn/compiled_step.py): writes at a slot
                   given as a tensor and returns every slot (empty ones at position -1), so one graph serves
                   every step and every cache length.
  SinkKVCache      StreamingLLM (Xiao et al. 2023, arXiv 2309.17453): the first `sink_tokens`
                   tokens plus a recent window, positions assigned inside the cache, so decoding
                   continues past max_seq_len.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from archlab.config import ModelConfig
from archlab.nn.masks import MaskSpec


class KVCache:
    """Keys and values grow by concatenation, one entry per layer."""

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.positions: dict[int, torch.Tensor] = {}

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        if layer in self.keys:
            k = torch.cat((self.keys[layer], k), dim=2)
            v = torch.cat((self.values[layer], v), dim=2)
            positions = torch.cat((self.positions[layer], positions), dim=1)
        self.keys[layer], self.values[layer], self.positions[layer] = k, v, positions
        return k, v, positions

    def reorder(self, index: torch.Tensor) -> None:
        """Select batch rows (beam search): row i becomes old row index[i]."""
        for store in (self.keys, self.values, self.positions):
            for layer in store:
                store[layer] = store[layer].index_select(0, index)

    def crop(self, length: int) -> None:
        """Keep the first `length` tokens written (drop the newest ones)."""
        _check_crop(length, len(self))
        for layer in list(self.keys):
            self.keys[layer] = self.keys[layer][:, :, :length]
            self.values[layer] = self.values[layer][:, :, :length]
            self.positions[layer] = self.positions[layer][:, :length]

    def __len__(self) -> int:
        return next(iter(self.positions.values())).shape[1] if self.positions else 0


class _Buffers:
    """Preallocated k, v (b, k, cap, e) and positions (b, cap) for one layer."""

    def __init__(self, batch, kv_heads, capacity, head_dim, dtype, device, pos: torch.Tensor | None = None):
        self.k = torch.zeros(batch, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full((batch, capacity), -1, dtype=torch.long, device=device) if pos is None else pos
        self.capacity = capacity
        self.count = 0   # tokens written so far (the same for every row: padding takes slots too)
        self.rolling = False  # a sliding-window layer's ring buffer of `window` slots

    def reorder(self, index: torch.Tensor, pos: torch.Tensor | None = None) -> None:
        """Select batch rows; `pos`: positions already selected (a buffer shared between layers)."""
        self.k = self.k.index_select(0, index)
        self.v = self.v.index_select(0, index)
        self.pos = self.pos.index_select(0, index) if pos is None else pos

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def _check_crop(length: int, held: int) -> None:
    if not 0 <= length <= held:
        raise ValueError(f"cannot crop a KV cache holding {held} tokens to {length}")


def _model_dims(config: ModelConfig) -> tuple[int, int]:
    return config.n_kv_heads, config.head_dim


class _BufferedCache:
    """What the preallocated caches share: `self.layers`, one `_Buffers` per layer."""

    layers: list[_Buffers]

    def reorder(self, index: torch.Tensor) -> None:
        """Select batch rows (beam search): row i becomes old row index[i]."""
        for buf in self.layers:
            buf.reorder(index)

    @property
    def nbytes(self) -> int:
        """Bytes held by keys and values (positions excluded), as the analytic estimate counts."""
        return sum(buf.nbytes for buf in self.layers)

    def __len__(self) -> int:
        return self.layers[0].count


class StaticKVCache(_BufferedCache):
    """Preallocated per-layer buffers. Global layers hold `max_len` slots; windowed layers a rolling buffer
    of the positions they can reach (`config.attention.kv_span(layer)`: w, or (w-1)·d + 1 dilated), written
    at count % span. Global tokens and sparse patterns reach back to the start: `max_len` slots.

    GQA/MQA store only the kv heads (attention repeats them after the cache). The global layers share one
    positions buffer, written by the first of them in each forward (the protocol's "same keys, same
    positions"): a decode step writes and slices it once, not once per layer.
    """

    def __init__(self, config: ModelConfig, batch: int, max_len: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 n_layers: int | None = None, rolling: bool = True):
        """n_layers: the stack's depth where it is not config.n_layers (an encoder-decoder's decoder:
        config.stack_depth("cross_decoder")). rolling=False: windowed layers keep every slot too (the mask
        still enforces the window), so `crop` works at any length (speculative decoding)."""
        if max_len < 1:
            raise ValueError(f"max_len={max_len} must be >= 1")
        kv_heads, head_dim = _model_dims(config)
        self.max_len = max_len
        self.shared_pos = torch.full((batch, max_len), -1, dtype=torch.long, device=device)   # (b, max_len)
        self._shared_view: tuple[int, torch.Tensor | None] = (0, None)   # (length, shared_pos[:, :length])
        self.layers = []
        for layer in range(config.n_layers if n_layers is None else n_layers):
            window = config.attention.kv_span(layer)     # (w-1)·d + 1 for a (dilated) window, else None
            ring = rolling and window is not None and window < max_len
            buf = _Buffers(batch, kv_heads, window if ring else max_len, head_dim, dtype, device,
                           pos=None if ring else self.shared_pos)
            buf.rolling = ring
            self.layers.append(buf)

    def reorder(self, index: torch.Tensor) -> None:
        """Select batch rows (beam search): row i becomes old row index[i]; the shared positions once."""
        shared = self.shared_pos.index_select(0, index)
        for buf in self.layers:
            buf.reorder(index, shared if buf.pos is self.shared_pos else None)
        self.shared_pos, self._shared_view = shared, (0, None)

    def crop(self, length: int) -> None:
        """Keep the first `length` tokens written (speculative decoding drops its rejected drafts): the later
        slots are marked empty (position -1) and written again by the next update. A rolling buffer that has
        wrapped has overwritten keys the kept tokens still need: build the cache with rolling=False."""
        _check_crop(length, len(self))
        for layer, buf in enumerate(self.layers):
            if buf.rolling and buf.count > buf.capacity and length < buf.count:
                raise ValueError(f"layer {layer}'s rolling buffer of {buf.capacity} slots has wrapped ({buf.count} "
                                 "tokens written): it cannot roll back; build the cache with rolling=False")
        for buf in self.layers:
            buf.count = length
            if buf.pos is not self.shared_pos:
                buf.pos[:, length:] = -1
        self.shared_pos[:, length:] = -1
        self._shared_view = (0, None)      # the next forward writes its positions again

    def grow(self, max_len: int) -> None:
        """Hold `max_len` slots (no change when it holds as many already): every layer's buffers reallocated, the
        tokens held copied once, the new slots zeroed (a compiled step reads empty slots: they must be finite) and
        marked empty. Between forwards only, and only without rolling buffers (rolling=False or no windows).
        Example: cache = StaticKVCache(cfg, 1, 256, rolling=False); cache.grow(512)"""
        if max_len <= self.max_len:
            return
        if any(buf.rolling for buf in self.layers):
            raise ValueError("a cache with rolling buffers cannot grow: build it with rolling=False")
        n, old = len(self), self.shared_pos
        self.shared_pos = _grown(old, max_len, n, fill=-1)                 # (b, max_len)
        for buf in self.layers:
            buf.k, buf.v = _grown(buf.k, max_len, n), _grown(buf.v, max_len, n)      # (b, k, max_len, e)
            buf.pos = self.shared_pos if buf.pos is old else _grown(buf.pos, max_len, n, fill=-1)
            buf.capacity = max_len
        self.max_len, self._shared_view = max_len, (0, None)

    def slots(self) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """(keys (b, k, max_len, e) per layer, values alike, positions (b, max_len)): the whole buffers, for a
        compiled step (`SlotWrites`); only for a cache without rolling buffers (every layer sharing the positions).
        Example: keys, values, pos = cache.slots()"""
        if any(buf.pos is not self.shared_pos for buf in self.layers):
            raise ValueError("a compiled step needs every layer's slots: build the cache with rolling=False")
        return [buf.k for buf in self.layers], [buf.v for buf in self.layers], self.shared_pos

    def advance(self, t: int) -> None:
        """Count `t` tokens that a compiled step wrote through `SlotWrites` (it cannot move the counts itself)."""
        for buf in self.layers:
            buf.count += t
        self._shared_view = (0, None)

    def _positions(self, buf: _Buffers, n: int, t: int, positions: torch.Tensor) -> torch.Tensor:
        """buf.pos[:, :n + t] with `positions` written at n: once per forward where the buffer is shared."""
        if buf.pos is not self.shared_pos:
            buf.pos[:, n:n + t] = positions
            return buf.pos[:, :n + t]
        length, view = self._shared_view
        if length != n + t or view is None:          # the forward's first global layer
            buf.pos[:, n:n + t] = positions
            view = buf.pos[:, :n + t]
            self._shared_view = (n + t, view)
        return view

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        buf = self.layers[layer]
        t, n, cap = k.shape[2], buf.count, buf.capacity
        if n + t <= cap:                          # no wrap: contiguous write, return a view
            buf.k[:, :, n:n + t] = k
            buf.v[:, :, n:n + t] = v
            buf.count = n + t
            return buf.k[:, :, :n + t], buf.v[:, :, :n + t], self._positions(buf, n, t, positions)
        if not buf.rolling:
            raise ValueError(
                f"KV cache full: layer {layer} holds {cap} slots, {n} used, {t} more given "
                "(build the cache with a larger max_len)"
            )
        if t == 1:                                # rolling buffer: overwrite the oldest slot
            slot = n % cap
            buf.k[:, :, slot] = k[:, :, 0]
            buf.v[:, :, slot] = v[:, :, 0]
            buf.pos[:, slot] = positions[:, 0]
            buf.count = n + 1
            return buf.k, buf.v, buf.pos
        # several new tokens wrapping around: this step's queries still need the keys about to be
        # overwritten, so attend over (old slots + new) and then keep the newest `cap`
        filled = min(n, cap)
        k_all = torch.cat((buf.k[:, :, :filled], k), dim=2)
        v_all = torch.cat((buf.v[:, :, :filled], v), dim=2)
        pos_all = torch.cat((buf.pos[:, :filled], positions), dim=1)
        keep = min(t, cap)
        slots = (torch.arange(n + t - keep, n + t, device=k.device)) % cap
        buf.k.index_copy_(2, slots, k[:, :, t - keep:])
        buf.v.index_copy_(2, slots, v[:, :, t - keep:])
        buf.pos.index_copy_(1, slots, positions[:, t - keep:])
        buf.count = n + t
        return k_all, v_all, pos_all


def _grown(t: torch.Tensor, size: int, held: int, fill: int = 0) -> torch.Tensor:
    """`t` with its slot dimension (the last for positions (b, s), else dimension 2 of (b, k, s, e)) of `size`: the
    first `held` slots copied, the rest `fill`."""
    dim = t.dim() - 1 if t.dim() == 2 else 2
    shape = list(t.shape)
    shape[dim] = size
    out = t.new_empty(shape)
    out.narrow(dim, 0, held).copy_(t.narrow(dim, 0, held))
    out.narrow(dim, held, size - held).fill_(fill)
    return out


class SlotWrites:
    """The cache protocol over a StaticKVCache's whole buffers (`StaticKVCache.slots()`) for a compiled decode
    step: the step's t tokens are written at `slot` (a 0-d long tensor: the count of tokens held, the same for
    every row) and the first n slots are returned, the empty ones at position -1, which attention masks: all of
    them, or n = span.shape[0] (`span` a tensor only for its length, so that n is a dynamic size of the traced
    graph, not a constant) and attention reads no slot past them. Nothing here depends on how many tokens are
    held, so one traced graph serves every step; the caller counts the tokens (`StaticKVCache.advance`). The
    slots are cut inside the step, after the write: views of the whole buffers, handed to attention uncopied.
    Example (inside the step): cache = SlotWrites(keys, values, pos, slot, span=torch.empty(n))"""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], pos: torch.Tensor, slot: torch.Tensor,
                 span: torch.Tensor | None = None):
        self.keys, self.values, self.pos, self.slot, self.span = keys, values, pos, slot, span

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        index = self.slot + torch.arange(k.shape[2], device=k.device)          # (t,) the slots written
        keys, values = self.keys[layer], self.values[layer]
        keys.index_copy_(2, index, k)                                          # (b, k, max_len, e)
        values.index_copy_(2, index, v)
        self.pos.index_copy_(1, index, positions)     # the same for every layer: a (b, t) write each
        if self.span is None:
            return keys, values, self.pos
        n = self.span.shape[0]
        return keys[:, :, :n], values[:, :, :n], self.pos[:, :n]              # (b, k, n, e), (b, n)

    def __len__(self) -> int:
        """Held tokens as far as the model's inputs ask (a step never starts a fresh cache): the true count is
        `slot`, a tensor, which positions are given beside."""
        return 1


class SinkKVCache(_BufferedCache):
    """StreamingLLM (Xiao et al. 2023, arXiv 2309.17453): keep the first `sink_tokens` tokens (the
    attention sinks) and the most recent `window` tokens; positions are assigned inside the cache
    (0 .. sink_tokens + window - 1), so decoding goes on past max_seq_len without ever showing the
    model a distance it was not trained on.

    Keys are stored un-rotated and rotated with their current in-cache positions at every step
    (their positions shift as the window slides); the queries get in-cache positions too. With
    sink_tokens=0 this is plain window attention, the baseline the paper shows collapsing once the
    first tokens are evicted. Rows must not be padded (every row's first tokens are its sinks).
    """

    rotates_keys = True

    def __init__(self, config: ModelConfig, batch: int, *, sink_tokens: int = 4, window: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        if sink_tokens < 0 or window < 1:
            raise ValueError(f"sink_tokens={sink_tokens} must be >= 0 and window={window} >= 1")
        kv_heads, head_dim = _model_dims(config)
        self.sink_tokens, self.window = sink_tokens, window
        capacity = sink_tokens + window
        self.layers = [_Buffers(batch, kv_heads, capacity, head_dim, dtype, device)
                       for _ in range(config.n_layers)]
        self._arange = torch.arange(capacity, device=device)[None].expand(batch, capacity)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               rotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        buf = self.layers[layer]
        t, n, cap, sinks = k.shape[2], buf.count, buf.capacity, self.sink_tokens
        if n + t <= cap:
            buf.k[:, :, n:n + t], buf.v[:, :, n:n + t] = k, v
            filled = n + t
        elif t == 1:
            # evict the oldest non-sink token: shift the recent part one slot left (time order kept)
            if cap - 1 > sinks:
                buf.k[:, :, sinks:cap - 1] = buf.k[:, :, sinks + 1:].clone()
                buf.v[:, :, sinks:cap - 1] = buf.v[:, :, sinks + 1:].clone()
            buf.k[:, :, cap - 1], buf.v[:, :, cap - 1] = k[:, :, 0], v[:, :, 0]
            filled = cap
        else:
            raise ValueError(
                f"SinkKVCache holds {cap} slots ({n} used); once it would overflow, feed tokens one "
                f"at a time (got {t})"
            )
        buf.count = n + t
        k_pos = self._arange[:k.shape[0], :filled]                       # (b, s) in-cache positions
        keys = rotate(buf.k[:, :, :filled], k_pos)                       # (b, k, s, e)
        return keys, buf.v[:, :, :filled], k_pos, k_pos[:, filled - t:]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               position, spec: MaskSpec):
        """What attention computes over: (q, keys, values, q_pos, k_pos, spec), q and keys rotated. `position` is
        the layer's position module (its `rotate`, `has_bias`), `spec` the layer's mask structure. Token by token
        (and while the cache has room): `update`, queries at their in-cache positions. Several tokens that overflow
        the cache: `stretch`, in one forward, what feeding them token by token would compute.
        Example (nn/attention.py): q, k, v, q_pos, k_pos, spec = cache.attend(i, q, k, v, pos, position, spec)"""
        if k.shape[2] > 1 and self.layers[layer].count + k.shape[2] > self.sink_tokens + self.window:
            return self.stretch(layer, q, k, v, position, spec)
        keys, values, k_pos, q_pos = self.update(layer, k, v, positions, rotate=position.rotate)
        return position.rotate(q, q_pos), keys, values, q_pos, k_pos, spec

    @staticmethod
    def stretches(position, spec: MaskSpec) -> bool:
        """Whether `stretch` can score a layer with this position module and mask structure in one forward: rotary
        or no positions (a position bias would see true offsets, not in-cache ones) and a plain causal layer (a
        window or pattern of its own would apply to in-cache positions). generate's prefill asks it of every layer
        before feeding a long prompt in chunks. Example: SinkKVCache.stretches(attn.position, MaskSpec(causal=True))"""
        return not position.has_bias and (spec.causal and spec.only_structure and spec.dilation == 1
                                          and not spec.global_indices)

    def stretch(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position, spec: MaskSpec):
        """t tokens fed at once that overflow the cache (fresh, partly filled or full): every query attends as it
        would have decoding them one at a time, and the cache is left holding what that leaves (the sinks and the
        last `window` tokens).

        Decoding token i (0-based) past the capacity c = sinks + window, the query sits at in-cache position c - 1
        and sees the sinks at slots 0..sinks-1 and the recent tokens i - window + 1 .. i at the slots after. Rotary
        scores depend only on the offset, so the recent tokens keep their true offsets (a causal band of `window`
        tokens over the positions of what the cache holds followed by the stretch) while a sink j is scored at
        offset min(i, c - 1) - j instead of i - j. One forward computes both: the head dimension doubled, the first
        half q and the non-sink keys rotated at those positions, the second half q rotated at min(i, c - 1) and the
        sinks at j, each key zero in the half that is not its own, so q·k is each pair's score; the mask is that
        band with the sinks seen by every query (global tokens). With sink_tokens = 0 it is just the band (window
        attention). The held keys are numbered 0..held-1 (a full cache's recent ones as if they followed the sinks:
        only offsets among them and the stretch count), the stretch held..held+t-1.
        Shapes: q (b, h, t, e), k, v (b, k, t, e) -> q (b, h, t, 2e), keys (b, k, n, 2e), values (b, k, n, e)
        (only the halves when sink_tokens = 0; n = held + t), q_pos (b, t), k_pos (b, n). Only for RoPE or no
        positions (a position bias would see true offsets) and a plain causal layer (no window or pattern of its
        own: it would apply to in-cache positions)."""
        sinks, cap = self.sink_tokens, self.sink_tokens + self.window
        buf = self.layers[layer]
        if not self.stretches(position, spec):
            raise ValueError(f"SinkKVCache holds {cap} slots ({buf.count} used): {k.shape[2]} tokens in one forward "
                             "need rotary or no positions and a plain causal layer; feed the tokens past the capacity "
                             "one at a time")
        held = min(buf.count, cap)
        if held:     # what the cache holds (sinks, then the recent tokens in order), then the stretch
            k = torch.cat((buf.k[:, :, :held], k), dim=2)                       # (b, k, n, e)
            v = torch.cat((buf.v[:, :, :held], v), dim=2)
        b, _, n, e = k.shape
        pos = torch.arange(n, device=k.device)[None].expand(b, n)               # (b, n) the keys' positions
        q_pos = pos[:, held:]                                                    # (b, t) the queries'
        q_true, k_true = position.rotate(q, q_pos), position.rotate(k, pos)
        if sinks:
            q_sink = position.rotate(q, q_pos.clamp(max=cap - 1))                # the query's in-cache position
            q = torch.cat((q_true, q_sink), dim=-1)                              # (b, h, t, 2e)
            keys = k_true.new_zeros(b, k.shape[1], n, 2 * e)                     # (b, k, n, 2e)
            keys[:, :, sinks:, :e] = k_true[:, :, sinks:]
            keys[:, :, :sinks, e:] = k_true[:, :, :sinks]                       # sink j at in-cache position j
        else:
            q, keys = q_true, k_true
        buf.k[:, :, :sinks], buf.v[:, :, :sinks] = k[:, :, :sinks], v[:, :, :sinks]
        buf.k[:, :, sinks:], buf.v[:, :, sinks:] = k[:, :, n - self.window:], v[:, :, n - self.window:]
        buf.count += n - held
        band = dataclasses.replace(spec, window=(self.window - 1, 0), global_indices=tuple(range(sinks)))
        return q, keys, v, q_pos, pos, band


class SlotKVCache:
    """Continuous batching: `rows` independent slots, each a request's own sequence. Requests join and
    leave between decode steps; a forward runs over any subset of rows through `view(rows)`, which
    follows the cache protocol for just those rows (each writes at its own offset; empty slots return
    position -1, so attention masks them). Every layer keeps `capacity` slots: windows are enforced by
    the mask, not by a rolling buffer.

    A row is a name; where its keys live is `physical(row)`, an index into `k`, `v` and `pos`. A forward over
    several rows attends over a view of consecutive physical rows, so its keys are never copied: when the rows a
    view asks for are not consecutive there, `view` first swaps rows' contents until they are (once per batch
    composition, each move as long as the rows it moves hold), and every later step of that batch is a view.
    Example: slots = SlotKVCache(cfg, rows=8, capacity=cfg.max_seq_len)
             logits = model(ids, positions=pos, cache=slots.view([3]))     # row 3 only"""

    def __init__(self, config: ModelConfig, rows: int, capacity: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        kv_heads, head_dim = _model_dims(config)
        shape = (config.n_layers, rows, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)              # (L, rows, k, cap, e) by physical row
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full((rows, capacity), -1, dtype=torch.long, device=device)  # (rows, cap) by physical row
        self.length = [0] * rows                                              # tokens held per row
        self.capacity = capacity
        self._physical = list(range(rows))                                    # row -> its index in k, v, pos
        self._row = list(range(rows))                                         # physical index -> row
        self.moved = 0                                                        # tokens moved by view's swaps

    def physical(self, row: int) -> int:
        """Where `row`'s keys, values and positions are in `k`, `v` and `pos`."""
        return self._physical[row]

    def reset(self, row: int) -> None:
        """Free a row for the next request."""
        self.crop(row, 0)

    def crop(self, row: int, length: int) -> None:
        """Keep a row's first `length` tokens (a prefix the next request shares); the next forward writes after."""
        _check_crop(length, self.length[row])
        self.pos[self._physical[row], length:] = -1
        self.length[row] = length

    def copy(self, source: int, row: int, length: int) -> None:
        """Row `row` holds `source`'s first `length` tokens (a prefix another request shares) and nothing after."""
        _check_crop(length, self.length[source])
        src, dst = self._physical[source], self._physical[row]
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
        self.pos[dst, :length] = self.pos[src, :length]
        self.pos[dst, length:] = -1
        self.length[row] = length

    @property
    def nbytes(self) -> int:
        """Bytes held by keys and values, every row: fixed at construction whatever the rows hold."""
        return self.k.nbytes + self.v.nbytes

    def view(self, rows: list[int]) -> _SlotView:
        """The cache protocol over `rows` (batch row i = rows[i]) for one forward, their keys a view of consecutive
        physical rows (a later view may move rows: take a new one for each forward)."""
        if len(set(rows)) != len(rows):
            raise ValueError(f"rows {rows} name a row twice")
        self._arrange(rows)
        return _SlotView(self, rows)

    def _arrange(self, rows: list[int]) -> None:
        """Swap rows' contents until rows[i] sits at physical start + i, for the start that moves the fewest tokens
        (nothing to do when they already run on consecutively)."""
        n, b = len(self._row), len(rows)
        where = [self._physical[r] for r in rows]
        if all(p == where[0] + i for i, p in enumerate(where)):
            return

        def cost(start: int) -> int:                 # tokens the swaps would move
            return sum(self.length[row] + self.length[self._row[start + i]]
                       for i, (row, p) in enumerate(zip(rows, where)) if p != start + i)
        start = min(sorted({p - i for i, p in enumerate(where) if 0 <= p - i <= n - b} | {0}), key=cost)
        for i, row in enumerate(rows):
            if self._physical[row] != start + i:
                self._swap(row, self._row[start + i])

    def _swap(self, a: int, b: int) -> None:
        """Exchange where rows a and b live, moving the tokens each holds."""
        pa, pb = self._physical[a], self._physical[b]
        la, lb = self.length[a], self.length[b]
        for t in (self.k, self.v):                                           # (L, rows, k, cap, e)
            held = t[:, pa, :, :la].clone()
            t[:, pa, :, :lb] = t[:, pb, :, :lb]
            t[:, pb, :, :la] = held
        self.pos[[pa, pb]] = self.pos[[pb, pa]]
        self._physical[a], self._physical[b] = pb, pa
        self._row[pa], self._row[pb] = b, a
        self.moved += la + lb


class _SlotView:
    """The cache protocol over some rows of a SlotKVCache (batch row i = slot rows[i]), which sit at consecutive
    physical rows (SlotKVCache.view arranged them): each layer hands back views of their keys, no copies."""

    def __init__(self, slots: SlotKVCache, rows: list[int]):
        self.slots, self.rows = slots, rows
        self.starts = [slots.length[r] for r in rows]   # where this forward writes in each row
        self.lo = slots.physical(rows[0]) if rows else 0
        assert all(slots.physical(r) == self.lo + i for i, r in enumerate(rows)), "rows not arranged"

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        s, t, lo = self.slots, k.shape[2], self.lo
        if max(self.starts) + t > s.capacity:
            raise ValueError(f"a request needs more than the cache's {s.capacity} slots")
        for i, (row, start) in enumerate(zip(self.rows, self.starts)):
            s.k[layer, lo + i, :, start:start + t] = k[i]
            s.v[layer, lo + i, :, start:start + t] = v[i]
            s.pos[lo + i, start:start + t] = positions[i]     # the same for every layer of this forward
            s.length[row] = start + t
        # only the slots some row has written: attention never spans the empty tail of the capacity
        end, hi = max(self.starts) + t, lo + len(self.rows)
        return s.k[layer, lo:hi, :, :end], s.v[layer, lo:hi, :, :end], s.pos[lo:hi, :end]   # views: (b, k, end, e)

    def __len__(self) -> int:
        return max(self.starts)
