"""Training objectives: what the rows a sampler drew become before the model sees them.

    next_token   decoder LMs: inputs x, targets y = x shifted by one (GPT); with train.document_masks, the
                 window's documents (ended by the end-of-text id) attend only within themselves (DocumentMasks)
    mlm          encoders: BERT's masked LM (Devlin et al. 2019). Each token (special tokens never) is chosen
                 with probability 0.15; a chosen token becomes [MASK] 80% of the time, a random token 10%,
                 and stays itself 10%; the loss is scored on the chosen tokens only. Whole-word masking
                 (BERT's later release) chooses words instead and masks all of a chosen word's pieces.
    next_sentence  encoders: BERT's pretraining, the masked LM over `[CLS] A [SEP] B [SEP]` rows that a sampler
                 draws from a data folder's sentence index (archlab.data.next_sentence)
    span_corruption   encoder-decoders: T5's (archlab.data.noising.SpanCorruption)
    text_infilling    encoder-decoders: BART's (archlab.data.noising.TextInfilling)
    continuation      any kind: the window's first `train.prefix_fraction` is context, the rest is scored (004's
                 decoder-only vs prefix-LM vs encoder-decoder comparison: the same scored tokens for all three)

An objective (the Objective protocol) turns Rows (archlab.data.tokens: a window batch x (b, n) with its next-token
targets, or a sampler's own rows) into (inputs, labels): inputs a dict of the model's forward keywords
(input_ids, attention_mask, prefix_lengths, document_ids, ...), labels (b, t) with IGNORE on unscored slots.
train.objective names one; archlab.data.batches.OBJECTIVES builds it.

Masking is a pure function of (seed, step, micro-batch, rank): a resumed run masks exactly as the uninterrupted
one did, with no random state to save.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from archlab.data.tokens import Rows, _mix_seed
from archlab.errors import UserError

__all__ = ["Batch", "Objective", "TurnsIds", "NextToken", "MaskedLM", "Continuation", "DocumentMasks",
           "mask_tokens", "word_starts", "masked_lm_for", "IGNORE"]

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]     # (inputs: the model's forward keywords, labels)
IGNORE = -100                 # the label of a slot the loss does not score
MASK_TOKENS = ("[MASK]", "<mask>")


class Objective(Protocol):
    """What the trainer and evaluation ask of an objective: `turn` the rows drawn for (step, micro-step, rank)
    into the model's (inputs, labels), a pure function of those and the objective's seed; and whether the loss
    over them is a code length of the text (`scores_text`: bits per byte mean something)."""

    scores_text: ClassVar[bool]

    def turn(self, rows: Rows, step: int, micro: int = 0, rank: int = 0) -> Batch: ...


class TurnsIds:
    """Objective.turn for an objective whose `batch(x, step, micro, rank)` reads the rows' ids alone: inputs given
    as the input_ids tensor become {"input_ids": ...}, and the rows' own inputs (a sentence pair's token types,
    attention mask and labels) ride along."""

    scores_text: ClassVar[bool] = False

    def batch(self, x: torch.Tensor, step: int, micro: int = 0, rank: int = 0
              ) -> tuple[dict[str, torch.Tensor] | torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def turn(self, rows: Rows, step: int, micro: int = 0, rank: int = 0) -> Batch:
        inputs, labels = self.batch(rows.ids, step, micro, rank)
        return {**(inputs if isinstance(inputs, dict) else {"input_ids": inputs}), **rows.inputs}, labels


@dataclass(frozen=True)
class NextToken:
    """Next-token prediction (GPT): the windows as inputs, the sampler's next-token targets as labels."""

    scores_text: ClassVar[bool] = True

    def turn(self, rows: Rows, step: int = 0, micro: int = 0, rank: int = 0) -> Batch:
        return {"input_ids": rows.ids, **rows.inputs}, _targets(rows, "next-token prediction")


def _targets(rows: Rows, objective: str) -> torch.Tensor:
    if rows.targets is None:
        raise ValueError(f"{objective} reads the next-token targets of windows; these rows have none")
    return rows.targets


def mask_tokens(ids: torch.Tensor, *, mask_id: int, vocab_size: int, generator: torch.Generator,
                prob: float = 0.15, special: torch.Tensor | None = None, starts: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, t) ids -> (inputs, labels), both (b, t): labels hold the original token where one was chosen, else
    IGNORE. `special` (v,) bool: ids never chosen (and never drawn as random replacements). `starts` (v,) bool:
    whole-word masking, True for ids that begin a word; a word is its start and the non-start ids after it.
    Example: inputs, labels = mask_tokens(ids, mask_id=3, vocab_size=1000, generator=torch.Generator())"""
    ids = ids.long()
    noise = torch.rand(ids.shape, generator=generator)
    if starts is not None:                           # one draw per word: each piece takes its word's draw
        word = starts[ids].long().cumsum(-1)         # (b, t) word index within the row (0: before any start)
        word_noise = torch.rand(ids.shape, generator=generator)
        noise = torch.where(word > 0, word_noise.gather(-1, (word - 1).clamp(min=0)), noise)
    chosen = noise < prob
    if special is not None:
        chosen &= ~special[ids]
    labels = torch.where(chosen, ids, IGNORE)
    action = torch.rand(ids.shape, generator=generator)   # < 0.8 [MASK], < 0.9 random, else kept
    randoms = torch.randint(vocab_size, ids.shape, generator=generator)
    if special is not None and bool(special.any()):       # redraw specials as ordinary tokens
        ordinary = (~special).nonzero().flatten()
        randoms = ordinary[torch.randint(len(ordinary), ids.shape, generator=generator)]
    inputs = torch.where(chosen & (action < 0.8), mask_id, ids)
    inputs = torch.where(chosen & (action >= 0.8) & (action < 0.9), randoms, inputs)
    return inputs, labels


def word_starts(tokenizer: Any, vocab_size: int) -> torch.Tensor:
    """(v,) bool: which ids begin a word, from the tokenizer's pieces. WordPiece (`tokens` with `##`
    continuations): every piece not prefixed `##`; byte-level BPE / Unigram: pieces whose first byte is
    whitespace (GPT-2 pre-tokens carry their leading space); specials and ids past the tokenizer: words of
    their own. Example: starts = word_starts(tok, model.config.vocab_size)"""
    size = min(vocab_size, _tokenizer_size(tokenizer, vocab_size))
    starts = torch.ones(vocab_size, dtype=torch.bool)
    pieces = getattr(tokenizer, "tokens", None)
    for i in range(size):
        if isinstance(pieces, list) and i < len(pieces):
            starts[i] = not (pieces[i].startswith("##") and len(pieces[i]) > 2)
            continue
        piece = tokenizer.id_to_token(i)
        if isinstance(piece, str):                   # HF tokenizers: GPT-2's byte alphabet or SentencePiece's
            starts[i] = piece[:1] in ("Ġ", "Ċ", "▁", " ", "\n") or not piece
        else:
            starts[i] = piece[:1] in (b" ", b"\n", b"\t") or not piece
    for token in getattr(tokenizer, "special_tokens", None) or []:
        j = tokenizer.token_to_id(token)
        if j is not None and j < vocab_size:
            starts[j] = True
    return starts


def _tokenizer_size(tokenizer: Any, default: int) -> int:
    size = getattr(tokenizer, "vocab_size", None)
    return int(size) if isinstance(size, int) else default


@dataclass
class MaskedLM(TurnsIds):
    """BERT's MLM objective, bound to a tokenizer's ids. `batch(x, step, micro, rank)` masks one micro-batch."""

    mask_id: int
    vocab_size: int
    special: torch.Tensor                      # (v,) bool
    seed: int = 0
    prob: float = 0.15
    starts: torch.Tensor | None = None         # (v,) bool for whole-word masking
    generator: torch.Generator = field(default_factory=torch.Generator, repr=False)

    def batch(self, x: torch.Tensor, step: int, micro: int = 0, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) for this window batch, the same every time for the same (seed, step, micro, rank)."""
        self.generator.manual_seed(_mix_seed(self.seed, step, micro, rank))
        return mask_tokens(x.cpu(), mask_id=self.mask_id, vocab_size=self.vocab_size, generator=self.generator,
                           prob=self.prob, special=self.special, starts=self.starts)


def masked_lm_for(tokenizer: Any, vocab_size: int, *, seed: int = 0, whole_word: bool = False,
                  mask_id: int | None = None, prob: float = 0.15, needed_by: str = "masked-LM training",
                  suggested: str = "[MASK]") -> MaskedLM:
    """The MLM objective for this tokenizer: its mask token ([MASK] or <mask>) unless `mask_id` names one (e.g. an
    id past a byte tokenizer in a padded vocabulary), its special tokens never masked. A tokenizer without a
    mask token and no `mask_id` is a UserError naming how to get one (`needed_by`: the objective it names,
    `suggested`: the token its command adds; BART's infilling reuses this lookup).
    Example: x_masked, labels = masked_lm_for(tok, 8000).batch(x, step=0)"""
    if mask_id is None:
        mask_id = next((i for i in map(tokenizer.token_to_id, MASK_TOKENS) if i is not None), None)
    if mask_id is None:
        raise UserError(f"{needed_by} needs a mask token in the tokenizer ({' or '.join(MASK_TOKENS)}): train one "
                        f"with `archlab tokenizer train ... --special-tokens '<|endoftext|>' '{suggested}'`, or set "
                        "train.mlm.mask_token_id to an id past the tokenizer in a padded vocabulary")
    if not 0 <= mask_id < vocab_size:
        raise UserError(f"train.mlm.mask_token_id={mask_id} is outside the model's vocabulary "
                        f"(vocab_size={vocab_size})")
    special = torch.zeros(vocab_size, dtype=torch.bool)
    for token in getattr(tokenizer, "special_tokens", None) or []:
        i = tokenizer.token_to_id(token)
        if i is not None and i < vocab_size:
            special[i] = True
    special[mask_id] = True
    special[min(_tokenizer_size(tokenizer, vocab_size), vocab_size):] = True   # padded vocabulary: never drawn
    starts = word_starts(tokenizer, vocab_size) if whole_word else None
    return MaskedLM(mask_id, vocab_size, special, seed=seed, prob=prob, starts=starts)


@dataclass
class Continuation(TurnsIds):
    """004's comparison at a matched scored set: the first `prefix` tokens of each window are context, the rest is
    scored. A decoder reads the whole window causally (a prefix-LM attends bidirectionally inside the prefix) and
    is scored on predicting tokens prefix..n-1; an encoder-decoder encodes the prefix and decodes the rest. Both
    process n tokens per row and score the same n - prefix targets.
    Example: inputs, labels = Continuation(prefix=64, arch="encoder_decoder").batch(x)   # x (b, 128)"""

    prefix: int
    arch: str
    prefix_lm: bool = False
    scores_text: ClassVar[bool] = True

    def batch(self, x: torch.Tensor, step: int = 0, micro: int = 0, rank: int = 0
              ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        b, n = x.shape
        if not 0 < self.prefix < n:
            raise UserError(f"a continuation needs 0 < prefix < window: prefix={self.prefix}, window={n}")
        if self.arch == "encoder_decoder":
            return {"input_ids": x[:, :self.prefix]}, x[:, self.prefix:]                 # (b, p), (b, n - p)
        labels = torch.full_like(x, IGNORE)                                              # (b, n)
        labels[:, self.prefix - 1:-1] = x[:, self.prefix:]     # slot j predicts token j + 1
        inputs = {"input_ids": x}
        if self.prefix_lm:
            inputs["prefix_lengths"] = torch.full((b,), self.prefix, dtype=torch.long)
        return inputs, labels


@dataclass(frozen=True)
class DocumentMasks:
    """Next-token prediction over the documents of a window (train.document_masks; Llama 3 report §3.2): the token
    stream ends each document with the end-of-text id, so slot j belongs to document k when k end-of-text tokens
    come before it (an end-of-text token belongs to the document it ends). The model gets these as
    `document_ids` (no slot attends across a boundary, positions restart at each document), and the label that
    would predict a document's first token from the previous one's end-of-text token is ignored, as transformers'
    DataCollatorWithFlattening ignores each example's first label.
    Example: DocumentMasks(eot_id=2).batch(x, targets=y)   # x = [[5, 2, 7, 8]] -> document_ids [[0, 0, 1, 1]]"""

    eot_id: int
    scores_text: ClassVar[bool] = True

    def batch(self, x: torch.Tensor, step: int = 0, micro: int = 0, rank: int = 0, *, targets: torch.Tensor
              ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        ends = (x == self.eot_id).long()                                        # (b, n)
        documents = ends.cumsum(-1) - ends                                      # end-of-text tokens before slot j
        labels = targets.masked_fill(ends.bool(), IGNORE)   # slot j predicts token j + 1: a new document's first
        return {"input_ids": x, "document_ids": documents}, labels

    def turn(self, rows: Rows, step: int = 0, micro: int = 0, rank: int = 0) -> Batch:
        """batch() of the windows, labels from the sampler's next-token targets."""
        inputs, labels = self.batch(rows.ids, targets=_targets(rows, "train.document_masks"))
        return {**inputs, **rows.inputs}, labels
