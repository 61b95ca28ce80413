"""An encoder trains on BERT's masked LM through the same trainer: the loss falls, evaluation reports MLM loss
and accuracy on fixed masks, and a resumed run equals the uninterrupted one exactly."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from run_checks import assert_resume_is_exact

from archlab.config import ModelConfig
from archlab.data.prepare import prepare
from archlab.errors import UserError
from archlab.models.encoder import EncoderLM
from archlab.runs.checkpoint import latest_checkpoint
from archlab.runs.model_folder import load_run
from archlab.tokenizer import train as train_tokenizer
from archlab.training.trainer import TrainConfig, read_metrics, train

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()


def _docs(n=40, words=200):
    """The words in one fixed cycle from a random start: a masked word is predictable from its neighbours."""
    rng = random.Random(0)
    docs = []
    for _ in range(n):
        start = rng.randrange(len(WORDS))
        docs.append(" ".join(WORDS[(start + i) % len(WORDS)] for i in range(words)))
    return docs


@pytest.fixture(scope="module")
def mlm_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mlm")
    (root / "corpus.txt").write_text("\n".join(_docs()))
    tok = train_tokenizer([root / "corpus.txt"], 300, ["<|endoftext|>", "[MASK]"], kind="bpe")
    prepare(_docs(), tok, root / "data", num_workers=0, progress=False)
    return root / "data"


def encoder(vocab_size=300, **kw) -> ModelConfig:
    """BERT's wiring with RoPE (as ModernBERT): learned absolute positions need hundreds of steps before a masked
    slot learns to read its neighbours."""
    return ModelConfig(arch="encoder", vocab_size=vocab_size, d_model=32, n_layers=2, max_seq_len=64,
                       attention={"n_heads": 4}, mlp={"activation": "gelu", "d_ff": 64},
                       norm={"kind": "layernorm", "position": "post", "final_norm": False, "embedding_norm": True},
                       position={"kind": "rope"}, bias={"qkv": True, "mlp": True, "norm": True, "head": True},
                       tie_embeddings=True, **kw)


FAST = dict(batch_size=8, seq_len=32, warmup_steps=2, eval_batches=2, log_every=1, sample_every=-1, lr=3e-3,
            checkpoint_every=4, device="cpu")


def test_mlm_loss_falls_and_eval_reports_accuracy(mlm_data, tmp_path):
    result = train(encoder(), TrainConfig(budget=30, eval_every=10, **FAST), mlm_data, tmp_path / "run",
                   progress=False)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    losses = [r["loss"] for r in rows if "loss" in r]
    evals = [r for r in rows if "val_loss" in r]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    assert all("val_mlm_accuracy" in r and "val_bpb" not in r for r in evals)
    assert all(0.0 <= r["val_mlm_accuracy"] <= 1.0 for r in evals)
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] and result.final_val_loss == evals[-1]["val_loss"]
    model, tok = load_run(tmp_path / "run")
    assert isinstance(model, EncoderLM) and tok.token_to_id("[MASK]") is not None


def test_eval_scores_the_masked_slots_by_hand(mlm_data):
    from archlab.data.objectives import masked_lm_for
    from archlab.data.tokens import TokenDataset, eval_batches
    from archlab.eval.evaluate import evaluate

    val = TokenDataset(mlm_data, "val")
    model = EncoderLM(encoder()).eval()
    objective = masked_lm_for(val.load_tokenizer(), 300)
    result = evaluate(model, val, batch_size=2, seq_len=32, max_batches=3, objective=objective)
    nats, hits, n = 0.0, 0, 0
    for i, (x, _) in enumerate(eval_batches(val, 2, 32, 3)):
        inputs, labels = objective.batch(x, step=-1 - i)
        logits = model(inputs)[labels != -100]
        target = labels[labels != -100]
        nats += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        hits += int((logits.argmax(-1) == target).sum())
        n += len(target)
    assert result.tokens == n
    assert result.loss == pytest.approx(nats / n, rel=1e-5)
    assert result.accuracy == pytest.approx(hits / n)


def test_resumed_mlm_run_equals_the_uninterrupted_run(mlm_data, tmp_path):
    """Resume from the step-4 checkpoint of an 8-step run: masks, data order and weights continue exactly."""
    assert_resume_is_exact(encoder(), TrainConfig(budget=8, **FAST), mlm_data, tmp_path)


def test_whole_word_masking_trains_too(mlm_data, tmp_path):
    train(encoder(), TrainConfig(budget=3, whole_word_mask=True, **FAST), mlm_data, tmp_path / "run", progress=False)
    assert latest_checkpoint(tmp_path / "run") is not None


def test_an_encoder_on_data_without_a_mask_token_is_one_line(tmp_path):
    prepare(_docs(5, 50), "bytes", tmp_path / "data", num_workers=0, progress=False)
    with pytest.raises(UserError, match=r"mask token"):
        train(encoder(vocab_size=257), TrainConfig(budget=2, **FAST), tmp_path / "data", tmp_path / "run",
              progress=False)


def test_a_byte_level_run_masks_with_an_id_past_the_tokenizer(tmp_path):
    """train.mask_token_id: a padded vocabulary's spare id serves as [MASK] (the lab's rank_collapse suite)."""
    from archlab.data.objectives import masked_lm_for
    from archlab.data.tokens import TokenDataset

    prepare(_docs(5, 50), "bytes", tmp_path / "data", num_workers=0, progress=False)
    tok = TokenDataset(tmp_path / "data", "train").load_tokenizer()
    objective = masked_lm_for(tok, 258, mask_id=257, prob=0.5)
    x = torch.randint(0, 256, (64, 64))
    inputs, labels = objective.batch(x, step=0)
    assert abs((labels != -100).float().mean().item() - 0.5) < 0.03          # mlm_probability is honoured
    assert (inputs == 257).any() and not (labels == 257).any()
    with pytest.raises(UserError, match="outside the model's vocabulary"):
        masked_lm_for(tok, 257, mask_id=257)
    train(encoder(vocab_size=258), TrainConfig(budget=2, mask_token_id=257, **FAST), tmp_path / "data",
          tmp_path / "run", progress=False)
    assert latest_checkpoint(tmp_path / "run") is not None
