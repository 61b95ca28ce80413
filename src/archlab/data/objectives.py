"""Training objectives: what a batch of token windows becomes before the model sees it.

    next_token   decoder LMs: inputs x, targets y = x shifted by one (GPT); with train.document_masks, the
                 window's documents (ended by the end-of-text id) attend only within themselves (DocumentMasks)
    mlm          encoders: BERT's masked LM (Devlin et al. 2019). Each token (special tokens never) is chosen
                 with probability 0.15; a chosen token becomes [MASK] 80% of the time, a random token 10%,
                 and stays itself 10%; the loss is scored on the chosen tokens only. Whole-word masking
                 (BERT's later release) chooses words instead and masks all of a chosen word's pieces.
    next_sentence  encoders: BERT's pretraining, MLM plus next-sentence prediction over `[CLS] A [SEP] B [SEP]`
                 pairs drawn from a data folder's sentence index (NextSentence, next_sentence_for)
    span_corruption   encoder-decoders: T5's (archlab.data.noising.SpanCorruption)
    text_infilling    encoder-decoders: BART's (archlab.data.noising.TextInfilling)
    continuation      any kind: the window's first `train.prefix_fraction` is context, the rest is scored (004's
                 decoder-only vs prefix-LM vs encoder-decoder comparison: the same scored tokens for all three)

An objective turns a window batch x (b, n) into (inputs, labels): inputs a dict of the model's forward keywords
(input_ids, attention_mask, prefix_lengths, document_ids, ...), labels (b, t) with IGNORE on unscored slots (one
with `reads_targets` is also given the sampler's next-token targets). train.objective names one;
archlab.data.batches.objective_for builds it.

Masking is a pure function of (seed, step, micro-batch, rank): a resumed run masks exactly as the uninterrupted
one did, with no random state to save.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from archlab.data.tokens import _mix_seed
from archlab.errors import UserError

__all__ = ["MaskedLM", "Continuation", "DocumentMasks", "mask_tokens", "word_starts", "masked_lm_for", "IGNORE",
           "NextSentence", "next_sentence_for", "truncated_lengths"]

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


@dataclass
class Continuation:
    """004's comparison at a matched scored set: the first `prefix` tokens of each window are context, the rest is
    scored. A decoder reads the whole window causally (a prefix-LM attends bidirectionally inside the prefix) and
    is scored on predicting tokens prefix..n-1; an encoder-decoder encodes the prefix and decodes the rest. Both
    process n tokens per row and score the same n - prefix targets.
    Example: inputs, labels = Continuation(prefix=64, arch="encoder_decoder").batch(x)   # x (b, 128)"""

    prefix: int
    arch: str
    prefix_lm: bool = False

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
    reads_targets: ClassVar[bool] = True       # labels are the sampler's targets, one slot ignored per boundary

    def batch(self, x: torch.Tensor, step: int = 0, micro: int = 0, rank: int = 0, *, targets: torch.Tensor
              ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        ends = (x == self.eot_id).long()                                        # (b, n)
        documents = ends.cumsum(-1) - ends                                      # end-of-text tokens before slot j
        labels = targets.masked_fill(ends.bool(), IGNORE)   # slot j predicts token j + 1: a new document's first
        return {"input_ids": x, "document_ids": documents}, labels


# ---- next-sentence prediction -------------------------------------------------------------------------------
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


@dataclass
class NextSentence:
    """BERT's pretraining examples (Devlin et al. 2019, §3.1 task #2, A.1-A.2): `[CLS] A [SEP] B [SEP]`, token
    types 0 up to the first [SEP] and 1 after, right-padded to seq_len, then masked as MLM (masked_lm: specials,
    [CLS], [SEP] and padding never chosen). A: sentences of one document from a random start, up to a target
    length (seq_len - 3, or 10% of the time a shorter one drawn from 2..seq_len-3, BERT's short_seq_prob), cut at
    a random sentence boundary; B: the sentences after the cut (IsNext, half the examples) or sentences from a
    random start in a random other document up to the remaining length (NotNext); the longer side trimmed one
    token at a time, each off its front or back at random (truncate_seq_pair). A's start is uniform over the
    sentences (over those with a successor in their document for IsNext), NotNext's document uniform over the
    others. `batch(step, micro, rank)` is a pure function of (seed, step, micro, rank)."""

    tokens: np.ndarray                         # (n,) a split's ids (TokenDataset.tokens)
    starts: np.ndarray                         # (s,) its sentence starts (TokenDataset.sentence_starts)
    masked_lm: MaskedLM
    cls_id: int
    sep_id: int
    pad_id: int
    eot_id: int
    seq_len: int
    batch_size: int
    seed: int = 0
    short_seq_prob: float = 0.1

    def __post_init__(self) -> None:
        n = len(self.starts)
        before = np.asarray(self.tokens[np.asarray(self.starts[1:]) - 1]) if n > 1 else np.zeros(0)
        firsts = np.flatnonzero(np.concatenate([[True], before == self.eot_id])) if n else np.zeros(0, np.int64)
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

    def batch(self, step: int, micro: int = 0, rank: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(inputs, labels): inputs input_ids (masked), attention_mask, token_type_ids (b, t) and
        next_sentence_labels (b,); labels (b, t) the MLM labels. The same for the same (seed, step, micro, rank)."""
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
        masked, mlm_labels = self.masked_lm.batch(torch.from_numpy(ids), step, micro, rank)   # (b, t) each
        tensors = {"attention_mask": mask, "token_type_ids": types, "next_sentence_labels": labels}
        return {"input_ids": masked, **{k: torch.from_numpy(v) for k, v in tensors.items()}}, mlm_labels


def next_sentence_for(dataset: Any, tokenizer: Any, vocab_size: int, *, seq_len: int, seed: int = 0,
                      batch_size: int = 8, whole_word: bool = False, mask_id: int | None = None, prob: float = 0.15,
                      short_seq_prob: float = 0.1) -> NextSentence:
    """BERT's MLM + next-sentence objective over a split (an archlab.data.tokens.TokenDataset prepared with sentences)
    and its tokenizer (with [CLS], [SEP] and a mask token; [PAD] pads where it has one, else the end-of-text id).
    One-line UserErrors: no sentence index, a tokenizer without those tokens, a seq_len below 5.
    Example: inputs, labels = next_sentence_for(ds, ds.load_tokenizer(), 8000, seq_len=128).batch(step=0)"""
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
    return NextSentence(dataset.tokens, dataset.sentence_starts, masked_lm, ids["[CLS]"], ids["[SEP]"], pad_id,
                        dataset.eot_id, seq_len, batch_size, seed=seed, short_seq_prob=short_seq_prob)
