"""`archlab train --init-from`: a new run from an imported model's weights, checked against transformers' own
loss on the first batch; the data's tokenizer compared by what encodes; an imported folder is not resumed."""
from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

from archlab.cli import main
from archlab.config import ModelConfig
from archlab.data.batches import TrainBatches, open_splits
from archlab.runs.checkpoint import latest_checkpoint
from archlab.runs.provenance import tokenizer_fingerprint
from archlab.training.config import TrainConfig

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TRAIN = ["--set", "train.budget=2", "--set", "train.batch_size=2", "--set", "train.seq_len=16", "--set",
         "train.log_every=1", "--set", "train.sample_every=-1", "--set", "train.eval_batches=1", "--no-progress"]
TEXT = ["the quick brown fox jumps over the lazy dog", "to be or not to be that is the question"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny HF llama (large random weights, so its loss is its own) with a byte-level BPE tokenizer.json and the
    side files save_pretrained writes; a corpus; that corpus prepared with the HF folder's tokenizer."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("init_from")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([t * 20 for t in TEXT], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, initializer_range=0.3, tie_word_embeddings=False)
    hf = root / "hf"
    transformers.LlamaForCausalLM(config).save_pretrained(hf)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(hf)
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"d{i}.txt").write_text(f"{TEXT[i % 2]} number {i} and {TEXT[(i + 1) % 2]}. " * 3)
    assert main(["data", "prepare", "--corpus", str(corpus), "--tokenizer", str(hf), "--out", str(root / "data"),
                 "--workers", "0", "--quiet"]) == 0
    assert main(["convert", "--from-hf", str(hf), "--out", str(root / "imported")]) == 0
    return root


def _first_batch_loss_by_transformers(hf_dir, run_dir) -> float:
    """transformers' cross-entropy on the batch the run's first step trained on (TrainBatches at step 0)."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    model_cfg, train_cfg = ModelConfig.from_dict(cfg["model"]), TrainConfig.from_dict(cfg["train"])
    inputs, labels = TrainBatches(model_cfg, train_cfg, open_splits(cfg["data"]["dir"])[0]).next(0, 0)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(input_ids=inputs["input_ids"], use_cache=False).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()))


@pytest.mark.parametrize("source", ["imported", "hf"])
def test_training_starts_from_the_imported_weights(world, tmp_path, source, capsys):
    out = tmp_path / "run"
    assert main(["train", "--init-from", str(world / source), "--data", str(world / "data"), "--out", str(out),
                 *TRAIN]) == 0
    assert f"(started from the weights of {world / source})" in capsys.readouterr().out
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    reference = _first_batch_loss_by_transformers(world / "hf", out)
    assert first["step"] == 1 and first["loss"] == pytest.approx(reference, rel=1e-5)
    assert abs(reference - math.log(300)) > 1.0          # the source's own loss, not an untrained model's
    assert latest_checkpoint(out).name == "step_0000002"
    record = yaml.safe_load((out / "config.yaml").read_text())["init_from"]
    assert record["source"] == str(world / source) and record["tokenizer_fingerprint"]
    # resuming the new run continues it (the init source is not read again)
    assert main(["train", "--resume", "--config", str(out / "config.yaml"), "--data", str(world / "data"),
                 "--out", str(out), "--set", "train.budget=3", "--no-progress"]) == 0
    assert latest_checkpoint(out).name == "step_0000003"


def test_lora_fine_tuning_starts_from_the_imported_weights(world, tmp_path):
    """--init-from with train.lora: the adapters start at zero (the first loss is the source's own) and train
    alone; the base weights in the checkpoint are the source's."""
    from safetensors.torch import load_file
    out = tmp_path / "lora"
    assert main(["train", "--init-from", str(world / "hf"), "--data", str(world / "data"), "--out", str(out),
                 "--set", "train.lora.r=4", "--set", "train.lora.targets=q,v", *TRAIN]) == 0
    first = next(r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r)
    assert first["loss"] == pytest.approx(_first_batch_loss_by_transformers(world / "hf", out), rel=1e-5)
    state = load_file(latest_checkpoint(out) / "model.safetensors")
    source = load_file(latest_checkpoint(world / "imported") / "model.safetensors")
    assert any(".lora_B" in k and bool(v.abs().sum() > 0) for k, v in state.items())   # the adapters trained
    assert all(torch.equal(state[k], v) for k, v in source.items())                  # the base did not move


def test_fingerprint_is_over_what_encodes(world):
    """The HF folder (tokenizer.json beside tokenizer_config.json, config.json, ...) and the data folder's re-saved
    copy (tokenizer.json, vocab.json, merges.txt) are one tokenizer; the byte tokenizer is another."""
    hf, data_tok = world / "hf", world / "data" / "tokenizer"
    assert {p.name for p in hf.iterdir()} != {p.name for p in data_tok.iterdir()}
    assert tokenizer_fingerprint(hf) == tokenizer_fingerprint(data_tok) == tokenizer_fingerprint(
        world / "imported" / "tokenizer")
    assert tokenizer_fingerprint(world / "corpus") is None


def _run(argv, capsys):
    capsys.readouterr()
    rc = main(argv)
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_data_with_another_tokenizer_is_refused(world, tmp_path, capsys):
    bytes_data = tmp_path / "bytes_data"
    assert main(["data", "prepare", "--corpus", str(world / "corpus"), "--tokenizer", "bytes", "--out",
                 str(bytes_data), "--workers", "0", "--quiet"]) == 0
    rc, err = _run(["train", "--init-from", str(world / "imported"), "--data", str(bytes_data), "--out",
                    str(tmp_path / "run"), *TRAIN], capsys)
    assert rc == 2 and len(err) == 1 and "different tokenizer" in err[0], err
    assert not (tmp_path / "run").exists()


def test_an_override_that_changes_a_weight_is_refused(world, tmp_path, capsys):
    rc, err = _run(["train", "--init-from", str(world / "imported"), "--data", str(world / "data"), "--out",
                    str(tmp_path / "run"), "--set", "n_layers=3", *TRAIN], capsys)
    assert rc == 2 and len(err) == 1 and "only --set overrides that keep every weight's shape" in err[0], err
    assert not (tmp_path / "run").exists()
    rc, err = _run(["train", "--init-from", str(world / "imported"), "--data", str(world / "data"), "--out",
                    str(tmp_path / "run"), "--preset", "tiny:llama2-7b", *TRAIN], capsys)
    assert rc == 2 and len(err) == 1 and "--init-from gives the model" in err[0], err


def test_resuming_an_imported_folder_points_at_init_from(world, tmp_path, capsys):
    import shutil
    imported = tmp_path / "imported"
    shutil.copytree(world / "imported", imported)
    before = {p: p.read_bytes() for p in imported.rglob("*") if p.is_file()}
    rc, err = _run(["train", "--resume", "--config", str(imported / "config.yaml"), "--data", str(world / "data"),
                    "--out", str(imported), "--allow-new-data", *TRAIN], capsys)
    assert rc == 2 and len(err) == 1 and f"--init-from {imported}" in err[0], err
    assert {p: p.read_bytes() for p in imported.rglob("*") if p.is_file()} == before
