"""BERT's next-sentence pairs (Devlin et al. 2019, §3.1 task #2, A.1-A.2): a sampler of `[CLS] A [SEP] B [SEP]`
rows drawn from a split's sentence index (archlab.data.tokens, prepare(sentences=True)).

train.objective=next_sentence is this sampler composed with BERT's masked LM (objectives.MaskedLM): the sampler
draws the rows, with their token types, attention mask and IsNext / NotNext labels; the objective masks their
ids as it masks any window (next_sentence_for builds the two, the mask never choosing [CLS], [SEP] or padding).
The rows are a pure function of (seed, step, micro-step, rank), like every objective's draws; the sampler's
counter is all a checkpoint keeps, in the same form as a token window sampler's.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from archlab.data.objectives import MaskedLM, masked_lm_for
from archlab.data.tokens import DataError, Rows, StepSampler, _mix_seed
from archlab.errors import UserError

__all__ = ["NextSentencePairs", "next_sentence_for", "truncated_lengths", "NSP_TOKENS", "IS_NEXT", "NOT_NEXT"]

NSP_TOKENS = ("[CLS]", "[SEP]")
IS_NEXT, NOT_NEXT = 0, 1      # next_sentence_labels, as transformers' BertForPreTraining reads them


def truncated_lengths(len_a: int, len_b: int, max_tokens: int) -> tuple[int, int]:
    """(len A, len B) after BERT's truncate_seq_pair: one token at a time off the longer side (B on ties) until
    len A + len B <= max_tokens. Example: truncated_lengths(10, 3, 8) -> (5, 3)"""
    excess = max(0, len_a + len_b - max_tokens)
    gap = min(excess, abs(len_a - len_b))          # first the longer side alone, down to the shorter's length
    len_a, len_b = (len_a - gap, len_b) if len_a > len_b else (len_a, len_b - gap)
    rest = excess - gap                            # then B, A, B, ... in turn
    return len_a - rest // 2, len_b - (rest + 1) // 2


class NextSentencePairs(StepSampler):
    """BERT's pretraining pairs: `[CLS] A [SEP] B [SEP]`, token types 0 up to the first [SEP] and 1 after,
    right-padded to seq_len. A: sentences of one document from a random start, up to a target length (seq_len - 3,
    or 10% of the time a shorter one drawn from 2..seq_len-3, BERT's short_seq_prob), cut at a random sentence
    boundary; B: the sentences after the cut (IsNext, half the examples) or sentences from a random start in a
    random other document up to the remaining length (NotNext); the longer side trimmed one token at a time, each
    off its front or back at random (truncate_seq_pair). A's start is uniform over the sentences (over those with
    a successor in their document for IsNext), NotNext's document uniform over the others.
    `rows(step, micro, rank)` is a pure function of (seed, step, micro, rank); `next_rows(step, micro)` draws this
    rank's rows of the trainer's micro-step and moves the counter a checkpoint keeps.
    Example: rows = NextSentencePairs(ds.tokens, ds.sentence_starts, cls_id=2, sep_id=3, pad_id=0, eot_id=1,
    seq_len=128, batch_size=8).rows(step=0)"""

    STATE_KEYS = ("seed", "seq_len", "global_batch_size")    # a token window sampler's: its checkpoints resume here

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, *, cls_id: int, sep_id: int, pad_id: int,
                 eot_id: int, seq_len: int, batch_size: int, seed: int = 0, short_seq_prob: float = 0.1,
                 rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise DataError(f"rank={rank} must be in [0, world_size={world_size})")
        self.tokens = tokens                   # (n,) a split's ids (TokenDataset.tokens)
        self.starts = starts                   # (s,) its sentence starts (TokenDataset.sentence_starts)
        self.cls_id, self.sep_id, self.pad_id, self.eot_id = cls_id, sep_id, pad_id, eot_id
        self.seq_len, self.batch_size, self.seed, self.short_seq_prob = seq_len, batch_size, seed, short_seq_prob
        self.rank, self.world_size, self.global_batch_size = rank, world_size, batch_size * world_size
        self.step = 0
        n = len(starts)
        before = np.asarray(tokens[np.asarray(starts[1:]) - 1]) if n > 1 else np.zeros(0)
        firsts = np.flatnonzero(np.concatenate([[True], before == eot_id])) if n else np.zeros(0, np.int64)
        self.doc_first = np.append(firsts, n)                     # (d + 1,) each document's first sentence
        if len(firsts) < 2 or n - len(firsts) < 1:
            raise UserError(f"next-sentence prediction needs two documents and one with two sentences; this split "
                            f"has {len(firsts)} documents and {n} sentences")
        self.generator = torch.Generator()

    def _randint(self, high: int) -> int:
        return int(torch.randint(high, (1,), generator=self.generator))

    def _span(self, first: int, last: int) -> tuple[int, int]:
        """Tokens of sentences first..last (one document), its end-of-text left out."""
        end = int(self.starts[last + 1]) if last + 1 < len(self.starts) else len(self.tokens)
        return int(self.starts[first]), end - int(self.tokens[end - 1] == self.eot_id)

    def _run(self, first: int, doc_end: int, target: int, least: int = 1) -> int:
        """The last sentence of a run from `first` that reaches `target` tokens (at least `least` sentences)
        without passing `doc_end` (its document's first sentence past it)."""
        last = first + least - 1
        while last + 1 < doc_end and self._len(first, last) < target:
            last += 1
        return last

    def _len(self, first: int, last: int) -> int:
        a, b = self._span(first, last)
        return b - a

    def example(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(A's ids, B's ids, label) of one example, drawn from self.generator."""
        max_tokens = self.seq_len - 3
        target = max_tokens
        if float(torch.rand((), generator=self.generator)) < self.short_seq_prob:
            target = 2 + self._randint(max_tokens - 1)
        label = IS_NEXT if float(torch.rand((), generator=self.generator)) < 0.5 else NOT_NEXT
        docs, n_docs = self.doc_first, len(self.doc_first) - 1
        if label == IS_NEXT:   # the k-th sentence with a successor: k + d, d its document (doc_first[d] - d <= k)
            k = self._randint(len(self.starts) - n_docs)
            doc = int(np.searchsorted(docs[:-1] - np.arange(n_docs), k, side="right")) - 1
            first = k + doc
        else:
            first = self._randint(len(self.starts))
            doc = int(np.searchsorted(docs, first, side="right")) - 1
        last = self._run(first, int(docs[doc + 1]), target, least=2 if label == IS_NEXT else 1)
        n = last - first + 1
        cut = first + (1 + self._randint(n - 1) if n > 1 else 1)    # A: sentences first..cut-1
        a = self._span(first, cut - 1)
        if label == IS_NEXT:
            b = self._span(cut, last)
        else:
            other = self._randint(n_docs - 1)
            other += other >= doc
            b_first = int(docs[other]) + self._randint(int(docs[other + 1] - docs[other]))
            b_last = self._run(b_first, int(docs[other + 1]), max(1, target - (a[1] - a[0])))
            b = self._span(b_first, b_last)
        len_a, len_b = truncated_lengths(a[1] - a[0], b[1] - b[0], max_tokens)
        spans = []
        for (start, end), keep in ((a, len_a), (b, len_b)):   # each removed token off the front or back at random
            front = int(torch.binomial(torch.tensor(float(end - start - keep)), torch.tensor(0.5),
                                       generator=self.generator))
            spans.append(np.asarray(self.tokens[start + front:start + front + keep], dtype=np.int64))
        return spans[0], spans[1], label

    def rows(self, step: int, micro: int = 0, rank: int = 0) -> Rows:
        """batch_size rows: ids (b, t) unmasked, with inputs attention_mask, token_type_ids (b, t) and
        next_sentence_labels (b,). The same for the same (seed, step, micro, rank)."""
        self.generator.manual_seed(_mix_seed(self.seed, step, micro, rank, 1))   # 1: apart from the masking's draws
        b, t = self.batch_size, self.seq_len
        ids = np.full((b, t), self.pad_id, dtype=np.int64)
        types, mask = np.zeros((b, t), dtype=np.int64), np.zeros((b, t), dtype=np.int64)
        labels = np.zeros(b, dtype=np.int64)
        for i in range(b):
            a, b_ids, labels[i] = self.example()
            sep, end = 1 + len(a), 2 + len(a) + len(b_ids)                # [CLS] A [SEP] B [SEP]
            ids[i, 0], ids[i, 1:sep], ids[i, sep], ids[i, sep + 1:end], ids[i, end] = (
                self.cls_id, a, self.sep_id, b_ids, self.sep_id)
            types[i, sep + 1:end + 1] = 1
            mask[i, :end + 1] = 1
        tensors = {"attention_mask": mask, "token_type_ids": types, "next_sentence_labels": labels}
        return Rows(torch.from_numpy(ids), inputs={k: torch.from_numpy(v) for k, v in tensors.items()})

    def next_rows(self, step: int, micro: int) -> Rows:
        """This rank's rows of the trainer's (step, micro-step); the counter moves by one, as a window sampler's."""
        self.step += 1
        return self.rows(step, micro, self.rank)

    def batch(self, step: int) -> Rows:
        """StepSampler's view: this rank's rows of `step`, micro-step 0."""
        return self.rows(step, 0, self.rank)

    @property
    def epoch(self) -> float:
        """Examples drawn so far (all ranks) per sentence of the split (each example starts at one), fractional."""
        return self.step * self.global_batch_size / len(self.starts)


def next_sentence_for(dataset: Any, tokenizer: Any, vocab_size: int, *, seq_len: int, seed: int = 0,
                      batch_size: int = 8, whole_word: bool = False, mask_id: int | None = None, prob: float = 0.15,
                      short_seq_prob: float = 0.1, rank: int = 0, world_size: int = 1
                      ) -> tuple[NextSentencePairs, MaskedLM]:
    """BERT's MLM + next-sentence pretraining over a split (an archlab.data.tokens.TokenDataset prepared with
    sentences) and its tokenizer (with [CLS], [SEP] and a mask token; [PAD] pads where it has one, else the
    end-of-text id): the pair sampler, and the masked LM that turns its rows ([CLS], [SEP], padding never masked).
    One-line UserErrors: no sentence index, a tokenizer without those tokens, a seq_len below 5.
    Example: pairs, mlm = next_sentence_for(ds, ds.load_tokenizer(), 8000, seq_len=128)
             inputs, labels = mlm.turn(pairs.rows(step=0), step=0)"""
    if getattr(dataset, "sentence_starts", None) is None:
        raise UserError(f"{getattr(dataset, 'data_dir', 'the data folder')} has no sentence index: prepare the "
                        "data with --sentences (archlab data prepare ... --sentences)")
    ids = {token: tokenizer.token_to_id(token) for token in NSP_TOKENS}
    missing = [token for token, i in ids.items() if i is None]
    if missing:
        raise UserError(f"next-sentence prediction needs {' and '.join(missing)} in the tokenizer: train one with "
                        "`archlab tokenizer train ... --special-tokens '<|endoftext|>' '[MASK]' '[CLS]' '[SEP]'`")
    if seq_len < 5:
        raise UserError(f"seq_len={seq_len}: next-sentence examples need at least 5 slots ([CLS] a [SEP] b [SEP])")
    masked_lm = masked_lm_for(tokenizer, vocab_size, seed=seed, whole_word=whole_word, mask_id=mask_id, prob=prob)
    pad = tokenizer.token_to_id("[PAD]")
    pad_id = dataset.eot_id if pad is None else pad
    for i in (*ids.values(), pad_id):
        masked_lm.special[i] = True
    pairs = NextSentencePairs(dataset.tokens, dataset.sentence_starts, cls_id=ids["[CLS]"], sep_id=ids["[SEP]"],
                          pad_id=pad_id, eot_id=dataset.eot_id, seq_len=seq_len, batch_size=batch_size, seed=seed,
                          short_seq_prob=short_seq_prob, rank=rank, world_size=world_size)
    return pairs, masked_lm
