"""Masks as data: what may attend to what, built once per forward and read by every layer.

A `MaskSpec` holds the structure (causal or not, a window as (left, right), prefix lengths, key padding,
segment ids (packed documents: a query sees only keys of its own document), and room for block-sparse
kernels: block size, global indices, dilation) and one predicate, `allows(q_pos, k_pos)`, that every kernel
form is compiled from: "no mask at all" where nothing binds (SDPA's is_causal, or a bidirectional encoder's
full attention), a dense boolean mask for the eager reference and SDPA, and later block lists for sparse
kernels. `AttnInputs` carries one forward's positions, spec, KV cache, decode session and the tables its
layers share.

Windows follow OLMo-core: (left, right) counts the positions a query may see before and after itself,
so Mistral's 4,096-token sliding window (the query and the 4,095 before it) is (4095, 0).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from archlab.nn.fused import DecodeSession

__all__ = ["MaskSpec", "LocalPattern", "AttnInputs", "Context", "window_bounds", "document_positions"]


def window_bounds(window: int | None, causal: bool) -> tuple[int | None, int | None]:
    """(left, right) of a sliding window of `window` tokens (the query included): causal (W-1, 0);
    bidirectional W // 2 on each side (Longformer's symmetric window)."""
    if window is None:
        return None, None
    return (window - 1, 0) if causal else (window // 2, window // 2)


def document_positions(document_ids: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """(b, t) document ids of packed rows -> (b, t) positions that restart at 0 with each document (counting its
    real tokens), -1 on padding (an id < 0, or `real` False where given). Each document must be one run of
    slots in its row: an id that comes back after another document is a ValueError (its halves would see each
    other). Example: document_positions(torch.tensor([[0, 0, 0, 1, 1, -1]])) -> tensor([[0, 1, 2, 0, 1, -1]])"""
    ids = document_ids.long()
    real = ids >= 0 if real is None else real.bool() & (ids >= 0)
    before = torch.nn.functional.pad(ids[:, :-1], (1, 0), value=-2)         # (b, t) the previous slot's id
    starts = real & (ids != before)                                         # a document's first slot
    rows = starts.nonzero()[:, 0]                                           # (starts,) the row of each
    ordinal = rows * (int(ids.max()) + 1 if ids.numel() else 1) + ids[starts]   # (starts,) one per (row, id)
    if ordinal.numel() != torch.unique(ordinal).numel():
        raise ValueError("document_ids: each document must be one run of slots in its row (an id came back "
                         "after another document)")
    count = real.long().cumsum(-1) - 1                                      # (b, t) index among real tokens
    first = torch.where(starts, count, -1).cummax(-1).values                # (b, t) its document's first index
    return torch.where(real, count - first, -1)


@dataclass(frozen=True)
class LocalPattern:
    """What a local ("L") layer attends to, from AttentionConfig: a window, maybe dilated, with global tokens,
    or a sparse pattern. Hashable: layers with equal patterns share one spec and its masks per forward."""
    window: int | None = None
    dilation: int = 1
    global_tokens: int = 0
    sparse: str = "none"
    stride: int | None = None
    summary: int = 1

    @classmethod
    def of(cls, att: Any) -> LocalPattern:
        """The pattern an AttentionConfig gives its local layers."""
        return cls(att.window, att.dilation, att.global_tokens, att.sparse, att.sparse_stride, att.sparse_summary)


@dataclass(frozen=True)
class MaskSpec:
    causal: bool = True
    window: tuple[int | None, int | None] = (None, None)  # (left, right); None: unbounded on that side
    prefix_lengths: torch.Tensor | None = None            # (b,): a bidirectional prefix (prefix-LM, T5 style)
    key_padding: torch.Tensor | None = None               # (b, s) bool, True = a real key
    segment_ids: torch.Tensor | None = None               # (b, t) the queries' documents: a query sees its own
    key_segment_ids: torch.Tensor | None = None           # (b, s) the keys' documents; None: segment_ids (self-
                                                          # attention); cross-attention: the encoder's
    dilation: int = 1                                     # window keys this many positions apart (Longformer)
    global_indices: tuple[int, ...] = ()                  # positions that see all and that all see (Longformer)
    pattern: str | None = None                            # "strided" | "fixed" (Sparse Transformer)
    block_size: int | None = None                         # the pattern's stride / block l
    summary: int = 1                                      # fixed: the last c positions of each block are seen
    key: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.pattern not in (None, "strided", "fixed") or (self.pattern and not self.block_size):
            raise ValueError(f"MaskSpec.pattern={self.pattern!r} (block_size={self.block_size}): a sparse pattern "
                             "is 'strided' or 'fixed', with a block size")
        if self.dilation < 1:
            raise ValueError(f"MaskSpec.dilation={self.dilation} must be >= 1")
        if self.key_segment_ids is not None and self.segment_ids is None:
            raise ValueError("MaskSpec.key_segment_ids needs the queries' segment_ids")
        # what identifies this structure within one forward (layers share masks under it): the plain fields
        # and the identity of its tensors (a stack builds them once per forward). Computed here, not cached
        # lazily: functools.cached_property takes a lock that torch.compile cannot trace.
        tensors = (self.prefix_lengths, self.key_padding, self.segment_ids, self.key_segment_ids)
        plain = (self.causal, self.window, self.dilation, self.global_indices, self.pattern, self.block_size,
                 self.summary)
        object.__setattr__(self, "key", (*plain, *(None if x is None else id(x) for x in tensors)))

    def with_window(self, window: int | None) -> MaskSpec:
        """This spec for a layer with a sliding window of `window` tokens (None: the spec as is)."""
        if window is None:
            return self
        return dataclasses.replace(self, window=window_bounds(window, self.causal))

    def restricted(self, local: LocalPattern | None) -> MaskSpec:
        """This spec for a local layer with `local`'s pattern (None: a global layer, the spec as is)."""
        if local is None:
            return self
        sparse = local.sparse != "none"
        return dataclasses.replace(
            self.with_window(local.window), dilation=local.dilation, global_indices=tuple(range(local.global_tokens)),
            pattern=local.sparse if sparse else None, block_size=local.stride if sparse else None,
            summary=local.summary)

    @property
    def only_structure(self) -> bool:
        """Nothing beyond causal-or-not binds: no window, pattern, prefix, padding or segments."""
        return (self.window == (None, None) and self.pattern is None and self.prefix_lengths is None
                and self.key_padding is None and self.segment_ids is None)

    def reach(self) -> tuple[int | None, int | None]:
        """(before, after): how many positions before and after itself a query may reach through the window
        (global tokens aside; None: unbounded), the key range a block-local kernel gives each query block.
        A prefix reaches to its end: that costs a host sync, once per spec."""
        if self.pattern is not None:
            return None, None                 # strided keys and summary keys reach back to the start
        d = self.dilation
        left, right = self.window
        left = None if left is None else left * d
        right = None if right is None else right * d
        if not self.causal and right is None:
            return left, None
        after = 0 if self.causal else right
        if self.prefix_lengths is not None:
            if left is None or self.prefix_lengths.numel() == 0:
                return left, None if left is None else after
            longest = int(self.prefix_lengths.max())
            after = max(after or 0, longest - 1)
            left = max(left, longest - 1)   # a prefix query also sees the prefix's first key
        return left, after

    def allows(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """The predicate: (b, t) query and (b, s) key positions (-1 = an empty or padded slot) ->
        (b, 1, t, s) bool, True where the query may attend to the key."""
        global_pair, seg, key_seg = None, self.segment_ids, self.keys_segments()
        if self.global_indices:
            g = torch.tensor(self.global_indices, device=q_pos.device)
            global_pair = torch.isin(q_pos, g)[:, :, None] | torch.isin(k_pos, g)[:, None, :]     # (b, t, s)
        ok = self.pairs(q_pos[:, :, None], k_pos[:, None, :], global_pair=global_pair,   # (b, t, 1), (b, 1, s)
                        prefix=None if self.prefix_lengths is None else self.prefix_lengths[:, None, None],
                        key_real=None if self.key_padding is None else self.key_padding[:, None, :],
                        same_segment=None if seg is None or key_seg is None
                        else seg[:, :, None] == key_seg[:, None, :])
        return ok[:, None]

    def keys_segments(self) -> torch.Tensor | None:
        """(b, s) the keys' documents: key_segment_ids, or the queries' own in self-attention (None: no documents)."""
        return self.segment_ids if self.key_segment_ids is None else self.key_segment_ids

    def sliced(self, queries: slice, keys: slice) -> MaskSpec:
        """This spec over a run of queries and a run of keys (a tile of a tiled kernel): the per-query and
        per-key tensors (segment ids, key padding) cut alike; the rest as is."""
        seg, key_seg, padding = self.segment_ids, self.keys_segments(), self.key_padding
        if seg is None and padding is None:
            return self
        return dataclasses.replace(
            self, key_padding=None if padding is None else padding[:, keys],
            segment_ids=None if seg is None else seg[:, queries],
            key_segment_ids=None if key_seg is None else key_seg[:, keys])

    def pairs(self, q: torch.Tensor, k: torch.Tensor, *, global_pair: torch.Tensor | None = None,
              prefix: torch.Tensor | None = None, key_real: torch.Tensor | None = None,
              same_segment: torch.Tensor | None = None) -> torch.Tensor:
        """The predicate's terms on broadcastable tensors: query and key positions, and what the spec's tensors
        say about each pair (either is a global token, the row's prefix length, the key is real, both are in
        one segment; given wherever the spec has global indices, a prefix, padding, segments). `allows`
        evaluates it over (b, t, s) grids, FlexAttention's mask_mod (nn/flex_attention.py) pair by pair."""
        distance = q - k                                   # > 0: the key is in the query's past
        structural = k >= 0
        if self.causal:
            structural = structural & (distance >= 0)
        ok = structural & self._local(q, k, distance)
        if global_pair is not None:                        # Longformer: global rows and columns
            ok = ok | (structural & global_pair)
        if prefix is not None:
            ok = ok | ((q < prefix) & (k < prefix) & (k >= 0))
        if key_real is not None:
            ok = ok & key_real
        if same_segment is not None:
            ok = ok & same_segment
        return ok | (q < 0)   # a padded query (position -1) sees its row freely: no NaN

    def _local(self, q: torch.Tensor, k: torch.Tensor, distance: torch.Tensor) -> torch.Tensor | bool:
        """The layer's own restriction: a (dilated) window, or a Sparse Transformer pattern (Child et al. 2019,
        the two factors merged in one head); True where nothing restricts."""
        ok: torch.Tensor | bool = True
        d = self.dilation
        left, right = self.window
        if left is not None:
            ok = ok & (distance <= left * d)
        if right is not None:
            ok = ok & (-distance <= right * d)
        if d > 1:
            ok = ok & (distance % d == 0)
        stride = self.block_size or 1
        if self.pattern == "strided":                      # the previous l keys, and every l-th before them
            ok = ok & ((distance.abs() < stride) | (distance % stride == 0))
        elif self.pattern == "fixed":                      # the query's own block, and each block's last c keys
            ok = ok & ((q // stride == k // stride) | (k % stride >= stride - self.summary))
        return ok

    def dense(self, q_pos: torch.Tensor, k_pos: torch.Tensor, *, plain: bool, continued: bool = False
              ) -> tuple[torch.Tensor | None, bool]:
        """The form SDPA and the eager reference take: (mask or None, is_causal). `plain` says the
        positions are 0..t-1 in every row with no cache, where a pure causal (or pure bidirectional) spec
        needs no mask tensor at all; `continued`, that each row's queries continue its cached keys, none
        padded, where one causal query per row sees every key (a decode step: no mask, no host sync)."""
        if plain and self.only_structure:
            return None, self.causal and q_pos.shape[-1] > 1
        if continued and self.causal and self.only_structure and q_pos.shape[-1] == 1:
            return None, False
        mask = self.allows(q_pos, k_pos)
        # one query that may see every key (a decode step): no mask; a compiled step keeps its mask (no host sync)
        if q_pos.shape[-1] == 1 and not torch.compiler.is_compiling() and bool(mask.all()):
            return None, False
        return mask, False


@dataclass
class AttnInputs:
    """One forward's attention inputs, built once in the model and handed to every block of a stack. Its
    layers share through `shared` what depends only on the positions and the spec: RoPE tables, each
    window's spec, dense masks (built only when a backend asks for one). `session`: the decode loop's
    nn/fused.DecodeSession the forward was given (its packed weights), None outside decoding."""
    positions: torch.Tensor                  # (b, t), or (1, t) shared by all rows on the plain path
    spec: MaskSpec = field(default_factory=MaskSpec)
    cache: Any = None                        # archlab.nn.kv_cache protocol, or None
    plain: bool = False                      # positions 0..t-1 in every row, no padding, no cache
    continued: bool = False                  # each row continues its cached tokens: none padded, one length
    fresh: bool = False                      # a cache that held nothing before this forward (a prefill)
    shared: dict = field(default_factory=dict)   # built once per forward, read by every layer
    session: DecodeSession | None = None     # a decode loop's session (nn/fused), or None

    def real_tokens(self) -> torch.Tensor | None:
        """(b, t) bool, True on a real token: padding (position -1: from an attention mask, a document id -1 or
        given so) is False; (1, t) where the positions are one shared row. None when every token is real (the plain
        path or continued decoding). What per-token statistics count,
        e.g. the MoE balance loss (nn/mlp.py). Example: inputs.real_tokens() -> tensor([[True, True, False]])"""
        if self.plain or self.continued:
            return None
        hit = self.shared.get("real")
        if hit is None:
            hit = self.shared["real"] = self.positions >= 0                      # (b, t)
        return hit

    def contiguous(self) -> bool:
        """Each row's positions run on by one (padding, -1, aside; packed documents each on their own): key index
        distance = position distance wherever a query may see a key, what a blocked kernel needs. A host sync,
        once per forward."""
        hit = self.shared.get("contiguous")
        if hit is None:
            pos, seg = self.positions, self.spec.segment_ids
            steps = (pos[:, 1:] - pos[:, :-1] == 1) | (pos[:, :-1] < 0)
            if seg is not None:                                # a new document may restart its positions
                steps = steps | (seg[:, 1:] != seg[:, :-1])
            hit = self.shared["contiguous"] = bool(steps.all())
        return hit

    def layer_spec(self, local: LocalPattern | int | None) -> MaskSpec:
        """The stack's spec for a local layer with this pattern (a bare int: a plain window of that many
        tokens; None: a global layer), one object per pattern and forward."""
        if local is None:
            return self.spec
        key = ("spec", local)
        spec = self.shared.get(key)
        if spec is None:
            pattern = LocalPattern(window=local) if isinstance(local, int) else local
            spec = self.shared[key] = self.spec.restricted(pattern)
        return spec

    def dense(self, spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
        """(mask or None, is_causal) of `spec` over these positions, built once per forward for every layer
        whose spec and numbers of queries and keys match (a cache returns the same key positions to every
        layer whose keys are equally many; an encoder's spec and a decoder's never share a key)."""
        if torch.compiler.is_compiling():   # a compiled step: no key of symbolic sizes; the compiler shares it
            return spec.dense(q_pos, k_pos, plain=self.plain, continued=self.continued)
        key = ("mask", spec.key, q_pos.shape[-1], k_pos.shape[-1])
        hit = self.shared.get(key)
        if hit is None:
            hit = self.shared[key] = spec.dense(q_pos, k_pos, plain=self.plain, continued=self.continued)
        return hit

    def layer_mask(self, window: LocalPattern | int | None, q_pos: torch.Tensor, k_pos: torch.Tensor
                   ) -> tuple[torch.Tensor | None, bool]:
        """(mask or None, is_causal) for a layer with this sliding window. Example:
        AttnInputs(torch.arange(4)[None], plain=True).layer_mask(None, pos, pos) -> (None, True)"""
        return self.dense(self.layer_spec(window), q_pos, k_pos)


@dataclass(eq=False)
class Context:
    """What a cross-attention layer attends to: an encoder's output, its positions and what may be seen
    (its padding). Each cross-attention layer projects its keys and values from it once (`kv`), so the
    decode steps of a generation reuse them. Example:
    Context(enc_out, torch.arange(s)[None], MaskSpec(causal=False, key_padding=attention_mask.bool()))"""
    hidden: torch.Tensor                     # (b, s, d)
    positions: torch.Tensor                  # (b|1, s), -1 = padding
    spec: MaskSpec = field(default_factory=lambda: MaskSpec(causal=False))
    kv: dict = field(default_factory=dict)   # layer module -> (k, v) (b, k, s, e)

    def for_targets(self, document_ids: torch.Tensor | None) -> Context:
        """The context as packed targets (b, t) see it: the queries' documents are the targets', the keys' the
        source's, so document i of the target reads document i of the source (self, unpacked)."""
        if (document_ids is None) != (self.spec.segment_ids is None):
            raise ValueError("packed documents on one side only: give the source's document_ids and the "
                             "target's decoder_document_ids together")
        if document_ids is None:
            return self
        spec = dataclasses.replace(self.spec, segment_ids=document_ids, key_segment_ids=self.spec.segment_ids)
        return dataclasses.replace(self, spec=spec)
