"""Logits processors: rules that edit the next-token scores from the sequence so far, each the rule
of the transformers LogitsProcessor it is named after (tests compare them on random scores).

    no_repeat_ngram      NoRepeatNGramLogitsProcessor: a token that would complete an n-gram already
                         in the row gets -inf (the prompt counts, as in transformers).
    bad_words            NoBadWordsLogitsProcessor: the last token of a banned sequence gets -inf when
                         the row ends with the rest of it (one-token sequences: always).
    min_length           MinLengthLogitsProcessor: EOS gets -inf while the row is shorter than
                         min_length (prompt included).
    min_new_tokens       MinNewTokensLengthLogitsProcessor: the same, counting generated tokens.
    forced_bos           ForcedBOSTokenLogitsProcessor: when the row holds one token, only this one.
    forced_eos           ForcedEOSTokenLogitsProcessor: the last token allowed (length max_length - 1
                         so far) can only be EOS.
    repetition_penalty   RepetitionPenaltyLogitsProcessor: tokens already in the row (left padding
                         skipped) have their score divided by the penalty if positive, multiplied if
                         negative (sampling.apply_repetition_penalty).

Every processor is a function `(seqs, scores) -> scores`: seqs (r, t) long is each row so far, the
prompt as given (its left padding included) followed by the generated tokens, scores (r, v) float.
`build` composes the ones a generation asks for in transformers' order (repetition penalty,
no-repeat n-gram, bad words, min length, min new tokens, forced BOS, forced EOS); `apply` runs them.
Greedy decoding and sampling apply them to the logits, before temperature and the sampling filters;
beam search to the log-probabilities: both as transformers' generate does.
"""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from archlab.generation.sampling import apply_repetition_penalty

if TYPE_CHECKING:
    from archlab.generation.config import GenerationConfig

Processor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
NEG_INF = float("-inf")


def _spare_column(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Ids outside [0, vocab) (padding such as -1, ids past a cut vocabulary) -> the spare column `vocab`."""
    return torch.where((tokens < 0) | (tokens >= vocab), vocab, tokens)


def no_repeat_ngram(seqs: torch.Tensor, scores: torch.Tensor, n: int) -> torch.Tensor:
    """Ban every token that would complete an n-gram the row already holds."""
    r, t = seqs.shape
    if t < n:
        return scores
    prefix = seqs[:, t - n + 1:]                                   # (r, n-1): what the next n-gram starts with
    windows = seqs.unfold(1, n, 1)                                 # (r, t-n+1, n): every n-gram so far
    hit = (windows[..., :-1] == prefix[:, None]).all(-1)           # (r, t-n+1): n-grams with that start
    vocab = scores.shape[-1]
    banned = torch.zeros(r, vocab + 1, dtype=torch.bool, device=scores.device)
    banned.scatter_(1, torch.where(hit, _spare_column(windows[..., -1], vocab), vocab), True)
    return scores.masked_fill(banned[:, :vocab], NEG_INF)


def bad_words(seqs: torch.Tensor, scores: torch.Tensor, words: Sequence[Sequence[int]]) -> torch.Tensor:
    """Ban the last token of each word (a token sequence) in the rows that end with the rest of it."""
    vocab = scores.shape[-1]
    past = sorted({tok for word in words for tok in word if tok >= vocab})
    if past:
        raise ValueError(f"bad_words_ids names token(s) {past} past the model's vocabulary of {vocab}")
    banned = torch.zeros_like(scores, dtype=torch.bool)
    for word in words:
        *head, last = word
        if not head:
            banned[:, last] = True
        elif len(head) <= seqs.shape[1]:
            ends = (seqs[:, -len(head):] == torch.tensor(head, device=seqs.device)).all(-1)   # (r,)
            banned[:, last] |= ends
    return scores.masked_fill(banned, NEG_INF)


def _ban_eos(scores: torch.Tensor, eos: Sequence[int]) -> torch.Tensor:
    banned = torch.zeros(scores.shape[-1], dtype=torch.bool, device=scores.device)
    banned[[e for e in eos if 0 <= e < scores.shape[-1]]] = True
    return scores.masked_fill(banned, NEG_INF)


def min_length(seqs: torch.Tensor, scores: torch.Tensor, length: int, eos: Sequence[int]) -> torch.Tensor:
    """No EOS while the rows (prompt width included) are shorter than `length`."""
    return _ban_eos(scores, eos) if seqs.shape[1] < length else scores


def min_new_tokens(seqs: torch.Tensor, scores: torch.Tensor, count: int, prompt_width: int,
                   eos: Sequence[int]) -> torch.Tensor:
    """No EOS before `count` tokens have been generated."""
    return _ban_eos(scores, eos) if seqs.shape[1] - prompt_width < count else scores


def _only(scores: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
    out = torch.full_like(scores, NEG_INF)
    out[:, list(tokens)] = 0.0
    return out


def forced_bos(seqs: torch.Tensor, scores: torch.Tensor, token: int) -> torch.Tensor:
    """The token after a one-token row is `token` (score 0, every other -inf)."""
    return _only(scores, [token]) if seqs.shape[1] == 1 else scores


def forced_eos(seqs: torch.Tensor, scores: torch.Tensor, tokens: Sequence[int], max_length: int) -> torch.Tensor:
    """The last token a row of at most `max_length` can take is EOS (one of `tokens`)."""
    return _only(scores, tokens) if seqs.shape[1] == max_length - 1 else scores


def repetition_penalty(seqs: torch.Tensor, scores: torch.Tensor, penalty: float,
                       skip: torch.Tensor | None = None) -> torch.Tensor:
    """Penalize the tokens a row holds; skip (r,) long: leading slots (left padding) not counted."""
    r, t = seqs.shape
    vocab = scores.shape[-1]
    ids = _spare_column(seqs, vocab)
    if skip is not None:
        ids = ids.masked_fill(torch.arange(t, device=seqs.device)[None] < skip.to(seqs.device)[:, None], vocab)
    seen = torch.zeros(r, vocab + 1, dtype=torch.bool, device=scores.device).scatter_(1, ids, True)[:, :vocab]
    return apply_repetition_penalty(scores, seen, penalty)


def build(cfg: GenerationConfig, *, eos: Sequence[int], prompt_width: int, max_length: int,
          padding: torch.Tensor | None = None, penalty: bool = True) -> list[Processor]:
    """The processors `cfg` names, in transformers' order. eos: the EOS ids in force; prompt_width: the
    prompt's padded width; max_length: prompt_width + max_new_tokens; padding (r,): each row's
    left-padding slots, which the repetition penalty skips (transformers reads them from the attention
    mask); penalty=False leaves the repetition penalty to the caller (sampling.next_token). Bad words
    that are a lone EOS token are dropped, as transformers drops them."""
    out: list[Processor] = []
    if penalty and cfg.repetition_penalty is not None and cfg.repetition_penalty != 1.0:
        out.append(partial(repetition_penalty, penalty=cfg.repetition_penalty, skip=padding))
    if cfg.no_repeat_ngram_size:
        out.append(partial(no_repeat_ngram, n=cfg.no_repeat_ngram_size))
    words = [w for w in cfg.bad_words_ids or () if not (len(w) == 1 and w[0] in eos)]
    if words:
        out.append(partial(bad_words, words=words))
    if cfg.min_length and eos:
        out.append(partial(min_length, length=cfg.min_length, eos=tuple(eos)))
    if cfg.min_new_tokens and eos:
        out.append(partial(min_new_tokens, count=cfg.min_new_tokens, prompt_width=prompt_width, eos=tuple(eos)))
    if cfg.forced_bos_token_id is not None:
        out.append(partial(forced_bos, token=cfg.forced_bos_token_id))
    if cfg.forced_eos_token_id is not None:
        out.append(partial(forced_eos, tokens=cfg.forced_eos_token_id, max_length=max_length))
    return out


def apply(processors: Sequence[Processor], seqs: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    for proc in processors:
        scores = proc(seqs, scores)
    return scores
