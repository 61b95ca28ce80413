"""Training objectives: what a batch of token windows becomes before the model sees it.

    next_token   decoder LMs: inputs x, targets y = x shifted by one (GPT)
    mlm          encoders: BERT's masked LM (Devlin et al. 2019). Each token (special tokens never) is chosen
                 with probability 0.15; a chosen token becomes [MASK] 80% of the time, a random token 10%,
                 and stays itself 10%; the loss is scored on the chosen tokens only. Whole-word masking
                 (BERT's later release) chooses words instead and masks all of a chosen word's pieces.

Masking is a pure function of (seed, step, micro-batch, rank): a resumed run masks exactly as the uninterrupted
one did, with no random state to save.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from archlab.data import _mix_seed
from archlab.errors import UserError

__all__ = ["MaskedLM", "mask_tokens", "word_starts", "masked_lm_for", "objective_for", "IGNORE"]

IGNORE = -100                 # the label of a slot the loss does not score
MASK_TOKENS = ("[MASK]", "<mask>")


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
class MaskedLM:
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
                  mask_id: int | None = None, prob: float = 0.15) -> MaskedLM:
    """The MLM objective for this tokenizer: its mask token ([MASK] or <mask>) unless `mask_id` names one (e.g. an
    id past a byte tokenizer in a padded vocabulary), its special tokens never masked. A tokenizer without a
    mask token and no `mask_id` is a UserError naming how to get one.
    Example: x_masked, labels = masked_lm_for(tok, 8000).batch(x, step=0)"""
    if mask_id is None:
        mask_id = next((i for i in map(tokenizer.token_to_id, MASK_TOKENS) if i is not None), None)
    if mask_id is None:
        raise UserError("masked-LM training needs a mask token in the tokenizer ([MASK] or <mask>): train one with "
                        "`archlab tokenizer train ... --special-tokens '<|endoftext|>' '[MASK]'`, or set "
                        "train.mask_token_id to an id past the tokenizer in a padded vocabulary")
    if not 0 <= mask_id < vocab_size:
        raise UserError(f"train.mask_token_id={mask_id} is outside the model's vocabulary (vocab_size={vocab_size})")
    special = torch.zeros(vocab_size, dtype=torch.bool)
    for token in getattr(tokenizer, "special_tokens", None) or []:
        i = tokenizer.token_to_id(token)
        if i is not None and i < vocab_size:
            special[i] = True
    special[mask_id] = True
    special[min(_tokenizer_size(tokenizer, vocab_size), vocab_size):] = True   # padded vocabulary: never drawn
    starts = word_starts(tokenizer, vocab_size) if whole_word else None
    return MaskedLM(mask_id, vocab_size, special, seed=seed, prob=prob, starts=starts)


def objective_for(model_cfg: Any, train_cfg: Any, dataset: Any) -> MaskedLM | None:
    """What the trainer turns each batch with: BERT's masked LM for an encoder (its train.* settings, the
    tokenizer of `dataset`, an archlab.data.TokenDataset, loaded only then), None (next-token targets as
    sampled) for a decoder. Example: objective_for(model_cfg, train_cfg, TokenDataset(data_dir, "val"))"""
    if model_cfg.arch != "encoder":
        return None
    return masked_lm_for(dataset.load_tokenizer(), model_cfg.vocab_size, seed=train_cfg.seed,
                         whole_word=train_cfg.whole_word_mask, mask_id=train_cfg.mask_token_id,
                         prob=train_cfg.mlm_probability)
