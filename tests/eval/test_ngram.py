"""The modified Kneser-Ney baseline (archlab.eval.ngram) against a table worked out by hand, a plain-Python
reference of Chen & Goodman's formulas, and the known answers: periodic text ~0 bits, uniform random bytes ~8 bits,
a longer history never worse on the training text; and `archlab ngram`'s output and errors."""
from __future__ import annotations

import itertools
import json
import math
import random
from collections import Counter
from fractions import Fraction as F
from pathlib import Path

import numpy as np
import pytest

from archlab.cli import main
from archlab.data.prepare import prepare
from archlab.data.tokens import TokenDataset
from archlab.eval.ngram import NgramCounts, evaluate_ngram

README = Path(__file__).resolve().parents[2] / "README.md"


# ---- a table checkable by eye ------------------------------------------------------------------------------------
def test_bigram_table_worked_by_hand():
    """V = {a=0, b=1, $=2}, training text `a b a b a $` after a start `$`. Bigrams: $a 1, ab 2, ba 2, a$ 1, so
    n1 = 2, n2 = 2, n3 = 0: Y = 2/6 = 1/3, D1 = 1 - 2Y(2/2) = 1/3, D2 = 2 - 3Y(0/2) = 2.
    Continuation counts (distinct left neighbours): a {$, b} 2, b {a} 1, $ {a} 1, so n1 = 2, n2 = 1: Y = 1/2,
    D1 = 1 - 2Y(1/2) = 1/2, D2 = 2 - 3Y(0/1) = 2; total 4, gamma = (1/2 * 2 + 2 * 1) / 4 = 3/4:
    P1(a) = 0/4 + 3/4 * 1/3 = 1/4,  P1(b) = P1($) = (1 - 1/2)/4 + 1/4 = 3/8.
    History a: c(a.) = 3 (ab 2, a$ 1), gamma = (1/3 * 1 + 2 * 1) / 3 = 7/9:
    P(a|a) = 7/9 * 1/4 = 14/72,  P(b|a) = 0 + 7/9 * 3/8 = 21/72,  P($|a) = (1 - 1/3)/3 + 21/72 = 37/72.
    History b: c(b.) = 2 (ba), gamma = 2 * 1 / 2 = 1: P(.|b) = P1.
    History $: c($.) = 1 ($a), gamma = 1/3: P(a|$) = 2/3 + 1/3 * 1/4 = 3/4, P(b|$) = P($|$) = 1/3 * 3/8 = 1/8."""
    model = NgramCounts(np.array([0, 1, 0, 1, 0, 2]), vocab_size=3, max_order=2, bos=2).model(2)
    table = {0: [F(14, 72), F(21, 72), F(37, 72)], 1: [F(1, 4), F(3, 8), F(3, 8)], 2: [F(3, 4), F(1, 8), F(1, 8)]}
    for history, expected in table.items():
        assert sum(expected) == 1
        np.testing.assert_allclose(model.distribution([history]), [float(p) for p in expected], rtol=1e-12)
    # a stream's tokens, each given the ones before it (and the start token): a after $, then b after a
    np.testing.assert_allclose(model.token_nats(np.array([0, 1])), [-math.log(3 / 4), -math.log(21 / 72)])


# ---- a plain-Python reference of the formulas --------------------------------------------------------------------
def _discounts(counts) -> tuple[float, float, float]:
    n = Counter(counts)
    y = n[1] / (n[1] + 2 * n[2]) if n[1] + 2 * n[2] else 0.5
    out = []
    for r in (1, 2, 3):
        d = r - (r + 1) * y * n[r + 1] / n[r] if n[r] else float("nan")
        out.append(d if 0 < d <= r else (y if 0 < y <= 1 else 0.5))
    return tuple(out)


def reference_probability(tokens: list[int], bos: int, vocab: int, order: int, history: tuple, w: int) -> float:
    """Chen & Goodman's interpolated modified Kneser-Ney, by dictionaries, one probability at a time."""
    stream = [bos, *tokens]
    grams = {k: Counter(tuple(stream[i:i + k]) for i in range(len(stream) - k + 1) if i + k - 1 >= 1)
             for k in range(1, order + 1)}

    def level_counts(k: int) -> dict:
        if k == order:
            return grams[k]
        return Counter(g[1:] for g in grams[k + 1])        # distinct left neighbours of each k-gram

    def p(k: int, h: tuple) -> float:
        if k == 0:
            return 1.0 / vocab
        if len(h) < k - 1:
            return p(k - 1, h)
        h = h[len(h) - (k - 1):] if k > 1 else ()
        counts = level_counts(k)
        d = _discounts(list(counts.values()))
        following = {g[-1]: c for g, c in counts.items() if g[:-1] == h}
        total = sum(following.values())
        if not total:
            return p(k - 1, h[1:] if h else ())
        gamma = sum(d[min(c, 3) - 1] for c in following.values()) / total
        c = following.get(w, 0)
        discounted = max(c - d[min(c, 3) - 1], 0) / total if c else 0.0
        return discounted + gamma * p(k - 1, h[1:] if h else ())

    return p(order, tuple(history))


@pytest.mark.parametrize("vocab,order", [(5, 3), (2**22, 3)], ids=["packed-keys", "hashed-keys"])
def test_equals_plain_python_reference(vocab, order):
    """Every history of the small alphabet (and the short ones), every token, against the dictionaries; a vocabulary
    of 2**22 needs 66 bits for a trigram, so its keys are hashed."""
    rng = random.Random(1)
    tokens = [rng.choice([0, 1, 2, 3, 4, 1, 2, 1]) for _ in range(120)]
    model = NgramCounts(np.array(tokens), vocab, order, bos=4).model(order)
    histories = [(), (1,), *itertools.product(range(5), repeat=order - 1)]
    for history in histories:
        got = model.distribution(list(history), words=np.arange(5))
        for w in range(5):
            ref = reference_probability(tokens, 4, vocab, order, history, w)
            assert got[w] == pytest.approx(ref, rel=1e-9), (history, w)


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_every_distribution_sums_to_one(order):
    rng = np.random.default_rng(0)
    tokens = rng.choice(6, size=400, p=[0.4, 0.2, 0.2, 0.1, 0.05, 0.05])
    model = NgramCounts(tokens, 7, order, bos=6).model(order)
    for history in itertools.product(range(7), repeat=min(order - 1, 3)):   # seen and unseen histories
        p = model.distribution(list(history))
        assert p.min() > 0
        assert p.sum() == pytest.approx(1.0, abs=1e-12)


def test_training_text_shorter_than_the_order_still_gives_distributions():
    model = NgramCounts(np.array([1, 2]), 4, 5, bos=3).model(5)
    for history in ([], [1], [1, 2], [0, 0, 0, 0]):
        assert model.distribution(history).sum() == pytest.approx(1.0, abs=1e-12)
    assert np.isfinite(model.token_nats(np.array([1, 2, 0, 1, 2]))).all()


# ---- the known answers ------------------------------------------------------------------------------------------
def test_periodic_text_costs_almost_nothing():
    period = np.array([3, 1, 4, 0, 5, 9, 2, 6])
    model = NgramCounts(np.tile(period, 2000), 10, 3, bos=7).model(3)
    bits = model.token_nats(np.tile(period, 200)).mean() / math.log(2)
    assert bits < 0.01


@pytest.mark.parametrize("order", [1, 2, 3])
def test_uniform_random_bytes_cost_eight_bits(order):
    """~8 bits; a longer history only adds estimation noise (measured: +0.11 bits at orders 2 and 3 from 300k
    training bytes, whose 65,536 two-byte histories are seen ~5 times each)."""
    rng = np.random.default_rng(0)
    counts = NgramCounts(rng.integers(0, 256, 300_000), 256, order)
    bits = counts.model(order).token_nats(rng.integers(0, 256, 20_000)).mean() / math.log(2)
    assert 7.99 < bits < (8.01 if order == 1 else 8.15)


def test_longer_history_never_worse_on_training_text():
    text = np.frombuffer(README.read_bytes()[:30_000], dtype=np.uint8).astype(np.int64)
    counts = NgramCounts(text, 257, 6, bos=256)
    bits = [counts.model(k).token_nats(text).mean() / math.log(2) for k in range(1, 7)]
    assert all(b <= a + 1e-9 for a, b in zip(bits, bits[1:])), bits
    assert bits[-1] < bits[0] / 3


# ---- a prepared data folder and the CLI -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rng = random.Random(0)
    words = "the king is dead long live the queen and all her court".split()
    docs = [" ".join(rng.choice(words) for _ in range(200)) for _ in range(30)]
    out = tmp_path_factory.mktemp("ngram") / "data"
    prepare(docs, "bytes", out, num_workers=0, progress=False)
    return out


def test_bits_per_byte_is_total_nats_over_the_splits_bytes(data):
    val = TokenDataset(data, "val")
    result = evaluate_ngram(data, [3])[0]
    counts = NgramCounts(np.asarray(TokenDataset(data, "train").tokens), val.vocab_size, 3, bos=val.eot_id)
    nats = counts.model(3).token_nats(np.asarray(val.tokens)).sum()
    assert result.tokens == val.n_tokens and result.n_bytes == val.n_bytes
    assert result.bpb == pytest.approx(nats / math.log(2) / val.n_bytes, rel=1e-12)
    assert result.bits_per_token == pytest.approx(nats / math.log(2) / val.n_tokens, rel=1e-12)
    part = evaluate_ngram(data, [3], span=(1, 101))[0]      # the targets of a model's first 100 predictions
    assert part.tokens == 100
    assert part.bpb == pytest.approx(
        counts.model(3).token_nats(np.asarray(val.tokens[:101]))[1:].sum() / math.log(2) / (val.bytes_per_token * 100))


def test_cli_one_order_and_json(data, capsys):
    assert main(["ngram", str(data), "--order", "3", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "3-gram:" in out and "bits/byte" in out and "peak memory" in out
    assert main(["ngram", str(data), "--order", "2", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["order"] == 2 and row["bpb"] == pytest.approx(evaluate_ngram(data, [2])[0].bpb)


def test_cli_orders_table(data, capsys):
    assert main(["ngram", str(data), "--orders", "1-4", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4]
    bpb = [float(r[1]) for r in rows]
    assert bpb[1] < bpb[0]                       # a bigram beats the unigram on these word-salad documents
    assert main(["ngram", str(data), "--orders", "2-3", "--json"]) == 0
    assert [r["order"] for r in json.loads(capsys.readouterr().out)] == [2, 3]


@pytest.mark.parametrize("argv,expected", [
    (["{missing}"], "is not a folder"),
    (["{empty}"], "is not a prepared data folder"),
    (["{data}", "--order", "0"], "--order 0"),
    (["{data}", "--orders", "3-1"], "--orders '3-1'"),
    (["{data}", "--orders", "one-two"], "--orders 'one-two'"),
])
def test_cli_errors_are_one_line(data, tmp_path, capsys, argv, expected):
    (tmp_path / "empty").mkdir()
    places = {"missing": tmp_path / "nope", "empty": tmp_path / "empty", "data": data}
    assert main(["ngram", *[a.format(**places) for a in argv]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("archlab ngram: error:") and expected in err[0], err
