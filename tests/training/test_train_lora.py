"""LoRA fine-tuning through the trainer (train.lora): the base frozen, only the adapters in the optimizer and its
memory measured, exact resume, the run folder loading merged, and `archlab convert --to-peft` giving PEFT the
run's logits."""
from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
from run_checks import assert_resume_is_exact

import archlab
from archlab.cli import main
from archlab.config import ConfigError
from archlab.data.prepare import prepare
from archlab.nn.lora import LoRAConfig
from archlab.runs.checkpoint import list_checkpoints, load_checkpoint, load_trainer_state
from archlab.runs.model_folder import load_run
from archlab.training.trainer import TrainConfig, fit_vocab, read_metrics, train

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()
LORA = LoRAConfig(r=4, alpha=8.0, targets=("q", "v", "down"))
FAST = dict(batch_size=4, seq_len=16, warmup_steps=2, eval_batches=2, log_every=1, sample_every=-1, lr=1e-2,
            eval_every=0, lora=LORA, memory_check=False)


def lora(**changes) -> dict:
    """FAST with train.lora changed."""
    return {**FAST, "lora": dataclasses.replace(LORA, **changes)}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(200)) for _ in range(30)]
    path = tmp_path_factory.mktemp("data") / "d"
    prepare(docs, "bytes", path, num_workers=0, progress=False)
    return path


def _cfg(data_dir):
    return fit_vocab(archlab.presets.tiny("llama3-8b", d_model=32), data_dir)


def test_lora_run_trains_adapters_only_and_reports_optimizer_memory(data_dir, tmp_path, capsys):
    cfg = TrainConfig(budget=4, checkpoint_every=1, keep_last=10, **FAST)
    train(_cfg(data_dir), cfg, data_dir, tmp_path / "run", progress=True)
    first, last = (load_checkpoint(p)[0] for p in list_checkpoints(tmp_path / "run")[::3])
    adapters = {k for k in last if k.endswith(("lora_A", "lora_B"))}
    assert len(adapters) == 2 * 3 * 2                            # A, B x (q, v, down) x 2 layers
    for name in set(last) - adapters:                            # the base never moves
        assert torch.equal(first[name], last[name]), name
    assert all(last[k].abs().max() > 0 for k in adapters if k.endswith("lora_B"))   # B left zero: it trained
    optim = load_trainer_state(list_checkpoints(tmp_path / "run")[-1])["optimizer"]
    assert len(optim["state"]) == len(adapters)                  # only adapters have optimizer state
    record = next(r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "optimizer_bytes" in r)
    trainable = sum(last[k].numel() for k in adapters)
    assert record["trainable_params"] == trainable
    assert record["optimizer_bytes"] == trainable * 4 * 2 + len(adapters) * 4   # exp_avg, exp_avg_sq, step
    assert record["optimizer_bytes"] * 10 < record["optimizer_bytes_full"]
    assert "LoRA: " in capsys.readouterr().err
    # the plan's memory estimate counts gradients and optimizer state for the adapters alone
    from archlab.training.lora import scale_memory
    parts = scale_memory({"weights": 10**6, "grads": 10**6, "optimizer": 2 * 10**6}, _cfg(data_dir), cfg)
    share = record["trainable_params"] / record["params"]
    assert parts == {"weights": 10**6, "grads": int(10**6 * share), "optimizer": int(2 * 10**6 * share)}


def test_lora_run_resumes_exactly(data_dir, tmp_path):
    cfg = TrainConfig(budget=4, checkpoint_every=2, **lora(dropout=0.1))
    assert_resume_is_exact(_cfg(data_dir), cfg, data_dir, tmp_path)


def test_run_folder_loads_merged_and_exports_to_peft(data_dir, tmp_path, capsys):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    cfg = TrainConfig(budget=3, **lora(targets=("all-linear",), use_rslora=True))
    train(_cfg(data_dir), cfg, data_dir, tmp_path / "run", progress=False)
    adapted, _ = load_run(tmp_path / "run", merge_adapters=False)
    merged, _ = load_run(tmp_path / "run")
    ids = torch.randint(0, 257, (2, 12))
    with torch.no_grad():
        ours = merged(ids)
        torch.testing.assert_close(adapted(ids), ours, rtol=1e-5, atol=1e-5)
    # the base as an HF folder: the run's weights without the adapters
    state = {k: v for k, v in adapted.state_dict().items() if not k.endswith(("lora_A", "lora_B"))}
    base = archlab.build_model(adapted.config)
    base.load_state_dict(state)
    archlab.interop.save_hf(base, tmp_path / "base")
    assert main(["convert", "--to-peft", str(tmp_path / "run"), "--out", str(tmp_path / "adapter")]) == 0
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["use_rslora"] is True
    hf = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager"),
        tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = hf(input_ids=ids, use_cache=False).logits
        plain = base.eval()(ids)
    assert float((ours - theirs).abs().max() / theirs.abs().max()) < 1e-4
    assert float((ours - plain).abs().max()) > 1e-4               # the adapters changed the model
    # a second export to the same folder is refused; a run without adapters has none to export
    assert main(["convert", "--to-peft", str(tmp_path / "run"), "--out", str(tmp_path / "adapter")]) == 2
    assert "already exists" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, message", [
    ({"r": 0}, "lora.r=0 must be an integer >= 1"),
    ({"targets": "q,nope"}, "lora target 'nope' matches no Linear"),
    ({"trainable_tokens": "<|endoftext|>,bogus"}, "train.lora.trainable_tokens: 'bogus' is not a token of the "
                                                  "tokenizer in"),
    ({"trainable_tokens": "3,999"}, "train.lora.trainable_tokens: token id 999 is past the model's vocab_size"),
    ({"modules_to_save": "blocks.0.attn"}, "lora modules_to_save 'blocks.0.attn.q_proj' holds the LoRA target"),
    ({"modules_to_save": "embed", "trainable_tokens": "3"}, "'embed' is the input embedding whose"),
])
def test_bad_lora_settings_write_nothing(data_dir, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        cfg = TrainConfig(budget=2, **lora(**overrides))
        train(_cfg(data_dir), cfg, data_dir, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_lora_settings_as_dotted_keys():
    cfg = TrainConfig().with_overrides({"train.lora.r": "8", "lora.alpha": "32", "lora.targets": "all-linear",
                                        "lora.rslora": "true"})
    assert cfg.lora == LoRAConfig(r=8, alpha=32.0, targets=("all-linear",), use_rslora=True)
    assert TrainConfig().lora is None
    assert cfg.with_overrides({"lora.trainable_tokens": "template"}).lora.trainable_tokens == ("template",)
    with pytest.raises(ConfigError, match=r"train.lora.trainable_tokens needs train.lora.r"):
        TrainConfig().with_overrides({"lora.trainable_tokens": "template"})
    # the earlier flat keys read through the rename table (runs/train_section.py), and LoRA turns off again
    assert TrainConfig().with_overrides({"train.lora_r": "8", "train.lora_alpha": "32", "lora_targets": "all-linear",
                                         "lora_rslora": "true"}) == cfg
    assert cfg.with_overrides({"train.lora": "none"}).lora is None


def test_adapters_draw_from_the_run_seed_alone():
    """Data-parallel ranks seed the global RNG by rank; the adapters must start equal on all of them."""
    from archlab.training.lora import attach

    def adapters(global_seed: int, run_seed: int):
        model = archlab.build_model(archlab.presets.tiny("llama3-8b"))
        torch.manual_seed(global_seed)
        attach(model, TrainConfig(lora=LoRAConfig(r=2), seed=run_seed))
        return {k: v for k, v in model.state_dict().items() if k.endswith("lora_A")}

    a, b, c = adapters(0, 5), adapters(1, 5), adapters(0, 6)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_resume_with_other_lora_settings_is_refused_and_writes_nothing(data_dir, tmp_path):
    cfg = TrainConfig(budget=2, **FAST)
    train(_cfg(data_dir), cfg, data_dir, tmp_path / "run", progress=False)
    before = (tmp_path / "run" / "config.yaml").read_bytes()
    with pytest.raises(ConfigError, match=r"train.lora.r=8 differs from the run's 4"):
        train(_cfg(data_dir), TrainConfig(budget=3, **lora(r=8)), data_dir, tmp_path / "run",
              resume=True, progress=False)
    assert (tmp_path / "run" / "config.yaml").read_bytes() == before


def test_a_run_with_trainable_token_rows_loads_merged_and_exports_to_peft(data_dir, tmp_path):
    """The checkpoint names the rows (embed.token_indices); load_run wraps the embedding on them before loading."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    cfg = TrainConfig(budget=3, **lora(trainable_tokens=(101, 32)))          # 'e' and ' ' bytes (+1 offset)
    train(_cfg(data_dir), cfg, data_dir, tmp_path / "run", progress=False)
    adapted, _ = load_run(tmp_path / "run", merge_adapters=False)
    merged, _ = load_run(tmp_path / "run")
    ids = torch.randint(0, 257, (2, 12))
    with torch.no_grad():
        ours = merged(ids)
        torch.testing.assert_close(adapted(ids), ours, rtol=1e-5, atol=1e-5)
    base = archlab.build_model(adapted.config)
    base.load_state_dict({k: v for k, v in adapted.state_dict().items()
                          if not k.endswith(("lora_A", "lora_B", "token_indices", "trainable_tokens_delta"))})
    rows = (merged.state_dict()["embed.weight"] - base.state_dict()["embed.weight"]).abs().sum(-1)   # (vocab,)
    assert sorted(torch.nonzero(rows).flatten().tolist()) == [32, 101]           # those rows trained, no other
    archlab.interop.save_hf(base, tmp_path / "base")
    assert main(["convert", "--to-peft", str(tmp_path / "run"), "--out", str(tmp_path / "adapter")]) == 0
    hf = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager"),
        tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = hf(input_ids=ids, use_cache=False).logits
    assert float((ours - theirs).abs().max() / theirs.abs().max()) < 1e-4


def test_a_run_with_modules_to_save_trains_them_whole_and_exports_to_peft(data_dir, tmp_path, capsys):
    """train.lora.modules_to_save: the module trains beside the adapters (and has optimizer state), every other
    base tensor stays; `convert --to-peft` writes it as PEFT's modules_to_save and PEFT computes the run's logits."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    cfg = TrainConfig(budget=3, checkpoint_every=1, keep_last=10, **lora(modules_to_save=("final_norm",)))
    train(_cfg(data_dir), cfg, data_dir, tmp_path / "run", progress=False)
    init = archlab.build_model(_cfg(data_dir)).state_dict()
    last_ckpt = list_checkpoints(tmp_path / "run")[-1]
    last = load_checkpoint(last_ckpt)[0]
    norm = "blocks.final_norm.weight"
    assert torch.equal(init[norm], torch.ones_like(init[norm])) and not torch.equal(last[norm], init[norm])
    first = load_checkpoint(list_checkpoints(tmp_path / "run")[0])[0]
    moved = {k for k in last if not torch.equal(first[k], last[k])}
    assert moved - {k for k in last if k.endswith(("lora_A", "lora_B"))} == {norm}     # the base stays but it
    assert len(load_trainer_state(last_ckpt)["optimizer"]["state"]) == 2 * 3 * 2 + 1   # adapters + the norm
    merged, _ = load_run(tmp_path / "run")
    base = archlab.build_model(merged.config)
    adapted, _ = load_run(tmp_path / "run", merge_adapters=False)
    base.load_state_dict({**{k: v for k, v in adapted.state_dict().items() if not k.endswith(("lora_A", "lora_B"))},
                          norm: init[norm]})                   # the base: the run's start, the norm at its init
    archlab.interop.save_hf(base, tmp_path / "base")
    assert main(["convert", "--to-peft", str(tmp_path / "run"), "--out", str(tmp_path / "adapter")]) == 0
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["modules_to_save"] == ["model.norm"]
    hf = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager"),
        tmp_path / "adapter").eval()
    ids = torch.randint(0, 257, (2, 12))
    with torch.no_grad():
        ours, theirs, plain = merged(ids), hf(input_ids=ids, use_cache=False).logits, base.eval()(ids)
    assert float((ours - theirs).abs().max() / theirs.abs().max()) < 1e-4
    assert float((ours - plain).abs().max()) > 1e-4
    # a name that matches no module is refused before anything is written
    with pytest.raises(ConfigError, match=r"lora modules_to_save 'nope' matches no module of this model"):
        train(_cfg(data_dir), TrainConfig(budget=2, **lora(modules_to_save=("nope",))), data_dir,
              tmp_path / "bad", progress=False)
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ConfigError, match=r"train.lora.modules_to_save needs train.lora.r"):
        TrainConfig().with_overrides({"lora.modules_to_save": "final_norm"})
