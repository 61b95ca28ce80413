"""Seq2seq pretraining objectives: what a window of tokens becomes for an encoder-decoder.

    span_corruption   T5 (Raffel et al. 2020, §3.1.4; `random_spans_noise_mask` in the released
                      t5/data/preprocessors.py). 15% of the window's tokens, in spans of mean length 3, are each
                      replaced in the source by one sentinel; the target lists each sentinel and the span it hid.
                      The counts depend on the window length only, so every row has the same source and target
                      lengths: no padding.
    text_infilling    BART (Lewis et al. 2020, §2.2 and §5; fairseq's denoising_dataset.py with --mask 0.3
                      --mask-length span-poisson --poisson-lambda 3.5 --replace-length 1 --permute-sentences 1).
                      The sentences of the window are shuffled, then spans with Poisson lengths (a 30% budget)
                      each become ONE mask token (a 0-length span inserts one); the decoder rebuilds the window.

Both are pure functions of (seed, step, micro-batch, rank), as objectives.MaskedLM: a resumed run noises exactly
as the uninterrupted one did.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from archlab.data.objectives import TurnsIds, _tokenizer_size, masked_lm_for, word_starts
from archlab.data.tokens import _mix_seed
from archlab.errors import UserError

__all__ = ["SpanCorruption", "TextInfilling", "span_corruption", "span_lengths", "raw_length_for",
           "random_spans_noise_mask", "replace_spans", "sentinel_ids", "span_corruption_for",
           "text_infilling", "poisson_span_lengths", "infill_spans", "permute_sentences", "sentence_ends",
           "text_infilling_for"]

PAD_TOKENS = ("<pad>", "[PAD]")


# ---------------------------------------------------------------------------------------------- T5 span corruption
def _span_counts(n: int, density: float, mean_span: float) -> tuple[int, int]:
    """(noise tokens, noise spans) of an n-token window, as T5 counts them (Python's round, like tf.round, rounds
    half to even); at least one of each, and at least one kept token per span so the two kinds alternate."""
    if n < 2:
        raise UserError(f"span corruption needs windows of at least 2 tokens, not {n}")
    noise = min(max(round(n * density), 1), n - 1)
    spans = max(round(noise / mean_span), 1)
    if spans > noise or spans > n - noise:
        raise UserError(f"span corruption of {n}-token windows at density {density}, mean span {mean_span}: "
                        f"{spans} spans do not fit {noise} noise and {n - noise} kept tokens")
    return noise, spans


def span_lengths(n: int, density: float = 0.15, mean_span: float = 3.0) -> tuple[int, int]:
    """(source, target) lengths that span corruption gives every n-token window: the kept tokens, one sentinel per
    span and EOS; each span's sentinel, its tokens and EOS. Example: span_lengths(568) == (512, 114)"""
    noise, spans = _span_counts(n, density, mean_span)
    return n - noise + spans + 1, noise + spans + 1


def raw_length_for(source_len: int, density: float = 0.15, mean_span: float = 3.0) -> int:
    """The longest window whose corrupted source fits `source_len` tokens (T5's random_spans_helper: raw windows of
    568 tokens make 512-token sources and 114-token targets). Example: raw_length_for(512) == 568"""
    n = source_len - 1
    while span_lengths(n + 1, density, mean_span)[0] <= source_len:
        n += 1
    return n


def _random_segmentation(items: int, segments: int, rows: int, generator: torch.Generator) -> torch.Tensor:
    """(rows, segments) positive lengths summing to `items`, every such composition equally likely: T5 shuffles
    segments - 1 "a segment starts here" marks over the items after the first."""
    cuts = torch.rand(rows, items - 1, generator=generator).argsort(-1)[:, :segments - 1] + 1
    bounds = torch.cat([torch.zeros(rows, 1, dtype=torch.long), cuts.sort(-1).values,
                        torch.full((rows, 1), items, dtype=torch.long)], dim=1)           # (rows, segments + 1)
    return bounds.diff(dim=-1)


def random_spans_noise_mask(rows: int, n: int, *, generator: torch.Generator, density: float = 0.15,
                            mean_span: float = 3.0) -> torch.Tensor:
    """(rows, n) bool, True on noise: kept and noise spans alternate, kept first (so the window always ends in
    noise, as T5's does), their lengths drawn as random compositions of the two counts."""
    noise, spans = _span_counts(n, density, mean_span)
    kept = _random_segmentation(n - noise, spans, rows, generator)                     # (rows, spans)
    noisy = _random_segmentation(noise, spans, rows, generator)                        # (rows, spans)
    ends = torch.stack([kept, noisy], dim=-1).view(rows, 2 * spans).cumsum(-1)         # (rows, 2 spans)
    first = torch.zeros(rows, n, dtype=torch.long).scatter_(1, ends[:, :-1], 1)        # (rows, n) a segment starts
    return first.cumsum(-1) % 2 == 1


def replace_spans(ids: torch.Tensor, noise: torch.Tensor, *, sentinels: torch.Tensor, eos_id: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, n) ids and noise mask -> (source (b, s), target (b, t)): the source keeps the kept tokens and puts
    sentinel i where noise span i was; the target is sentinel i then span i, for each span (T5 puts sentinels where
    the target's kept spans were; with kept first, their numbers match). Both end in EOS. Every row must have the
    same numbers of noise tokens and spans (random_spans_noise_mask's rows do).
    Example: ids 10..19, noise at 3,4 and 8,9 -> source 10 11 12 S0 15 16 17 S1 eos, target S0 13 14 S1 18 19 eos"""
    def _one_sentinel_per_span(mask: torch.Tensor) -> torch.Tensor:                   # (b, n) -> (b, m)
        first = mask & ~F.pad(mask[:, :-1], (1, 0))                                    # (b, n) a span's first token
        span = (first.long().cumsum(-1) - 1).clamp(min=0)
        if int(span.max()) >= len(sentinels):
            raise UserError(f"span corruption of {ids.shape[1]}-token windows makes {int(span.max()) + 1} spans but "
                            f"there are {len(sentinels)} sentinel ids: pad the model's vocabulary past the tokenizer "
                            "(vocab_size) or use shorter windows")
        out = torch.where(first, sentinels.to(ids.device)[span], ids)
        return out[~mask | first].view(len(ids), -1)

    eos = torch.full((len(ids), 1), eos_id, dtype=ids.dtype, device=ids.device)
    return (torch.cat([_one_sentinel_per_span(noise), eos], dim=1),
            torch.cat([_one_sentinel_per_span(~noise), eos], dim=1))


def span_corruption(ids: torch.Tensor, *, generator: torch.Generator, sentinels: torch.Tensor, eos_id: int,
                    density: float = 0.15, mean_span: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, n) windows -> (source (b, s), target (b, t)), (s, t) = span_lengths(n, density, mean_span) for every
    draw. `sentinels` (k,): the ids that stand for spans 0, 1, ... (T5: <extra_id_0>, <extra_id_1>, ...)."""
    b, n = ids.shape
    noise = random_spans_noise_mask(b, n, generator=generator, density=density, mean_span=mean_span)
    source, target = replace_spans(ids.long(), noise, sentinels=sentinels, eos_id=eos_id)
    assert (source.shape[1], target.shape[1]) == span_lengths(n, density, mean_span)   # fixed lengths: no padding
    return source, target


def sentinel_ids(tokenizer: Any, vocab_size: int) -> torch.Tensor:
    """(k,) the ids standing for spans 0, 1, ...: the tokenizer's <extra_id_0>, <extra_id_1>, ... (T5 counts them
    down from the top of its vocabulary) where it has them, else the ids of a padded vocabulary past the tokenizer,
    from the top down (vocab_size - 1, vocab_size - 2, ...); empty when neither exists."""
    extra: list[int] = []
    while (i := tokenizer.token_to_id(f"<extra_id_{len(extra)}>")) is not None and i < vocab_size:
        extra.append(i)
    if extra:
        return torch.tensor(extra)
    return torch.arange(vocab_size - 1, min(_tokenizer_size(tokenizer, vocab_size), vocab_size) - 1, -1)


@dataclass
class SpanCorruption(TurnsIds):
    """T5's span corruption (Raffel et al. 2020). `batch(x, step, micro, rank)` corrupts one micro-batch."""

    sentinels: torch.Tensor                    # (k,) ids for spans 0, 1, ...
    eos_id: int
    seed: int = 0
    density: float = 0.15
    mean_span: float = 3.0
    generator: torch.Generator = field(default_factory=torch.Generator, repr=False)

    def batch(self, x: torch.Tensor, step: int, micro: int = 0, rank: int = 0
              ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """({"input_ids": (b, s), "attention_mask": (b, s)}, labels (b, t)), the same for the same (seed, step,
        micro, rank); s and t from span_lengths(n): every row is full, every label scored."""
        self.generator.manual_seed(_mix_seed(self.seed, step, micro, rank))
        source, target = span_corruption(x.cpu(), generator=self.generator, sentinels=self.sentinels,
                                         eos_id=self.eos_id, density=self.density, mean_span=self.mean_span)
        return {"input_ids": source, "attention_mask": torch.ones_like(source)}, target


def span_corruption_for(tokenizer: Any, vocab_size: int, *, seed: int = 0, eos_id: int | None = None,
                        density: float = 0.15, mean_span: float = 3.0) -> SpanCorruption:
    """T5's objective for this tokenizer: its <extra_id_i> sentinels, else ids past it in a padded vocabulary;
    EOS `eos_id`, else the tokenizer's end-of-text token. Neither sentinels nor EOS is a UserError naming the fix.
    Example: inputs, labels = span_corruption_for(tok, 8192).batch(x, step=0)"""
    sentinels = sentinel_ids(tokenizer, vocab_size)
    if not len(sentinels):
        raise UserError("span corruption needs sentinel ids: a tokenizer with <extra_id_0>, <extra_id_1>, ... or a "
                        f"model vocab_size past the tokenizer's {_tokenizer_size(tokenizer, vocab_size)} tokens "
                        "(e.g. --set vocab_size=...)")
    eos_id = eos_id if eos_id is not None else getattr(tokenizer, "eot_id", None)
    if eos_id is None:
        raise UserError("span corruption ends sources and targets with EOS: the tokenizer has no end-of-text token "
                        "(train one with --special-tokens '<|endoftext|>')")
    return SpanCorruption(sentinels, eos_id, seed=seed, density=density, mean_span=mean_span)


# ------------------------------------------------------------------------------------------- BART text infilling
def poisson_span_lengths(budget: int, poisson_lambda: float, generator: torch.Generator) -> torch.Tensor:
    """(k,) span lengths ~ Poisson(lambda) drawn until they cover `budget` tokens, the last one cut so that they
    sum to exactly `budget` (fairseq's add_whole_word_mask); zeros stay in (each is an inserted mask)."""
    rate = torch.full((budget,), float(poisson_lambda))
    lengths = torch.poisson(rate, generator=generator).long()
    while int(lengths.sum()) < budget:
        lengths = torch.cat([lengths, torch.poisson(rate, generator=generator).long()])
    total = lengths.cumsum(0)
    k = int(torch.searchsorted(total, budget))               # the first span that reaches the budget
    lengths = lengths[:k + 1].clone()
    lengths[k] = budget - (int(total[k - 1]) if k else 0)
    return lengths


def _cover(begin: torch.Tensor, end: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) bool: inside any [begin_i, end_i)."""
    edges = torch.zeros(n + 1, dtype=torch.long)
    edges.index_add_(0, begin, torch.ones_like(begin))
    edges.index_add_(0, end, -torch.ones_like(end))
    return edges.cumsum(0)[:n] > 0


def infill_spans(row: torch.Tensor, begin: torch.Tensor, lengths: torch.Tensor, *, mask_id: int,
                 word: torch.Tensor, special: torch.Tensor) -> torch.Tensor:
    """(n,) row, spans starting at tokens `begin` (k,) and running `lengths` (k,) words -> (m,) the row with each
    span replaced by one mask. `word` (n,) bool: a word starts here; `special` (n,) bool: spans stop before these
    (and before the window's end). Overlapping spans merge into one mask, as in fairseq (a span's first token
    becomes the mask unless another span has already swallowed it); adjacent ones stay two masks."""
    n = len(row)
    word_pos = torch.cat([word.nonzero().flatten(), torch.tensor([n])])                # (w + 1,) word starts, end
    word_index = word.long().cumsum(0) - 1                                              # (n,) word of each token
    end = word_pos[(word_index[begin] + lengths).clamp(max=len(word_pos) - 1)]          # (k,) L words on
    next_special = torch.where(special, torch.arange(n), n).flip(0).cummin(0).values.flip(0)   # (n,)
    end = torch.minimum(end, next_special[begin])
    covered = _cover(begin, end, n)
    masked = torch.zeros(n, dtype=torch.bool)
    masked[begin] = True
    masked &= ~_cover(begin + 1, end, n)                                                # not inside another span
    return torch.where(masked, mask_id, row)[~covered | masked]


def _insert_masks(row: torch.Tensor, count: int, mask_id: int, generator: torch.Generator) -> torch.Tensor:
    """(m,) -> (m + count,): `count` masks at random places (fairseq's add_insertion_noise)."""
    total = len(row) + count
    out = torch.full((total,), mask_id, dtype=row.dtype)
    kept = torch.ones(total, dtype=torch.bool)
    kept[torch.randperm(total, generator=generator)[:count]] = False
    out[kept] = row
    return out


def text_infilling(ids: torch.Tensor, *, generator: torch.Generator, mask_id: int, ratio: float = 0.3,
                   poisson_lambda: float = 3.5, special: torch.Tensor | None = None,
                   starts: torch.Tensor | None = None, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, n) windows -> (source (b, n), attention_mask (b, n) int64). Per row: a budget of ceil(ratio x words)
    tokens in Poisson(lambda) spans starting at distinct random words, each span one mask (fairseq
    --replace-length 1); the source is right-padded with `pad_id` to n, or cut to n when inserted masks made it
    longer. `special` (v,) bool: ids never noised (spans stop before them); `starts` (v,) bool: whole words
    (objectives.word_starts), else every token is a word. Overlapping spans merge, so fewer tokens than the budget
    end up masked (about 26% for 0.3 and lambda 3.5), as in fairseq."""
    if not 0.0 <= ratio <= 1.0 or not poisson_lambda > 0:
        raise UserError(f"text infilling needs 0 <= ratio <= 1 and poisson_lambda > 0, not {ratio}, {poisson_lambda}")
    b, n = ids.shape
    ids = ids.long()
    stop = special[ids] if special is not None else torch.zeros_like(ids, dtype=torch.bool)   # (b, n)
    word = starts[ids] if starts is not None else torch.ones_like(ids, dtype=torch.bool)      # (b, n)
    word = word | stop | F.pad(stop[:, :-1], (1, 0))          # a special is a word, and so is what follows it
    word[:, 0] = True                                         # the window's first token starts its first word
    source = torch.full((b, n), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, n), dtype=torch.long)
    for r in range(b):
        candidates = (word[r] & ~stop[r]).nonzero().flatten()                           # (w,) where spans start
        budget = math.ceil(len(candidates) * ratio)
        row = ids[r]
        if budget:
            lengths = poisson_span_lengths(budget, poisson_lambda, generator)
            spans = lengths[lengths > 0]
            begin = candidates[torch.randperm(len(candidates), generator=generator)[:len(spans)]]
            row = infill_spans(row, begin, spans, mask_id=mask_id, word=word[r], special=stop[r])
            row = _insert_masks(row, len(lengths) - len(spans), mask_id, generator)
        m = min(len(row), n)
        source[r, :m], attention_mask[r, :m] = row[:m], 1
    return source, attention_mask


def permute_sentences(ids: torch.Tensor, *, generator: torch.Generator, sentence_end: torch.Tensor) -> torch.Tensor:
    """(b, n) -> (b, n): the sentences of each row in a random order (BART's sentence permutation). A sentence
    ends after a run of `sentence_end` (v,) ids ("?!" ends one sentence); the window's first and last pieces count
    as sentences."""
    b, n = ids.shape
    end = sentence_end[ids]                                                            # (b, n)
    boundary = end & ~F.pad(end[:, 1:], (0, 1))                                        # (b, n) last of a run
    sentence = F.pad(boundary[:, :-1].long().cumsum(-1), (1, 0))                       # (b, n) sentence index
    rank = torch.rand(b, n, generator=generator).argsort(-1)                          # (b, n) a random order
    key = rank.gather(1, sentence) * n + torch.arange(n)                               # sentences stay whole
    return ids.gather(1, key.argsort(-1))


def sentence_ends(tokenizer: Any, vocab_size: int) -> torch.Tensor:
    """(v,) bool: ids whose piece ends a sentence (". ! ?", then only whitespace) and special tokens (a document's
    end); ids past the tokenizer never. A decimal point ends one too: the pieces alone cannot tell."""
    table = torch.zeros(vocab_size, dtype=torch.bool)
    for i in range(min(vocab_size, _tokenizer_size(tokenizer, vocab_size))):
        piece = tokenizer.id_to_token(i)
        if isinstance(piece, bytes):
            piece = piece.decode("utf-8", "replace")
        table[i] = piece.rstrip(" \t\r\n\u0120\u010a\u2581").endswith((".", "!", "?"))   # Ġ Ċ ▁: marked spaces
    for token in getattr(tokenizer, "special_tokens", None) or []:
        j = tokenizer.token_to_id(token)
        if j is not None and j < vocab_size:
            table[j] = True
    return table


@dataclass
class TextInfilling(TurnsIds):
    """BART's text infilling and sentence permutation (Lewis et al. 2020). `batch(x, step, micro, rank)` noises one
    micro-batch; the labels are the windows themselves."""

    mask_id: int
    special: torch.Tensor                      # (v,) bool: never noised
    seed: int = 0
    ratio: float = 0.3
    poisson_lambda: float = 3.5
    pad_id: int = 0
    starts: torch.Tensor | None = None         # (v,) bool: whole-word spans
    sentence_end: torch.Tensor | None = None   # (v,) bool: permute sentences first; None: not
    generator: torch.Generator = field(default_factory=torch.Generator, repr=False)

    def batch(self, x: torch.Tensor, step: int, micro: int = 0, rank: int = 0
              ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """({"input_ids": (b, n), "attention_mask": (b, n)}, labels = x (b, n)), the same for the same (seed,
        step, micro, rank)."""
        self.generator.manual_seed(_mix_seed(self.seed, step, micro, rank))
        x = x.cpu().long()
        source = x
        if self.sentence_end is not None:
            source = permute_sentences(source, generator=self.generator, sentence_end=self.sentence_end)
        source, attention_mask = text_infilling(source, generator=self.generator, mask_id=self.mask_id,
                                                ratio=self.ratio, poisson_lambda=self.poisson_lambda,
                                                special=self.special, starts=self.starts, pad_id=self.pad_id)
        return {"input_ids": source, "attention_mask": attention_mask}, x


def text_infilling_for(tokenizer: Any, vocab_size: int, *, seed: int = 0, mask_id: int | None = None,
                       ratio: float = 0.3, poisson_lambda: float = 3.5, permute_sentences: bool = True,
                       whole_word: bool = True) -> TextInfilling:
    """BART's objective for this tokenizer: its mask token (<mask> or [MASK]) unless `mask_id` names one, its
    special tokens never noised, spans over whole words (fairseq's span-poisson masks words), padding with its
    <pad> / [PAD] (else 0: the attention mask hides it). No mask token is a UserError naming the fix.
    Example: inputs, labels = text_infilling_for(tok, 8192).batch(x, step=0)"""
    masking = masked_lm_for(tokenizer, vocab_size, mask_id=mask_id, needed_by="text infilling",   # the mask id and
                            suggested="<mask>")                                                 # the specials
    pad_id = next((i for i in map(tokenizer.token_to_id, PAD_TOKENS) if i is not None and i < vocab_size), 0)
    return TextInfilling(masking.mask_id, masking.special, seed=seed, ratio=ratio, poisson_lambda=poisson_lambda,
                         pad_id=pad_id, starts=word_starts(tokenizer, vocab_size) if whole_word else None,
                         sentence_end=sentence_ends(tokenizer, vocab_size) if permute_sentences else None)
