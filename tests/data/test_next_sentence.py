"""BERT's next-sentence pretraining (next_sentence.NextSentencePairs rows, masked by objectives.MaskedLM): IsNext
about half the time, A and B contiguous sentences of one document for IsNext and B from another document for
NotNext, [CLS] A [SEP] B [SEP] with token types and right padding, lengths within seq_len, truncation as BERT's
truncate_seq_pair, masking that never touches the specials, the same batch for the same (seed, step, micro,
rank); and the prepared-data path (next_sentence_for) with its one-line errors, feeding a training step of an
encoder with the NSP head."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from archlab.config import ModelConfig
from archlab.data.batches import Task
from archlab.data.next_sentence import NextSentencePairs, next_sentence_for, truncated_lengths
from archlab.data.objectives import IGNORE, MaskedLM
from archlab.data.prepare import prepare
from archlab.data.tokens import TokenDataset
from archlab.errors import UserError
from archlab.models.encoder import EncoderLM
from archlab.tokenizer import train as train_tokenizer

EOT, CLS, SEP, PAD, MASK, OFFSET = 1, 2, 3, 0, 4, 10


def synthetic(n_docs=30, seed=0):
    """A token stream whose every id names its own offset (id = offset + OFFSET; end-of-text EOT), with
    documents of 1..8 sentences of 1..12 tokens: (tokens, sentence starts, document of each offset)."""
    rng = np.random.default_rng(seed)
    tokens, starts, doc_of = [], [], []
    for d in range(n_docs):
        for _ in range(int(rng.integers(1, 9))):
            starts.append(len(tokens))
            for _ in range(int(rng.integers(1, 13))):
                tokens.append(len(tokens) + OFFSET)
                doc_of.append(d)
        tokens.append(EOT)
        doc_of.append(d)
    return np.array(tokens, dtype=np.int64), np.array(starts, dtype=np.int64), np.array(doc_of)


@dataclass
class Pretraining:
    """What train.objective=next_sentence trains on: the pair sampler's rows, masked by the MLM objective."""
    pairs: NextSentencePairs
    masked_lm: MaskedLM

    def batch(self, step, micro=0, rank=0):
        return self.masked_lm.turn(self.pairs.rows(step, micro, rank), step, micro, rank)


def pairs_of(tokens, starts, seq_len, batch_size, **kw) -> NextSentencePairs:
    return NextSentencePairs(np.asarray(tokens), np.asarray(starts), cls_id=CLS, sep_id=SEP, pad_id=PAD, eot_id=EOT,
                         seq_len=seq_len, batch_size=batch_size, **kw)


def objective(seq_len=24, batch_size=64, prob=0.0, seed=0, **kw) -> tuple[Pretraining, np.ndarray, np.ndarray]:
    tokens, starts, doc_of = synthetic(**kw)
    vocab = int(tokens.max()) + 1
    special = torch.zeros(vocab, dtype=torch.bool)
    special[[EOT, CLS, SEP, PAD, MASK]] = True
    mlm = MaskedLM(MASK, vocab, special, seed=seed, prob=prob)
    return Pretraining(pairs_of(tokens, starts, seq_len, batch_size, seed=seed), mlm), starts, doc_of


def segments(row: torch.Tensor) -> tuple[list[int], list[int]]:
    """Offsets of A and B in an unmasked row [CLS] A [SEP] B [SEP] pad..."""
    ids = row.tolist()
    assert ids[0] == CLS
    first_sep = ids.index(SEP)
    second_sep = ids.index(SEP, first_sep + 1)
    assert all(i == PAD for i in ids[second_sep + 1:])
    return [i - OFFSET for i in ids[1:first_sep]], [i - OFFSET for i in ids[first_sep + 1:second_sep]]


def test_rows_are_cls_a_sep_b_sep_with_types_padding_and_bert_pair_sampling():
    nsp, starts, doc_of = objective()
    seq_len = nsp.pairs.seq_len
    labels, lengths = [], []
    short = 0
    for step in range(30):
        inputs, mlm_labels = nsp.batch(step)
        assert (mlm_labels == IGNORE).all()                            # prob 0: nothing masked
        for row, types, mask, label in zip(inputs["input_ids"], inputs["token_type_ids"],
                                           inputs["attention_mask"], inputs["next_sentence_labels"]):
            a, b = segments(row)
            n = len(a) + len(b) + 3
            assert a and b and n <= seq_len
            assert mask.tolist() == [1] * n + [0] * (seq_len - n)
            assert types.tolist() == [0] * (len(a) + 2) + [1] * (len(b) + 1) + [0] * (seq_len - n)
            for span in (a, b):   # each side a contiguous run of one document, no end-of-text inside
                assert span == list(range(span[0], span[0] + len(span)))
                assert len(set(doc_of[span])) == 1
            if int(label) == 0:   # IsNext: B follows A in the same document
                assert doc_of[a[0]] == doc_of[b[0]] and b[0] > a[-1]
                if n < seq_len:                    # untruncated: B starts the sentence right after A
                    assert b[0] == a[-1] + 1 and b[0] in starts and a[0] in starts
            else:
                assert doc_of[a[0]] != doc_of[b[0]]
                if n < seq_len:
                    assert a[0] in starts and b[0] in starts
            labels.append(int(label))
            lengths.append(n)
            short += n < seq_len - 12
    assert abs(np.mean(labels) - 0.5) < 0.05                       # 1920 examples: 4.4 standard deviations
    assert max(lengths) == seq_len and short > 0


def test_truncation_is_berts_truncate_seq_pair():
    def reference(len_a, len_b, max_tokens):   # create_pretraining_data.py, without the coin flips
        while len_a + len_b > max_tokens:
            if len_a > len_b:
                len_a -= 1
            else:
                len_b -= 1
        return len_a, len_b

    for len_a in range(0, 30):
        for len_b in range(0, 30):
            for max_tokens in (1, 5, 21, 40):
                assert truncated_lengths(len_a, len_b, max_tokens) == reference(len_a, len_b, max_tokens)


def test_truncation_takes_each_token_off_the_front_or_the_back_at_random():
    """Documents of two 40-token sentences in a window of 16 (no short targets): every A and B is one sentence
    trimmed to 7 and 6 tokens (truncated_lengths(40, 40, 13)); the tokens cut off its front follow
    Binomial(removed, 1/2), as BERT's coin flip per removed token."""
    tokens, starts = [], []
    for _ in range(6):
        for _ in range(2):
            starts.append(len(tokens))
            tokens.extend(range(len(tokens) + OFFSET, len(tokens) + OFFSET + 40))
        tokens.append(EOT)
    nsp, _, _ = objective(seq_len=16)
    nsp = Pretraining(pairs_of(tokens, starts, 16, 64, short_seq_prob=0.0), nsp.masked_lm)
    fronts = []
    for step in range(5):
        inputs, _ = nsp.batch(step)
        for row in inputs["input_ids"]:
            a, b = segments(row)
            assert (len(a), len(b)) == (7, 6)
            for span, removed in ((a, 33), (b, 34)):
                sentence_start = max(s for s in starts if s <= span[0])
                fronts.append((span[0] - sentence_start) / removed)
    assert abs(np.mean(fronts) - 0.5) < 0.03 and np.std(fronts) > 0.05


def test_the_same_seed_step_micro_rank_give_the_same_batch():
    nsp, _, _ = objective(prob=0.15)
    other, _, _ = objective(prob=0.15)
    for key in [(3, 0, 0), (3, 1, 0), (3, 0, 1)]:
        a, b = nsp.batch(*key), other.batch(*key)
        assert all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(nsp.batch(3)[0]["input_ids"], nsp.batch(4)[0]["input_ids"])
    assert not torch.equal(nsp.batch(3, 1)[0]["input_ids"], nsp.batch(3, 0, 1)[0]["input_ids"])


def test_masking_never_touches_cls_sep_or_padding():
    nsp, _, _ = objective(prob=0.5)
    plain, _, _ = objective(prob=0.0)
    for step in range(5):
        (inputs, labels), (clean, _) = nsp.batch(step), plain.batch(step)
        original = clean["input_ids"]
        specials = (original == CLS) | (original == SEP) | (original == PAD)
        assert torch.equal(inputs["input_ids"][specials], original[specials])
        assert (labels[specials] == IGNORE).all()
        chosen = labels != IGNORE
        assert torch.equal(labels[chosen], original[chosen]) and chosen.float().mean() > 0.2
        assert torch.equal(inputs["next_sentence_labels"], clean["next_sentence_labels"])


def test_a_split_without_two_documents_or_two_sentences_is_a_user_error():
    nsp, _, _ = objective()
    tokens = np.array([11, 12, EOT, 13, EOT])
    with pytest.raises(UserError, match="two documents"):
        pairs_of(tokens, np.array([0, 3]), 16, 2)


# ---- from prepared data ----------------------------------------------------------------------------------------
SENTENCES = ["the fox jumps.", "a dog sleeps!", "seven wizards judge?", "boxing is quick.", "the lazy dog waits."]


@pytest.fixture(scope="module")
def nsp_data(tmp_path_factory):
    rng = np.random.default_rng(0)
    docs = [" ".join(SENTENCES[int(i)] for i in rng.integers(0, 5, int(rng.integers(1, 7)))) for _ in range(40)]
    root = tmp_path_factory.mktemp("nsp")
    (root / "corpus.txt").write_text("\n".join(docs))
    tok = train_tokenizer([root / "corpus.txt"], 300, ["<|endoftext|>", "[MASK]", "[CLS]", "[SEP]", "[PAD]"])
    prepare(docs, tok, root / "data", num_workers=0, progress=False, sentences=True)
    prepare(docs, tok, root / "plain", num_workers=0, progress=False)
    no_cls = train_tokenizer([root / "corpus.txt"], 300, ["<|endoftext|>", "[MASK]"])
    prepare(docs, no_cls, root / "no_cls", num_workers=0, progress=False, sentences=True)
    return root


def test_prepared_data_gives_batches_that_train_an_encoder_with_the_nsp_head(nsp_data):
    ds = TokenDataset(nsp_data / "data", "train")
    tok = ds.load_tokenizer()
    pairs, masked_lm = next_sentence_for(ds, tok, 300, seq_len=32, seed=1, batch_size=8)
    inputs, labels = masked_lm.turn(pairs.rows(step=0), step=0)
    assert inputs["input_ids"].shape == labels.shape == (8, 32) and inputs["next_sentence_labels"].shape == (8,)
    assert pairs.pad_id == tok.token_to_id("[PAD]")
    real = inputs["attention_mask"].bool()
    assert (inputs["input_ids"][:, 0] == tok.token_to_id("[CLS]")).all()
    assert ((inputs["input_ids"] == tok.token_to_id("[SEP]")).sum(1) == 2).all()
    assert (inputs["input_ids"][~real] == pairs.pad_id).all() and (labels[~real] == IGNORE).all()
    cfg = ModelConfig(arch="encoder", vocab_size=300, d_model=32, n_layers=2, max_seq_len=32,
                      attention={"n_heads": 4}, mlp={"activation": "gelu", "d_ff": 64}, position={"kind": "learned"},
                      norm={"kind": "layernorm", "position": "post", "final_norm": False, "embedding_norm": True},
                      bias={"qkv": True, "mlp": True, "norm": True, "head": True}, tie_embeddings=True,
                      type_vocab_size=2, nsp_head=True)
    model = EncoderLM(cfg).train()
    out = model(**inputs, targets=labels)
    assert torch.isfinite(out.total) and out.nsp_loss is not None
    out.total.backward()
    head = model.nsp_head
    assert float(head.pooler.weight.grad.abs().sum()) > 0 and float(head.classifier.bias.grad.abs().sum()) > 0


def test_missing_index_or_tokens_are_one_line_user_errors(nsp_data):
    plain = TokenDataset(nsp_data / "plain", "train")
    with pytest.raises(UserError, match="--sentences") as err:
        next_sentence_for(plain, plain.load_tokenizer(), 300, seq_len=32)
    no_cls = TokenDataset(nsp_data / "no_cls", "train")
    with pytest.raises(UserError, match=r"\[CLS\] and \[SEP\]") as err2:
        next_sentence_for(no_cls, no_cls.load_tokenizer(), 300, seq_len=32)
    ds = TokenDataset(nsp_data / "data", "train")
    with pytest.raises(UserError, match="seq_len=4") as err3:
        next_sentence_for(ds, ds.load_tokenizer(), 300, seq_len=4)
    assert all("\n" not in str(e.value) for e in (err, err2, err3))


def test_the_trainer_trains_mlm_plus_nsp_and_resumes_exactly(nsp_data, tmp_path):
    """train.objective=next_sentence through the trainer: the total (MLM + NSP) falls, validation draws its rows
    from the validation split's sentences, and a resumed run equals the uninterrupted one."""
    from run_checks import assert_resume_is_exact

    from archlab.training.trainer import TrainConfig, read_metrics, train
    cfg = ModelConfig(arch="encoder", vocab_size=300, d_model=32, n_layers=2, max_seq_len=32,
                      attention={"n_heads": 4}, mlp={"activation": "gelu", "d_ff": 64}, position={"kind": "rope"},
                      norm={"kind": "layernorm", "position": "post", "final_norm": False, "embedding_norm": True},
                      tie_embeddings=True, type_vocab_size=2, nsp_head=True)
    fast = dict(batch_size=8, seq_len=32, warmup_steps=2, eval_batches=2, log_every=1, sample_every=-1, lr=3e-3,
                device="cpu", objective="next_sentence")
    train(cfg, TrainConfig(budget=24, eval_every=12, checkpoint_every=100, **fast), nsp_data / "data",
          tmp_path / "run", progress=False)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    totals = [r.get("loss_total", r.get("loss")) for r in rows if "loss" in r]
    assert all(r["loss_total"] > r["loss"] for r in rows if "loss_total" in r)      # NSP adds to the MLM loss
    assert sum(totals[-4:]) / 4 < sum(totals[:4]) / 4
    evals = [r for r in rows if "val_mlm_accuracy" in r]
    assert evals and all(0.0 <= r["val_nsp_accuracy"] <= 1.0 and r["val_nsp_loss"] > 0 for r in evals)
    assert_resume_is_exact(cfg, TrainConfig(budget=4, checkpoint_every=2, **fast), nsp_data / "data", tmp_path)
    with pytest.raises(UserError, match="nsp_head=true"):
        train(cfg.with_overrides({"nsp_head": False}), TrainConfig(budget=1, **fast), nsp_data / "data",
              tmp_path / "no_head", progress=False)


def test_evaluation_scores_next_sentence_rows_by_hand(nsp_data):
    """evaluate() on the validation split's fixed next-sentence rows: MLM loss over the masked slots, NSP loss and
    accuracy over the rows, equal to a loop over the same batches."""
    from archlab.eval.evaluate import evaluate
    val = TokenDataset(nsp_data / "data", "val")
    cfg = ModelConfig(arch="encoder", vocab_size=300, d_model=32, n_layers=1, max_seq_len=32,
                      attention={"n_heads": 4}, position={"kind": "rope"}, type_vocab_size=2, nsp_head=True)
    model = EncoderLM(cfg).eval()
    pairs, masked_lm = next_sentence_for(val, val.load_tokenizer(), 300, seq_len=32, batch_size=4)
    result = evaluate(model, val, batch_size=4, seq_len=32, max_batches=3, objective=Task(masked_lm, rows=pairs))
    rows, nats, hits = 0, 0.0, 0
    for i in range(3):
        inputs, labels = masked_lm.turn(pairs.rows(-1 - i), -1 - i)
        with torch.no_grad():
            logits = model.next_sentence_logits(model(**{k: v for k, v in inputs.items()
                                                         if k != "next_sentence_labels"}, return_hidden=True))
        target = inputs["next_sentence_labels"]
        nats += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        hits += int((logits.argmax(-1) == target).sum())
        rows += len(target)
    assert result.nsp_loss == pytest.approx(nats / rows, rel=1e-5)
    assert result.nsp_accuracy == pytest.approx(hits / rows)
