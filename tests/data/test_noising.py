"""T5's span corruption and BART's text infilling / sentence permutation: hand-written cases, the published
counts, statistics over many draws, a literal loop version of fairseq's masking, purity, and the errors."""
import math
import random
from collections import Counter

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFBackend
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from archlab.data.noising import (
    SpanCorruption,
    TextInfilling,
    _random_segmentation,
    infill_spans,
    permute_sentences,
    poisson_span_lengths,
    random_spans_noise_mask,
    raw_length_for,
    replace_spans,
    sentence_ends,
    sentinel_ids,
    span_corruption,
    span_corruption_for,
    span_lengths,
    text_infilling,
    text_infilling_for,
)
from archlab.errors import UserError
from archlab.models import build_model, presets
from archlab.tokenizer import train
from archlab.tokenizer.hf_wrapper import HFTokenizer

V, MASK, EOS = 1000, 3, 1
SENTINELS = torch.arange(V - 1, V - 201, -1)


def _within(value, p, n, sigmas=5):
    return abs(value - p) < sigmas * math.sqrt(p * (1 - p) / n)


# ------------------------------------------------------------------------------------------------------ T5
def test_a_fixed_segmentation_gives_the_hand_written_source_and_target():
    ids = torch.arange(10, 20).view(1, 10)
    noise = torch.zeros(1, 10, dtype=torch.bool)
    noise[0, [3, 4, 8, 9]] = True
    source, target = replace_spans(ids, noise, sentinels=torch.tensor([99, 98]), eos_id=EOS)
    assert source.tolist() == [[10, 11, 12, 99, 15, 16, 17, 98, EOS]]
    assert target.tolist() == [[99, 13, 14, 98, 18, 19, EOS]]


def test_t5_lengths_for_512_token_sources_are_the_published_568_and_114():
    assert raw_length_for(512) == 568                     # T5's random_spans_helper, HF's run_t5_mlm_flax
    assert span_lengths(568) == (512, 114)
    for source_len in (16, 64, 100, 512, 1024):
        raw = raw_length_for(source_len)
        assert span_lengths(raw)[0] <= source_len < span_lengths(raw + 1)[0]   # the longest that fits


def test_every_row_has_t5s_counts_and_alternates_kept_then_noise():
    gen = torch.Generator().manual_seed(0)
    n = 101
    noise = random_spans_noise_mask(2000, n, generator=gen)
    n_noise, n_spans = round(n * 0.15), round(round(n * 0.15) / 3.0)
    assert (noise.sum(1) == n_noise).all()
    starts = noise & ~torch.nn.functional.pad(noise[:, :-1], (1, 0))
    assert (starts.sum(1) == n_spans).all()
    assert not noise[:, 0].any() and noise[:, -1].all()   # kept first; T5's last span is always noise
    assert noise.float().mean(0).std() > 0                # and the spans move around


@pytest.mark.parametrize("items,segments", [(5, 2), (6, 3)])
def test_every_composition_of_the_counts_is_equally_likely(items, segments):
    gen = torch.Generator().manual_seed(1)
    rows = 30_000
    lengths = _random_segmentation(items, segments, rows, gen)
    assert (lengths > 0).all() and (lengths.sum(1) == items).all()
    counts = Counter(map(tuple, lengths.tolist()))
    assert len(counts) == math.comb(items - 1, segments - 1)
    p = 1 / len(counts)
    assert all(_within(c / rows, p, rows) for c in counts.values())


def test_putting_the_target_spans_back_at_the_sentinels_rebuilds_the_window():
    gen = torch.Generator().manual_seed(2)
    n = raw_length_for(128)
    x = torch.randint(10, 700, (64, n), generator=gen)
    source, target = span_corruption(x, generator=gen, sentinels=SENTINELS, eos_id=EOS)
    assert source.shape == (64, 128) and (source.shape[1], target.shape[1]) == span_lengths(n)
    sentinel = set(SENTINELS.tolist())
    for row in range(len(x)):
        spans, current = {}, None
        for t in target[row, :-1].tolist():               # S0 span0 S1 span1 ...
            if t in sentinel:
                current = spans.setdefault(t, [])
            else:
                current.append(t)
        rebuilt = []
        for t in source[row, :-1].tolist():
            rebuilt.extend(spans[t] if t in sentinel else [t])
        assert rebuilt == x[row].tolist()
        assert source[row, -1] == target[row, -1] == EOS


def _t5_like_tokenizer(n_extra=5):
    words = ["<pad>", "</s>", "<unk>"] + [f"w{i}" for i in range(40)]
    backend = HFBackend(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    backend.add_special_tokens(["<pad>", "</s>", "<unk>"])
    backend.add_special_tokens([f"<extra_id_{i}>" for i in reversed(range(n_extra))])   # T5: <extra_id_0> on top
    return HFTokenizer(backend)


def test_sentinels_are_the_extra_ids_counting_down_else_a_padded_vocabulary(bpe):
    tok = _t5_like_tokenizer()
    assert sentinel_ids(tok, tok.vocab_size).tolist() == list(range(tok.vocab_size - 1, tok.vocab_size - 6, -1))
    objective = span_corruption_for(tok, tok.vocab_size)
    assert objective.eos_id == tok.token_to_id("</s>")
    x = torch.randint(3, 43, (2, 100))                    # 15 noise tokens in 5 spans: the 5 extra ids
    inputs, labels = objective.batch(x, step=0)
    assert set(inputs["input_ids"].flatten().tolist()) >= set(objective.sentinels.tolist())
    with pytest.raises(UserError, match="10 spans but there are 5 sentinel ids"):
        objective.batch(torch.randint(3, 43, (2, 200)), step=0)

    plain = bpe["plain"]
    padded = span_corruption_for(plain, plain.vocab_size + 16)
    assert padded.sentinels.tolist() == list(range(plain.vocab_size + 15, plain.vocab_size - 1, -1))
    assert padded.eos_id == plain.token_to_id("<|endoftext|>")
    with pytest.raises(UserError, match=rf"<extra_id_0>.*vocab_size past the tokenizer's {plain.vocab_size} "):
        span_corruption_for(plain, plain.vocab_size)


def test_span_corruption_batches_train_an_encoder_decoder():
    model = build_model(presets.tiny("t5-v1.1-xxl"))
    v = model.config.vocab_size
    objective = SpanCorruption(torch.arange(v - 1, v - 11, -1), eos_id=EOS, seed=3)
    inputs, labels = objective.batch(torch.randint(5, v - 10, (2, raw_length_for(32))), step=0)
    loss = model(**inputs, targets=labels)
    loss.total.backward()
    assert inputs["input_ids"].shape == (2, 32) and bool(inputs["attention_mask"].all())
    # T5's init (embedding and head at std 1) starts far above log(v), as transformers' T5 does
    assert torch.isfinite(loss.total) and loss.ce.item() > 0.5 * math.log(v)
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters())


# ---------------------------------------------------------------------------------------------------- BART
def _fairseq_loop(row, begin, lengths, word, special, mask_id):
    """fairseq's add_whole_word_mask with --replace-length 1, token by token: every span's first token becomes
    the mask, then each span deletes the tokens after it until its words run out; spans stop at a special token
    and at the window's end (fairseq stops them at the document's end)."""
    n, out, keep = len(row), list(row), [True] * len(row)
    for s in begin:
        out[s] = mask_id
    for s, left in zip(begin, lengths):
        i, left = s, left - 1
        while i + 1 < n and not special[i + 1]:
            left -= int(word[i + 1])
            if left < 0:
                break
            i += 1
            keep[i] = False
    return [t for t, k in zip(out, keep) if k]


@pytest.mark.parametrize("begin,lengths,word_at,special_at,expected", [
    ([2, 3], [2, 3], None, [], [10, 11, MASK, 16, 17, 18, 19]),              # overlapping spans: one mask
    ([2, 4], [2, 1], None, [], [10, 11, MASK, MASK, 15, 16, 17, 18, 19]),    # adjacent spans: two
    ([2], [1], [0, 2, 5, 7], [], [10, 11, MASK, 15, 16, 17, 18, 19]),         # one word of three pieces
    ([2], [5], None, [4], [10, 11, MASK, 14, 15, 16, 17, 18, 19]),            # stops before a special
    ([8], [4], None, [], [10, 11, 12, 13, 14, 15, 16, 17, MASK]),             # and at the window's end
])
def test_infill_spans_by_hand(begin, lengths, word_at, special_at, expected):
    row = torch.arange(10, 20)
    word = torch.ones(10, dtype=torch.bool) if word_at is None else torch.zeros(10, dtype=torch.bool)
    word[word_at or []] = True
    special = torch.zeros(10, dtype=torch.bool)
    special[special_at] = True
    got = infill_spans(row, torch.tensor(begin), torch.tensor(lengths), mask_id=MASK, word=word, special=special)
    assert got.tolist() == expected


def test_infill_spans_equals_fairseqs_loop_on_random_plans():
    rng = random.Random(0)
    for trial in range(300):
        n = rng.randint(1, 40)
        row = torch.tensor([rng.randint(10, 99) for _ in range(n)])
        special = torch.tensor([rng.random() < 0.1 for _ in range(n)])
        word = torch.tensor([trial % 2 == 0 or rng.random() < 0.6 for _ in range(n)]) | special
        word[0] = True
        word[1:] |= special[:-1]
        candidates = (word & ~special).nonzero().flatten().tolist()
        if not candidates:
            continue
        begin = rng.sample(candidates, rng.randint(1, len(candidates)))
        lengths = [rng.randint(1, 6) for _ in begin]
        got = infill_spans(row, torch.tensor(begin), torch.tensor(lengths), mask_id=MASK, word=word, special=special)
        assert got.tolist() == _fairseq_loop(row.tolist(), begin, lengths, word.tolist(), special.tolist(), MASK)


def test_poisson_span_lengths_fill_the_budget_with_mean_lambda():
    gen = torch.Generator().manual_seed(4)
    lam, drawn = 3.5, []
    for budget in range(1, 400):
        lengths = poisson_span_lengths(budget, lam, gen)
        assert int(lengths.sum()) == budget and lengths[-1] > 0
        drawn += lengths[:-1].tolist()                    # the last one is cut to the budget
    drawn_t = torch.tensor(drawn, dtype=torch.float)
    k = len(drawn)
    assert abs(drawn_t.mean().item() - lam) < 5 * math.sqrt(lam / k)
    assert abs(drawn_t.var().item() - lam) < 0.1 * lam   # Poisson: variance = mean
    assert _within((drawn_t == 0).float().mean().item(), math.exp(-lam), k)   # 0-length spans: inserted masks


def _fairseq_reference(n, rows, ratio, lam, seed):
    """The whole of fairseq's text infilling on token-level windows (every token a word), with numpy draws:
    (share of tokens masked or deleted, masks per row, source lengths)."""
    rng = np.random.default_rng(seed)
    covered, masks = [], []
    for _ in range(rows):
        budget = math.ceil(n * ratio)
        lengths = rng.poisson(lam, budget)
        while lengths.sum() < budget:
            lengths = np.concatenate([lengths, rng.poisson(lam, budget)])
        k = int(np.searchsorted(np.cumsum(lengths), budget))
        lengths = lengths[:k + 1]
        lengths[k] = budget - lengths[:k].sum()
        spans = lengths[lengths > 0]
        begin = rng.choice(n, len(spans), replace=False).tolist()
        out = _fairseq_loop(list(range(10, 10 + n)), begin, spans.tolist(), [True] * n, [False] * n, MASK)
        kept = sum(t != MASK for t in out)
        covered.append(1 - kept / n)
        masks.append(len(out) - kept + (len(lengths) - len(spans)))
    return np.array(covered), np.array(masks)


def test_text_infilling_masks_as_fairseq_does_over_many_draws():
    gen = torch.Generator().manual_seed(5)
    n, rows = 200, 600
    x = torch.arange(10, 10 + n).repeat(rows, 1)
    source, attention = text_infilling(x, generator=gen, mask_id=MASK, ratio=0.3, poisson_lambda=3.5)
    real = attention.bool()
    assert (source[~real] == 0).all() and bool(real[:, 0].all())
    kept = ((source != MASK) & real).sum(1).float()
    covered, masks = 1 - kept / n, (source == MASK).sum(1).float()
    ref_covered, ref_masks = _fairseq_reference(n, rows, 0.3, 3.5, seed=6)
    for ours, ref in ((covered.numpy(), ref_covered), (masks.numpy(), ref_masks)):
        se = math.sqrt(ours.var() / rows + ref.var() / rows)
        assert abs(ours.mean() - ref.mean()) < 5 * se, (ours.mean(), ref.mean())
    assert 0.22 < covered.mean() < 0.3                     # the 30% budget less the overlaps merged
    # the kept tokens stay in order, each mask replaces a run of missing ones (or is inserted)
    for row in range(rows):
        tokens = source[row][real[row]]
        plain = tokens[tokens != MASK]
        assert bool((plain.diff() > 0).all())


def test_special_tokens_are_never_noised_nor_moved():
    gen = torch.Generator().manual_seed(7)
    special = torch.zeros(V, dtype=torch.bool)
    special[:10] = True
    starts = torch.zeros(V, dtype=torch.bool)
    starts[: V // 2] = True                                # ids < 500 begin a word
    x = torch.randint(10, V, (300, 64), generator=gen)
    x[torch.rand(x.shape, generator=gen) < 0.1] = 0       # documents' ends sprinkled in
    source, attention = text_infilling(x, generator=gen, mask_id=MASK, special=special, starts=starts)
    for row in range(len(x)):
        tokens = source[row][attention[row].bool()].tolist()
        specials_in = [t for t in x[row].tolist() if special[t]]
        specials_out = [t for t in tokens if special[t] and t != MASK]
        if len(tokens) < x.shape[1]:                      # not cut short by inserted masks
            assert specials_out == specials_in


def test_sentence_permutation_reorders_whole_sentences_uniformly():
    gen = torch.Generator().manual_seed(8)
    end = torch.zeros(V, dtype=torch.bool)
    end[10:20] = True                                      # "full stops"; runs of them end one sentence
    x = torch.stack([torch.randperm(48, generator=gen) + 10 for _ in range(400)])   # every token unique in its row
    y = permute_sentences(x, generator=gen, sentence_end=end)
    moved = 0
    for a, b in zip(x.tolist(), y.tolist()):
        assert sorted(a) == sorted(b)
        where = {t: i for i, t in enumerate(b)}
        first = 0
        for i, t in enumerate(a):                          # each sentence of a lies whole, in order, in b
            if i > first:
                assert where[t] == where[a[i - 1]] + 1
            if end[t] and (i + 1 == len(a) or not end[a[i + 1]]):
                first = i + 1
        moved += a != b
    assert moved > 0.9 * len(x)

    three = torch.tensor([[20, 21, 10, 30, 11, 40, 41, 42, 12]]).repeat(6000, 1)   # three whole sentences
    orders = Counter(tuple(r) for r in permute_sentences(three, generator=gen, sentence_end=end).tolist())
    assert len(orders) == 6 and all(_within(c / 6000, 1 / 6, 6000) for c in orders.values())


TEXT = "The cat sat. Did it? Yes! It sat on the mat.\n" * 40 + "pi is 3.14 or so\n"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """Byte-level BPE tokenizers of TEXT: "mask" has <mask> among its specials, "plain" has <|endoftext|> only."""
    (path := tmp_path_factory.mktemp("noising") / "text.txt").write_text(TEXT)
    return {kind: train([path], 300, ["<|endoftext|>", *extra], kind="bpe")
            for kind, extra in (("mask", ["<mask>"]), ("plain", []))}


def test_sentence_ends_are_the_pieces_that_close_a_sentence(bpe):
    tok = bpe["mask"]
    table = sentence_ends(tok, tok.vocab_size + 8)
    ids = tok.encode("The cat sat. Did it? Yes! It sat on the mat.")
    ends = [i for i, t in enumerate(ids) if table[t]]
    assert [tok.decode(ids[:i + 1]).rstrip()[-1] for i in ends] == [".", "?", "!", "."]
    assert table[tok.token_to_id("<|endoftext|>")] and not table[tok.vocab_size:].any()


def test_text_infilling_for_finds_the_mask_and_batches_are_pure(bpe):
    tok = bpe["mask"]
    objective = text_infilling_for(tok, tok.vocab_size, seed=9)
    assert isinstance(objective, TextInfilling) and objective.mask_id == tok.token_to_id("<mask>")
    assert objective.special[tok.token_to_id("<|endoftext|>")] and objective.sentence_end is not None
    x = torch.tensor([tok.encode(TEXT)[i:i + 64] for i in range(0, 640, 64)])
    a, b = objective.batch(x, step=5), objective.batch(x, step=5)
    assert torch.equal(a[0]["input_ids"], b[0]["input_ids"]) and torch.equal(a[1], x)
    assert a[0]["input_ids"].shape == a[0]["attention_mask"].shape == x.shape
    assert not torch.equal(objective.batch(x, step=6)[0]["input_ids"], a[0]["input_ids"])
    assert not torch.equal(objective.batch(x, step=5, micro=1)[0]["input_ids"], a[0]["input_ids"])
    assert not torch.equal(objective.batch(x, step=5, rank=1)[0]["input_ids"], a[0]["input_ids"])

    span = SpanCorruption(SENTINELS, EOS, seed=9)
    x = torch.randint(10, 700, (4, 60))
    a, b = span.batch(x, step=5), span.batch(x, step=5)
    assert torch.equal(a[0]["input_ids"], b[0]["input_ids"]) and torch.equal(a[1], b[1])
    assert not torch.equal(span.batch(x, step=6)[1], a[1])

    with pytest.raises(UserError, match=r"text infilling needs a mask token.*--special-tokens"):
        text_infilling_for(bpe["plain"], bpe["plain"].vocab_size)
    v = bpe["plain"].vocab_size
    padded = text_infilling_for(bpe["plain"], v + 1, mask_id=v)      # an id past the tokenizer
    assert padded.mask_id == v and padded.special[v]


def test_text_infilling_batches_train_an_encoder_decoder():
    model = build_model(presets.tiny("bart-large"))
    v = model.config.vocab_size
    special = torch.zeros(v, dtype=torch.bool)
    special[:4] = True
    objective = TextInfilling(MASK, special, seed=1, pad_id=1)
    inputs, labels = objective.batch(torch.randint(4, v, (2, 24)), step=0)
    loss = model(**inputs, targets=labels)
    loss.total.backward()
    assert torch.isfinite(loss.total) and 0.5 * math.log(v) < loss.ce.item() < 2 * math.log(v)
