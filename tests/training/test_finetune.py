"""`archlab finetune` (archlab.training.finetune, archlab.data.sft): chat examples packed into rows with document
ids score exactly what each example scores alone; full and LoRA fine-tunes of a tiny decoder lower the masked
loss on a synthetic task; an encoder-decoder learns prompt -> completion; a built-in template grows the
vocabulary with mean rows; resume is exact."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from run_checks import assert_resume_is_exact

from archlab.cli import main
from archlab.config import ModelConfig
from archlab.data.chat import load_chat_data
from archlab.data.objectives import IGNORE
from archlab.data.sft import SFTDataset, SFTSampler, collate_examples, pack_rows, real_token_share, write_sft_folder
from archlab.eval.evaluate import evaluate
from archlab.models import build_model
from archlab.nn.lora import LoRAConfig
from archlab.runs.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from archlab.runs.model_folder import load_run
from archlab.tokenizer import train as train_bpe
from archlab.tokenizer.chat import read_chat_templates
from archlab.tokenizer.chat_builtin import CHAT_FORMATS, install_chat_template
from archlab.training.config import SFTConfig, TrainConfig
from archlab.training.finetune import finetune

WORDS = ["cat", "dog", "bird", "fish", "tree", "rock", "star", "moon", "sun", "rain", "snow", "wind"]


def _corpus() -> str:
    rng = random.Random(0)
    lines = [f"Reverse the word {w}: {w[::-1]}. Repeat {w}: {w}." for w in WORDS for _ in range(3)]
    rng.shuffle(lines)
    return "\n".join(lines) * 4


def _rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        w = rng.choice(WORDS)
        if i % 3 == 0:
            out.append({"prompt": f"Repeat {w}: ", "completion": w})
        else:
            out.append({"messages": [{"role": "user", "content": f"Repeat {w}"},
                                     {"role": "assistant", "content": w}]})
    return out


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _base_run(folder: Path, tok: Path, cfg: ModelConfig, seed: int = 0) -> Path:
    """A run folder holding an untrained model of `cfg` and the tokenizer `tok`."""
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump({"model": cfg.to_dict()}))
    torch.manual_seed(seed)
    save_checkpoint(folder / "checkpoints", 1, build_model(cfg).state_dict(), {})
    shutil.copytree(tok, folder / "tokenizer")
    return folder


def decoder_cfg(vocab: int = 300) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, d_model=32, n_layers=2, max_seq_len=64, attention={"n_heads": 4})


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    (root / "corpus.txt").write_text(_corpus())
    tok = train_bpe(root / "corpus.txt", 300, ["<|endoftext|>"])
    tok.save(root / "tok")
    shutil.copytree(root / "tok", root / "tok_plain")          # no chat template: --chat-template adds one
    install_chat_template(root / "tok", "chatml")
    base = _base_run(root / "base", root / "tok", decoder_cfg(302))      # 300 + the two ChatML tokens
    plain = _base_run(root / "base_plain", root / "tok_plain", decoder_cfg(300))
    data = _jsonl(root / "sft.jsonl", _rows(48))
    return {"root": root, "tok": root / "tok", "base": base, "base_plain": plain, "data": data}


def _cfg(**kw) -> TrainConfig:
    base = dict(batch_size=4, seq_len=32, budget=20, lr=3e-3, warmup_steps=2, eval_batches=4, eval_every=0,
                sample_every=-1, memory_check=False, device="cpu", checkpoint_every=0)
    return TrainConfig(**{**base, **kw})


# ---- packing ---------------------------------------------------------------------------------------------------
def test_pack_rows_places_every_example_once_within_seq_len():
    lengths = [5, 17, 3, 9, 12, 1, 16, 8, 8, 2]
    rows = pack_rows(lengths, 20)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 20 for row in rows)
    assert len(rows) == 5          # 81 tokens: best-fit decreasing needs ceil(81 / 20) = 5 rows here


def test_packed_batch_loss_equals_the_examples_run_alone(world, tmp_path):
    examples = load_chat_data(world["data"], world["tok"], max_tokens=32, progress=False).examples[:10]
    write_sft_folder(tmp_path / "sft", {"train": examples, "val": examples[:2]}, world["tok"], 302, 0)
    dataset = SFTDataset(tmp_path / "sft")
    rows = pack_rows(dataset.lengths(), 32)
    assert any(len(row) > 1 for row in rows)
    inputs, labels = collate_examples(dataset, rows, 32)
    torch.manual_seed(0)
    model = build_model(decoder_cfg(302)).eval()
    with torch.no_grad():
        packed = model(**inputs, targets=labels)
        nats = float(packed.ce) * int((labels != IGNORE).sum())
        alone, scored = 0.0, 0
        for example in examples:                       # each example by itself, no document ids, its own mask
            ids = torch.tensor([example.input_ids])
            lab = torch.tensor([example.labels])
            n = int((lab != IGNORE).sum())
            alone += float(model(ids, targets=lab).ce) * n
            scored += n
        padded_inputs, padded_labels = collate_examples(dataset, [[i] for i in range(len(examples))])
        padded = float(model(**padded_inputs, targets=padded_labels).ce) * scored
    assert scored == int((labels != IGNORE).sum())
    assert nats == pytest.approx(alone, rel=1e-5)
    assert padded == pytest.approx(alone, rel=1e-5)


def test_sampler_batches_are_a_function_of_the_step_and_count_real_tokens(world, tmp_path):
    from archlab.data.batches import tokens_processed

    examples = load_chat_data(world["data"], world["tok"], max_tokens=32, progress=False).examples
    write_sft_folder(tmp_path / "sft", {"train": examples, "val": []}, world["tok"], 302, 0)
    dataset = SFTDataset(tmp_path / "sft")
    a, b = SFTSampler(dataset, 4, 32, seed=3), SFTSampler(dataset, 4, 32, seed=3)
    for step in (0, 5, 2):
        (xa, ya), (xb, yb) = a.batch(step), b.batch(step)
        assert torch.equal(xa["input_ids"], xb["input_ids"]) and torch.equal(ya, yb)
    inputs, labels = a.batch(0)
    assert tokens_processed(inputs, labels, "decoder") == int((inputs["document_ids"] >= 0).sum())
    assert real_token_share(dataset, 4, 32, packing=True) > real_token_share(dataset, 4, 32, packing=False)


# ---- fine-tuning runs -------------------------------------------------------------------------------------------
def _val_loss(run_or_model, data_dir: Path) -> float:
    model = run_or_model if isinstance(run_or_model, torch.nn.Module) else load_run(run_or_model, device="cpu")[0]
    return evaluate(model, SFTDataset(data_dir, "val"), batch_size=4, seq_len=32, max_batches=4).loss


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_finetune_lowers_the_masked_loss(world, tmp_path, lora):
    cfg = _cfg(lora=LoRAConfig(r=4, targets=("all-linear",)), lr=1e-2) if lora else _cfg(lr=1e-2)
    out = tmp_path / "run"
    result = finetune(world["base"], world["data"], out, train_cfg=cfg, val=world["data"], progress=False)
    before = _val_loss(load_run(world["base"], device="cpu")[0], out / "data")
    # full: every weight moves; LoRA on an untrained (random) base moves less in 30 steps, but clearly
    assert result.final_val_loss < (before - 0.25 if lora else 0.7 * before)
    assert read_chat_templates(out / "tokenizer") == read_chat_templates(world["tok"])
    state, _ = load_checkpoint(latest_checkpoint(out))
    base, _ = load_checkpoint(latest_checkpoint(world["base"]))
    if lora:                                        # the base is frozen: only the adapters moved
        assert any(".lora_" in k for k in state)
        assert all(torch.equal(state[k], base[k]) for k in base)
    else:
        assert not torch.equal(state["embed.weight"], base["embed.weight"])


def test_finetune_through_the_cli_with_a_built_in_template_grows_the_vocabulary(world, tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["finetune", str(world["base_plain"]), "--data", str(world["data"]), "--out", str(out),
               "--chat-template", "chatml", "--no-progress", "--set", "train.budget=2", "--set", "train.seq_len=32",
               "--set", "train.batch_size=4", "--set", "train.memory_check=false", "--set", "train.sample_every=-1",
               "--set", "train.eval_batches=1"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "embedding and head rows 300 -> 302" in err
    assert read_chat_templates(out / "tokenizer") == CHAT_FORMATS["chatml"].source("<|endoftext|>")
    model, _ = load_run(out, device="cpu")
    assert model.config.vocab_size == 302
    base, _ = load_checkpoint(latest_checkpoint(world["base_plain"]))
    start = ModelConfig.from_dict(yaml.safe_load((out / "config.yaml").read_text())["model"])
    assert start.vocab_size == 302
    mean = base["embed.weight"].mean(dim=0)
    from archlab.training.finetune import grow_vocab
    from archlab.training.init_from import read_init_source
    grown, _ = grow_vocab(read_init_source(world["base_plain"]), [300, 301], 300)
    assert torch.equal(grown.state["embed.weight"][300], mean) and torch.equal(grown.state["embed.weight"][301], mean)
    assert torch.equal(grown.state["embed.weight"][:300], base["embed.weight"])


def test_unpacked_finetune_trains_the_same_examples_padded(world, tmp_path):
    result = finetune(world["base"], world["data"], tmp_path / "run",
                      train_cfg=_cfg(sft=SFTConfig(packing=False), budget=3),
                      progress=False)
    assert result.steps == 3 and result.final_val_loss is not None


def test_encoder_decoder_finetune_learns_prompt_to_completion(world, tmp_path, capsys):
    cfg = ModelConfig.from_dict(dict(arch="encoder_decoder", vocab_size=302, d_model=32, n_layers=1, max_seq_len=64,
                                     attention=dict(n_heads=4)))
    base = _base_run(tmp_path / "t5", world["tok"], cfg)
    rows = [{"prompt": f"Repeat {w}: ", "completion": w} for w in WORDS] * 2
    data = _jsonl(tmp_path / "pairs.jsonl", rows + [r for r in _rows(6) if "messages" in r])
    result = finetune(base, data, tmp_path / "run", train_cfg=_cfg(lr=1e-2), val=data, progress=False)
    from archlab.data.seq2seq import Seq2SeqDataset
    val = Seq2SeqDataset(tmp_path / "run" / "data", "val")
    before = evaluate(load_run(base, device="cpu")[0], val, batch_size=4, seq_len=32).loss
    assert len(val) == len(rows) + 4
    assert result.final_val_loss < 0.7 * before
    # `archlab eval` reads the run's pairs: the targets' loss, as the trained model scores them here
    import json
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--json", "--device", "cpu"]) == 0
    after = evaluate(load_run(tmp_path / "run", device="cpu")[0], val, batch_size=4, seq_len=32).loss
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(after, rel=1e-6)


def test_resume_of_a_finetune_is_exact(world, tmp_path):
    first = finetune(world["base"], world["data"], tmp_path / "prep", train_cfg=_cfg(budget=1), progress=False)
    assert first.steps == 1
    model_cfg = ModelConfig.from_dict(yaml.safe_load((tmp_path / "prep" / "config.yaml").read_text())["model"])
    cfg = _cfg(budget=4, checkpoint_every=1, lora=LoRAConfig(r=2, targets=("q", "v")), eval_every=2, log_every=1)
    assert_resume_is_exact(model_cfg, cfg, tmp_path / "prep" / "data", tmp_path)


def test_resume_with_other_data_is_refused_naming_the_setting(world, tmp_path):
    out = tmp_path / "run"
    finetune(world["base"], world["data"], out, train_cfg=_cfg(budget=1), progress=False)
    other = _jsonl(tmp_path / "other.jsonl", _rows(10, seed=1))
    with pytest.raises(Exception, match="sha256"):
        finetune(world["base"], other, out, train_cfg=_cfg(budget=2), resume=True, progress=False)
    result = finetune(world["base"], world["data"], out, train_cfg=_cfg(budget=2), resume=True, progress=False)
    assert result.steps == 2


def test_finetune_from_an_hf_folder_keeps_its_tokenizer_and_template(world, tmp_path):
    assert main(["convert", "--to-hf", str(world["base"]), "--out", str(tmp_path / "hf")]) == 0
    out = tmp_path / "run"
    result = finetune(tmp_path / "hf", world["data"], out, train_cfg=_cfg(budget=2, lr=1e-9), progress=False)
    assert result.steps == 2
    assert read_chat_templates(out / "tokenizer") == read_chat_templates(world["tok"])
    assert yaml.safe_load((out / "config.yaml").read_text())["init_from"]["source"] == str(tmp_path / "hf")
    state, _ = load_checkpoint(latest_checkpoint(out))          # lr ~0: the weights are the HF folder's
    base, _ = load_checkpoint(latest_checkpoint(world["base"]))
    assert all(torch.allclose(state[k], base[k], atol=1e-6) for k in base)


# ---- LoRA with trainable token rows (train.lora.trainable_tokens) --------------------------------------------------
def test_template_names_the_special_tokens_the_chat_template_writes(world, tmp_path):
    from archlab.tokenizer.chat import ChatTokenizer
    from archlab.training.lora import resolve_tokens

    assert ChatTokenizer.of(world["tok"]).template_token_ids() == [300, 301]          # <|im_start|>, <|im_end|>
    install_chat_template(shutil.copytree(world["root"] / "tok_plain", tmp_path / "plain"), "plain")
    plain = ChatTokenizer.of(tmp_path / "plain")
    assert plain.template_token_ids() == [plain.tokenizer.token_to_id("<|endoftext|>")]   # plain writes only that
    cfg = TrainConfig(lora=LoRAConfig(r=2)).with_overrides({"lora.trainable_tokens": "<|im_end|>, 5,template,5"})
    assert resolve_tokens(cfg, world["tok"]).lora.trainable_tokens == (5, 300, 301)
    seven_two = TrainConfig(lora=LoRAConfig(r=2, trainable_tokens=(7, 2)))
    assert resolve_tokens(seven_two, None).lora.trainable_tokens == (2, 7)


def test_lora_with_template_tokens_trains_those_rows_alone(world, tmp_path):
    from archlab.runs.checkpoint import list_checkpoints, load_trainer_state

    cfg = _cfg(lora=LoRAConfig(r=4, targets=("all-linear",), trainable_tokens=("template",)), budget=4, lr=1e-2)
    finetune(world["base"], world["data"], tmp_path / "run", train_cfg=cfg, progress=False)
    recorded = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["train"]
    assert recorded["lora"]["trainable_tokens"] == [300, 301]
    state, _ = load_checkpoint(latest_checkpoint(tmp_path / "run"))
    base, _ = load_checkpoint(latest_checkpoint(world["base"]))
    assert all(torch.equal(state[k], base[k]) for k in base)                     # embed.weight itself never moves
    assert state["embed.token_indices"].tolist() == [300, 301]
    trained = base["embed.weight"].index_add(0, state["embed.token_indices"], state["embed.trainable_tokens_delta"])
    assert torch.equal(trained[:300], base["embed.weight"][:300])                # every other row bitwise the base
    assert (trained[300:] - base["embed.weight"][300:]).abs().amax(dim=1).gt(0).all()
    optim = load_trainer_state(list_checkpoints(tmp_path / "run")[-1])["optimizer"]["state"]
    shapes = [tuple(s["exp_avg"].shape) for s in optim.values()]
    assert (2, 32) in shapes and (302, 32) not in shapes                         # optimizer state for the 2 rows


def test_a_trainable_token_that_is_no_token_is_one_line_and_writes_nothing(world, tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["finetune", str(world["base"]), "--data", str(world["data"]), "--out", str(out), "--lora-r", "2",
               "--lora-trainable-tokens", "<|im_start|>,<|nope|>", "--set", "train.memory_check=false"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err
    assert "train.lora.trainable_tokens: '<|nope|>' is not a token of the tokenizer" in err
    assert not out.exists()


def test_eval_of_a_finetune_scores_its_held_out_answers_as_training_did(world, tmp_path, capsys):
    """`archlab eval RUN` on a fine-tune reads its chat-example folder: the loss over the answers of every held-out
    example, the trainer's own val_loss when eval_batches covers them all."""
    import json

    out = tmp_path / "run"
    result = finetune(world["base"], world["data"], out, train_cfg=_cfg(budget=3, eval_batches=1000), progress=False)
    capsys.readouterr()
    assert main(["eval", str(out), "--json", "--device", "cpu"]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert scored["loss"] == pytest.approx(result.final_val_loss, rel=1e-6)
    assert main(["eval", str(out), "--split", "train", "--batches", "1", "--device", "cpu"]) == 0
    line = capsys.readouterr().out
    assert line.startswith("train: loss ") and "scored in" in line and "bits/byte" not in line
