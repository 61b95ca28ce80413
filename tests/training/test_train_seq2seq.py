"""Encoder-decoders train through the same trainer as the other kinds: the continuation objective gives a decoder,
a prefix-LM and an encoder-decoder the same scored tokens; the loss falls, tokens processed count source and
target, and a resumed run equals the uninterrupted one."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from run_checks import assert_resume_is_exact

from archlab.config import ModelConfig
from archlab.data.batches import objective_for
from archlab.data.objectives import Continuation
from archlab.data.prepare import prepare
from archlab.errors import UserError
from archlab.training.trainer import TrainConfig, read_metrics, train

TEXT = "to be or not to be that is the question whether tis nobler in the mind to suffer "


@pytest.fixture(scope="module")
def byte_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("s2s")
    prepare([TEXT * 30 for _ in range(6)], "bytes", root / "data", num_workers=0, progress=False, val_fraction=0.3)
    return root / "data"


def enc_dec(**kw) -> ModelConfig:
    return ModelConfig(arch="encoder_decoder", vocab_size=257, d_model=32, n_layers=1, max_seq_len=64,
                       attention={"n_heads": 4}, mlp={"activation": "relu", "d_ff": 64}, position={"kind": "rope"},
                       decoder_start_token_id=256, **kw)


def decoder(**kw) -> ModelConfig:
    return ModelConfig(vocab_size=257, d_model=32, n_layers=2, max_seq_len=64, attention={"n_heads": 4, **kw},
                       mlp={"activation": "relu", "d_ff": 64}, position={"kind": "rope"})


FAST = dict(batch_size=4, seq_len=32, warmup_steps=2, eval_batches=2, log_every=1, sample_every=-1, lr=3e-3,
            checkpoint_every=3, device="cpu", objective="continuation")


def test_continuation_scores_the_same_tokens_for_every_kind():
    x = torch.arange(24).reshape(2, 12)
    dec_in, dec_labels = Continuation(5, "decoder").batch(x)
    pre_in, pre_labels = Continuation(5, "decoder", prefix_lm=True).batch(x)
    ed_in, ed_labels = Continuation(5, "encoder_decoder").batch(x)
    assert torch.equal(dec_in["input_ids"], x) and "prefix_lengths" not in dec_in
    assert pre_in["prefix_lengths"].tolist() == [5, 5] and torch.equal(pre_labels, dec_labels)
    assert torch.equal(ed_in["input_ids"], x[:, :5]) and torch.equal(ed_labels, x[:, 5:])
    # the decoder's slot j predicts token j + 1: its scored targets are exactly the encoder-decoder's labels
    assert torch.equal(dec_labels[dec_labels != -100].reshape(2, -1), ed_labels)
    assert dec_labels[0].tolist() == [-100] * 4 + list(range(5, 12)) + [-100]
    # tokens read per row: the decoder the whole window, the encoder-decoder its source plus its target
    from archlab.data.batches import tokens_processed
    assert tokens_processed(dec_in, dec_labels, "decoder") == tokens_processed(ed_in, ed_labels, "encoder_decoder")


def test_an_encoder_decoder_learns_a_continuation_and_counts_source_and_target(byte_data, tmp_path):
    train(enc_dec(), TrainConfig(budget=30, eval_every=15, **FAST), byte_data, tmp_path / "run", progress=False)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    losses = [r["loss"] for r in rows if "loss" in r]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0
    steps = [r for r in rows if "loss" in r]
    assert [r["tokens"] for r in steps[:3]] == [4 * 32, 8 * 32, 12 * 32]   # 16 source + 16 target per row
    evals = [r for r in rows if "val_loss" in r]
    assert evals and all("val_bpb" in r for r in evals)                     # a continuation is a code length


def test_a_prefix_lm_trains_on_the_continuation(byte_data, tmp_path):
    train(decoder(prefix_lm=True), TrainConfig(budget=4, **FAST), byte_data, tmp_path / "run", progress=False)
    losses = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 4 and all(loss == loss for loss in losses)


def test_a_resumed_encoder_decoder_run_equals_the_uninterrupted_run(byte_data, tmp_path):
    assert_resume_is_exact(enc_dec(), TrainConfig(budget=6, **FAST), byte_data, tmp_path)


@pytest.mark.parametrize("arch, objective", [("decoder", "mlm"), ("encoder_decoder", "mlm"),
                                             ("encoder_decoder", "next_token")])
def test_an_objective_the_kind_cannot_train_is_one_line(byte_data, arch, objective):
    from archlab.data.tokens import TokenDataset
    cfg = enc_dec() if arch == "encoder_decoder" else decoder()
    with pytest.raises(UserError, match=f"train.objective={objective} trains .* not arch={arch}"):
        objective_for(cfg, TrainConfig(objective=objective), TokenDataset(byte_data, "val"))


def write_reversed_pairs(path: Path, words: list[str], n: int, shortest: int, lengths: int) -> Path:
    """A .jsonl of n source -> target pairs, pair i of shortest + i % lengths consecutive words (from word i); the
    target is the source's words reversed."""
    import json

    lines = []
    for i in range(n):
        row = [words[(i + j) % len(words)] for j in range(shortest + i % lengths)]
        lines.append(json.dumps({"source": " ".join(row), "target": " ".join(reversed(row))}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def pair_data(tmp_path_factory) -> Path:
    """Source -> target pairs of every length 3..12: the target is the source's words reversed."""
    from archlab.data.seq2seq import prepare_seq2seq
    root = tmp_path_factory.mktemp("pairs")
    pairs = write_reversed_pairs(root / "pairs.jsonl", TEXT.split(), 120, shortest=3, lengths=10)
    prepare_seq2seq(pairs, "bytes", root / "data", progress=False, val_fraction=0.2)
    return root / "data"


PAIRS = {**FAST, "objective": "auto", "seq_len": 64}


def test_an_encoder_decoder_learns_pairs_and_counts_their_real_tokens(pair_data, tmp_path):
    from archlab.data.seq2seq import Seq2SeqDataset, Seq2SeqSampler
    train(enc_dec(), TrainConfig(budget=30, eval_every=15, **PAIRS), pair_data, tmp_path / "run", progress=False)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    losses = [r["loss"] for r in rows if "loss" in r]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    sampler = Seq2SeqSampler(Seq2SeqDataset(pair_data, "train"), 4, max_source_len=64, max_target_len=64)
    real = [int(b[0]["attention_mask"].sum()) + int((b[1] != -100).sum()) for b in map(sampler.batch, range(3))]
    assert [r["tokens"] for r in rows if "loss" in r][:3] == [sum(real[:i + 1]) for i in range(3)]
    assert [r for r in rows if "val_loss" in r]


def test_a_resumed_run_on_pairs_equals_the_uninterrupted_run(pair_data, tmp_path):
    assert_resume_is_exact(enc_dec(), TrainConfig(budget=6, **PAIRS), pair_data, tmp_path)


@pytest.mark.parametrize("model, objective, message", [
    ("decoder", "auto", "paired source/target data trains encoder-decoders, not arch=decoder"),
    ("enc_dec", "continuation", "train.objective=continuation reads a token stream"),
])
def test_pairs_for_the_wrong_model_or_objective_are_one_line(pair_data, tmp_path, model, objective, message):
    cfg = enc_dec() if model == "enc_dec" else decoder()
    with pytest.raises(UserError, match=message):
        train(cfg, TrainConfig(budget=2, **{**PAIRS, "objective": objective}), pair_data, tmp_path / "run",
              progress=False)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_pairs_longer_than_the_training_length_are_one_line_naming_the_setting(pair_data, tmp_path):
    with pytest.raises(UserError, match=r"train sources are longer than train.seq_len=8 .*raise train.seq_len"):
        train(enc_dec(), TrainConfig(budget=2, **{**PAIRS, "seq_len": 8}), pair_data, tmp_path / "run",
              progress=False)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("objective, extra", [("span_corruption", {}), ("text_infilling", {"mask_token_id": 299})])
def test_t5_and_bart_objectives_train_on_a_byte_stream(byte_data, tmp_path, objective, extra):
    """Ids past the byte tokenizer in a padded vocabulary serve as T5's sentinels or BART's mask; the byte
    tokenizer's pieces give BART its whole words and sentence ends."""
    cfg = enc_dec().with_overrides({"vocab_size": 300})
    train(cfg, TrainConfig(budget=3, **{**FAST, "objective": objective, **extra}), byte_data, tmp_path / "run",
          progress=False)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 3 and all(r["loss"] == r["loss"] for r in steps)
    evals = [r for r in rows if "val_loss" in r]
    assert evals and all("val_bpb" not in r for r in evals)      # noised slots are not a code length of the text
    if objective == "span_corruption":   # 32-token windows: 27 kept + 2 sentinels + EOS, 5 noise + 2 + EOS
        assert steps[0]["tokens"] == 4 * (30 + 8)


def test_a_token_budget_on_pairs_is_one_line(pair_data, tmp_path):
    """A tokens budget counts fixed windows; pairs have rows of every length."""
    from archlab.config import ConfigError
    with pytest.raises(ConfigError, match="train.budget_unit=tokens counts fixed windows"):
        train(enc_dec(), TrainConfig(budget=1000, budget_unit="tokens", **PAIRS), pair_data, tmp_path / "run",
              progress=False)
    assert not (tmp_path / "run").exists()
