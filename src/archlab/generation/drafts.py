"""Drafts for speculative decoding: what proposes the next few tokens that the target model then checks.

    archlab.generate(model, ids, 64, draft=small_model)          # another archlab model (its own KV cache)
    archlab.generate(model, ids, 64, draft="prompt_lookup")      # copy what followed the last n-gram
    archlab.generate(model, ids, 64, draft="ngram")              # a Kneser-Ney model counted on the prompt
    archlab.generate(model, ids, 64, draft=NgramDraft(order=4, data=train_tokens))

  ModelDraft         a smaller model of the same vocabulary (Leviathan et al. 2023, arXiv 2211.17192;
                     Chen et al. 2023, arXiv 2302.01318; transformers' assisted generation).
  PromptLookupDraft  prompt lookup decoding (Saxena 2023; transformers' prompt_lookup_num_tokens): the last
                     n-gram of the row (n = max_ngram down to 1) is searched in the row so far and the tokens
                     that followed its first earlier occurrence are proposed, up to an end-of-sequence token.
  NgramDraft         a cache model (Kuhn & De Mori 1990; vLLM's n-gram proposer) over archlab's interpolated
                     modified Kneser-Ney model (archlab.eval.ngram): where the row's last n tokens (n = cache_max
                     down to cache_min) occurred earlier in the row, what followed them is proposed; elsewhere
                     the KN model, counted on each row's prompt (and optionally on training tokens), proposes its
                     most likely token, or samples from its distribution when decoding samples.

A draft follows one protocol, driven by archlab.generation.speculative:
    start(ids, mask, setup)           the prompt, (b, t) left-padded as the target's Stepper holds it, and the
                                      generation's Setup (vocabulary width, new tokens, sampling or not, EOS)
    propose(seqs, k, choose)          -> Proposal: up to k tokens per row (b, k') and, where the draft has a
                                      distribution, the probabilities each was chosen from (b, k', v)
    commit(length)                    the first `length` tokens of seqs + proposal stand (the rest was rejected)
`choose(logits (b, v), seqs (b, t)) -> (tokens (b,), probs (b, v) | None)` is the target's own selection rule
(logits processors, temperature, top-k, top-p; greedy: argmax and None), so a draft that has logits proposes
with exactly the processing the target is verified with. Shapes: b rows, t tokens so far, v vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch

from archlab.generation.stepper import Stepper

Choose = Callable[[torch.Tensor, torch.Tensor], "tuple[torch.Tensor, torch.Tensor | None]"]


@dataclass(frozen=True)
class Setup:
    vocab: int                              # the width of the target's logits
    max_new_tokens: int
    sampling: bool                          # False: greedy, a draft only needs its most likely token
    eos: tuple[int, ...] = ()


@dataclass
class Proposal:
    tokens: torch.Tensor                    # (b, k') long, k' <= k
    probs: torch.Tensor | None = None       # (b, k', v): the distribution each token was drawn from; None: one-hot


class Draft(Protocol):
    name: str

    def start(self, ids: torch.Tensor, mask: torch.Tensor, setup: Setup) -> None: ...

    def propose(self, seqs: torch.Tensor, k: int, choose: Choose) -> Proposal: ...

    def commit(self, length: int) -> None: ...


class _Rows:
    """Each row's real tokens so far as Python lists (left padding dropped), extended from the session's seqs."""

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor):
        pad = (~mask).sum(-1).tolist()
        self.rows = [row[p:] for row, p in zip(ids.tolist(), pad)]
        self.width = ids.shape[1]                         # columns of seqs already in `rows`

    def update(self, seqs: torch.Tensor) -> list[list[int]]:
        """Append the columns of seqs (b, t) not seen yet; -> the rows."""
        if seqs.shape[1] > self.width:
            for row, new in zip(self.rows, seqs[:, self.width:].tolist()):
                row.extend(new)
            self.width = seqs.shape[1]
        return self.rows


def _stack(rows: list[list[int]], k: int, device) -> torch.Tensor:
    """Proposals of different lengths -> (b, k') with k' the longest (<= k); a short row is filled with its last
    proposed token (any id will do: the target checks every one, and rows advance by the batch's shortest
    accepted run)."""
    width = min(k, max((len(r) for r in rows), default=0))
    out = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        r = r[:width]
        if r:
            out[i, :len(r)] = torch.tensor(r)
            out[i, len(r):] = r[-1]
    return out.to(device)


def _proposal(tokens: list[torch.Tensor], probs: list[torch.Tensor | None], device) -> Proposal:
    """k chosen (b,) tokens and their (b, v) distributions (None: greedy) -> a Proposal (b, k), (b, k, v)."""
    out = torch.stack(tokens, 1).to(device)
    dists = [p for p in probs if p is not None]
    return Proposal(out, torch.stack(dists, 1) if dists and len(dists) == len(probs) else None)


class ModelDraft:
    """Another model (same vocabulary) drafts k tokens one step at a time over its own KV cache, which is cropped
    to the accepted tokens after each check; the tokens it has not seen yet (the target's correction, or the
    last draft when all were accepted) are fed at the start of the next proposal."""

    name = "model"

    def __init__(self, model, *, fast: bool = True, vocab_limit: int | None = None):
        self.model, self.fast, self.vocab_limit = model, fast, vocab_limit
        self.stepper: Stepper | None = None
        self.fed = 0            # tokens of the sequence (left padding included) the draft's cache holds

    def check(self, target, prompt_width: int, max_new_tokens: int) -> None:
        """A draft of another vocabulary, or one whose context cannot hold the generation: ValueError."""
        mine = getattr(getattr(self.model, "config", None), "vocab_size", None)
        theirs = target.config.vocab_size
        if mine != theirs:
            raise ValueError(f"the draft model's vocabulary ({mine} ids) differs from the target's ({theirs}): "
                             "a draft must share the target's tokenizer")
        if getattr(self.model.config, "arch", "decoder") != "decoder":
            raise ValueError("a draft model must be a decoder-only LM")
        ctx = self.model.config.max_seq_len
        if prompt_width + max_new_tokens > ctx:
            raise ValueError(f"the draft model's context max_seq_len={ctx} is shorter than the prompt "
                             f"({prompt_width} tokens) + max_new_tokens={max_new_tokens}")

    def start(self, ids: torch.Tensor, mask: torch.Tensor, setup: Setup) -> None:
        self.stepper = Stepper(self.model, ids, mask, setup.max_new_tokens, fast=self.fast,
                               vocab_limit=self.vocab_limit, rewindable=True)
        self.stepper.prefill()
        self.fed = ids.shape[1]

    def propose(self, seqs: torch.Tensor, k: int, choose: Choose) -> Proposal:
        stepper = self.stepper
        assert stepper is not None
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor | None] = []
        logits = stepper.extend(seqs[:, self.fed:].to(stepper.ids.device))[:, -1]          # (b, v)
        self.fed = seqs.shape[1]
        for i in range(k):
            tok, p = choose(logits, torch.cat([seqs, *[t[:, None] for t in tokens]], 1) if tokens else seqs)
            tokens.append(tok)
            probs.append(p)
            if i < k - 1:
                logits = stepper.step(tok)
                self.fed += 1
        return _proposal(tokens, probs, seqs.device)

    def commit(self, length: int) -> None:
        assert self.stepper is not None
        if length < self.fed:
            self.stepper.rewind(self.fed - length)
            self.fed = length


@dataclass
class PromptLookupDraft:
    """Prompt lookup decoding: match the row's last n-gram (n = max_ngram .. 1) earlier in the row and propose
    what followed its first occurrence (transformers' PromptLookupCandidateGenerator, cut at an EOS token).
    Each row keeps an NgramIndex, extended by the accepted tokens: a proposal is a few dictionary lookups."""

    max_ngram: int = 3
    name: str = "prompt-lookup"
    _eos: tuple[int, ...] = ()
    _rows: _Rows | None = field(default=None, repr=False)
    _index: list[NgramIndex] = field(default_factory=list, repr=False)

    def start(self, ids: torch.Tensor, mask: torch.Tensor, setup: Setup) -> None:
        if self.max_ngram < 1:
            raise ValueError(f"prompt lookup's max_ngram={self.max_ngram} must be at least 1")
        self._rows, self._eos = _Rows(ids, mask), setup.eos
        self._index = [NgramIndex(self.max_ngram).extend(row) for row in self._rows.rows]

    def propose(self, seqs: torch.Tensor, k: int, choose: Choose) -> Proposal:
        assert self._rows is not None
        rows = self._rows.update(seqs)
        out = []
        for row, index in zip(rows, self._index):
            index.extend(row[len(index.row):])
            out.append(index.propose(k, self._eos))
        return Proposal(_stack(out, k, seqs.device))

    def commit(self, length: int) -> None:
        pass


class NgramIndex:
    """Where each n-gram (n <= max_ngram) of a growing row first occurs: prompt lookup in O(max_ngram) a proposal.
    Example: NgramIndex(2).extend([5, 6, 7, 8, 5, 6]).propose(2) -> [7, 8]"""

    def __init__(self, max_ngram: int):
        self.max_ngram = max_ngram
        self.row: list[int] = []
        self.first: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: list[int]) -> NgramIndex:
        row, first = self.row, self.first
        for tok in tokens:
            row.append(tok)
            end = len(row)
            for n in range(1, min(self.max_ngram, end) + 1):
                first.setdefault(tuple(row[end - n:end]), end - n)
        return self

    def propose(self, k: int, eos: tuple[int, ...] = (), min_ngram: int = 1) -> list[int]:
        """Up to k tokens that followed the first occurrence of the row's last n-gram, for the longest n <= max_ngram
        (and >= min_ngram) that occurred before (transformers' order: n from max_ngram down, the earliest
        occurrence), cut before an EOS token; [] when none recurs.
        Example: NgramIndex(3).extend([5, 6, 7, 9, 6, 8, 6]).propose(2, min_ngram=2) -> []"""
        row = self.row
        t = len(row)
        for n in range(min(self.max_ngram, t - 1), max(min_ngram, 1) - 1, -1):
            begin = self.first[tuple(row[t - n:])] + n
            if begin < t:                  # an occurrence before the row's own last n tokens
                out = row[begin:min(begin + k, t)]
                for i, tok in enumerate(out):
                    if tok in eos:
                        return out[:i]
                return out
        return []


def lookup(row: list[int], k: int, max_ngram: int = 3, eos: tuple[int, ...] = ()) -> list[int]:
    """Prompt lookup on one row: NgramIndex(max_ngram).extend(row).propose(k, eos).
    Example: lookup([5, 6, 7, 8, 5, 6], 2) -> [7, 8]"""
    return NgramIndex(max_ngram).extend(row).propose(k, eos)


@dataclass
class NgramDraft:
    """A cache model over archlab's modified Kneser-Ney n-gram model (archlab.eval.ngram.NgramCounts) of order
    `order`. The cache (Kuhn & De Mori 1990; vLLM's n-gram proposer) is the row's own tokens, prompt and generated
    so far: where the last n of them (n = cache_max down to cache_min) occurred earlier in the row, the tokens that
    followed are proposed (prompt lookup's NgramIndex, one-hot); the positions it leaves (no match, or a match near
    the row's end) are drafted by the KN model, counted per row on `data` (training token ids, optional) followed
    by the row's prompt, so a rewrite of the prompt is drafted from the prompt and other text from the data.
    cache_max=0 turns the cache off. Greedy decoding takes the KN model's most likely token (found among the counted
    tokens: one never counted only has back-off mass, below any counted one's); sampling draws from its whole
    distribution after the target's processing. The model is fixed once counted, so each row's log-probabilities
    are kept per history (its last order-1 tokens) after their first use.
    Example: archlab.generate(model, ids, 64, draft=NgramDraft(order=4, data=train_tokens, cache_min=2))"""

    order: int = 3
    data: np.ndarray | None = None
    cache_max: int = 3
    cache_min: int = 2
    name: str = "ngram"
    _models: list = field(default_factory=list, repr=False)
    _rows: _Rows | None = field(default=None, repr=False)
    _index: list[NgramIndex] = field(default_factory=list, repr=False)
    _eos: tuple[int, ...] = ()
    _vocab: int = 0
    _sampling: bool = False

    def start(self, ids: torch.Tensor, mask: torch.Tensor, setup: Setup) -> None:
        from archlab.eval.ngram import NgramCounts

        if self.order < 1:
            raise ValueError(f"the n-gram draft's order {self.order} must be at least 1")
        if self.cache_max and not 1 <= self.cache_min <= self.cache_max:
            raise ValueError(f"the n-gram draft's cache_min={self.cache_min} must be between 1 and "
                             f"cache_max={self.cache_max}")
        self._vocab, self._sampling, self._eos = setup.vocab, setup.sampling, setup.eos
        self._rows = _Rows(ids, mask)
        self._index = [NgramIndex(self.cache_max).extend(row) for row in self._rows.rows] if self.cache_max else []
        head = np.zeros(0, np.int64) if self.data is None else np.asarray(self.data, dtype=np.int64)
        self._models = []
        for row in self._rows.rows:
            stream = np.concatenate((head, np.asarray(row, np.int64)))
            model = NgramCounts(stream, self._vocab, self.order).model(self.order)
            self._models.append((model, None if self._sampling else np.unique(stream), {}))

    def _logits(self, model, seen, memo: dict, history: list[int]) -> torch.Tensor:    # -> (v,)
        key = tuple(history[len(history) - self.order + 1:]) if self.order > 1 else ()
        hit = memo.get(key)
        if hit is None:
            p = model.distribution(list(key), seen)
            if seen is None:
                hit = torch.from_numpy(np.log(p)).float()
            else:
                hit = torch.full((self._vocab,), float("-inf"))
                hit[torch.from_numpy(seen)] = torch.from_numpy(np.log(p)).float()
            memo[key] = hit
        return hit

    def _cached(self, rows: list[list[int]], k: int) -> list[list[int]]:
        """Each row's cache proposal (up to k tokens; [] where its last cache_min..cache_max tokens never recur)."""
        if not self.cache_max:
            return [[] for _ in rows]
        out = []
        for row, index in zip(rows, self._index):
            index.extend(row[len(index.row):])
            out.append(index.propose(k, self._eos, self.cache_min))
        return out

    def propose(self, seqs: torch.Tensor, k: int, choose: Choose) -> Proposal:
        assert self._rows is not None
        rows = self._rows.update(seqs)
        cached = self._cached(rows, k)
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor | None] = []
        drafted: list[list[int]] = [[] for _ in rows]
        for i in range(k):
            from_cache = [len(c) > i for c in cached]
            if all(from_cache):                       # no KN work, and no choose: the cache's tokens are one-hot
                tok, prob = torch.tensor([c[i] for c in cached]), None
            else:
                logits = torch.stack([torch.zeros(self._vocab) if hit else self._logits(model, seen, memo, row + mine)
                                      for hit, row, mine, (model, seen, memo)
                                      in zip(from_cache, rows, drafted, self._models)])                     # (b, v)
                so_far = torch.cat([seqs, *[t[:, None] for t in tokens]], 1) if tokens else seqs
                tok, prob = choose(logits.to(seqs.device), so_far)
                if any(from_cache):
                    hits = torch.tensor(from_cache, device=tok.device)
                    tok = torch.where(hits, torch.tensor([c[i] if h else 0 for c, h in zip(cached, from_cache)],
                                                         device=tok.device), tok)
                    if prob is not None:                                                    # one-hot where cached
                        prob = torch.where(hits[:, None], torch.nn.functional.one_hot(tok, prob.shape[-1]).to(prob),
                                           prob)
            if prob is None and self._sampling:
                prob = torch.nn.functional.one_hot(tok, self._vocab).float()                # (b, v)
            tok = tok.to(seqs.device)
            tokens.append(tok)
            probs.append(prob if prob is None else prob.to(seqs.device))
            for mine, t in zip(drafted, tok.tolist()):
                mine.append(t)
        return _proposal(tokens, probs, seqs.device)

    def commit(self, length: int) -> None:
        pass


# draft names (Python and the CLI) -> a factory; a model or a Draft object is passed as itself
DRAFTS: dict[str, Callable[[], Draft]] = {
    "prompt_lookup": PromptLookupDraft,
    "prompt-lookup": PromptLookupDraft,
    "ngram": NgramDraft,
}


def resolve(draft, *, fast: bool, vocab_limit: int | None) -> Draft:
    """A model, a draft name (DRAFTS) or a Draft object -> a Draft.
    Example: resolve("ngram", fast=True, vocab_limit=None)"""
    if isinstance(draft, str):
        if draft not in DRAFTS:
            raise ValueError(f"draft={draft!r}: give a model or one of {sorted(set(DRAFTS))}")
        return DRAFTS[draft]()
    if isinstance(draft, torch.nn.Module):
        return ModelDraft(draft, fast=fast, vocab_limit=vocab_limit)
    if all(hasattr(draft, a) for a in ("start", "propose", "commit")):
        return draft
    raise TypeError(f"draft must be a model, a Draft, or one of {sorted(set(DRAFTS))}; got {type(draft).__name__}")
