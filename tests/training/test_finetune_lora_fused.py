"""`archlab finetune --lora-r` on the families whose attention holds q, k and v in one HF projection (GPT-2's
c_attn, GPT-NeoX's query_key_value, BLOOM's query_key_value): the LoRA checks run on a meta model, where the
PEFT row map used to compare meta tensors and crash every such run before it started. The run trains, and its
`convert --to-peft` adapter gives PEFT the run's logits on the base's HF folder."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import yaml

import archlab
from archlab.cli import main
from archlab.models import build_model
from archlab.runs.checkpoint import save_checkpoint
from archlab.runs.model_folder import load_run
from archlab.tokenizer import train as train_bpe
from archlab.tokenizer.chat_builtin import install_chat_template

WORDS = ["cat", "dog", "bird", "fish", "tree", "rock", "star", "moon"]
FAMILIES_OF = {"gpt2": "gpt2", "gpt-neox-20b": "gpt_neox", "bloom-176b": "bloom"}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fused")
    rng = random.Random(0)
    (root / "corpus.txt").write_text("\n".join(f"Repeat {w}: {w}." for w in WORDS * 6))
    train_bpe(root / "corpus.txt", 300, ["<|endoftext|>"]).save(root / "tok")
    install_chat_template(root / "tok", "chatml")
    rows = [{"messages": [{"role": "user", "content": f"Repeat {w}"}, {"role": "assistant", "content": w}]}
            for w in (rng.choice(WORDS) for _ in range(32))]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"root": root, "tok": root / "tok", "data": root / "sft.jsonl"}


def _tiny(preset: str, vocab_size: int = 256) -> archlab.ModelConfig:
    """`preset` test-sized and still its HF family (BLOOM's d_ff is 4 d_model), so the fused row map runs."""
    from archlab.interop.families import FAMILIES, infer_family

    cfg = archlab.presets.tiny(preset, d_model=32, vocab_size=vocab_size).with_overrides({"mlp.d_ff": 128})
    assert infer_family(cfg) is FAMILIES.get(FAMILIES_OF[preset])
    return cfg


def _base_run(folder: Path, tok: Path, preset: str) -> Path:
    """A run folder holding an untrained tiny model of `preset`'s architecture and the tokenizer `tok`."""
    cfg = _tiny(preset, vocab_size=302)                                      # 300 + the two ChatML tokens
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump({"model": cfg.to_dict()}))
    torch.manual_seed(0)
    save_checkpoint(folder / "checkpoints", 1, build_model(cfg).state_dict(), {})
    shutil.copytree(tok, folder / "tokenizer")
    return folder


def _finetune(world: dict, base: Path, out: Path) -> int:
    return main(["finetune", str(base), "--data", str(world["data"]), "--out", str(out), "--lora-r", "4",
                 "--lora-targets", "q,k,v,o", "--no-progress", "--set", "train.budget=3", "--set", "train.seq_len=32",
                 "--set", "train.batch_size=4", "--set", "train.lr=1e-2", "--set", "train.eval_every=0",
                 "--set", "train.sample_every=-1", "--set", "train.memory_check=false"])


@pytest.mark.parametrize("preset", ["gpt2", "gpt-neox-20b", "bloom-176b"])
def test_lora_finetune_on_a_fused_qkv_family_trains(world, tmp_path, preset):
    base = _base_run(tmp_path / "base", world["tok"], preset)
    assert _finetune(world, base, tmp_path / "run") == 0
    adapted, _ = load_run(tmp_path / "run", merge_adapters=False)
    trained = {k: v for k, v in adapted.state_dict().items() if k.endswith("lora_B")}
    assert {k.split(".")[-2] for k in trained} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert all(v.abs().max() > 0 for v in trained.values())          # B starts at zero: it trained


@pytest.mark.slow
def test_lora_finetune_of_gpt2_exports_an_adapter_peft_computes(world, tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base = _base_run(tmp_path / "base", world["tok"], "gpt2")
    assert _finetune(world, base, tmp_path / "run") == 0
    plain, _ = load_run(base)
    archlab.interop.save_hf(plain, tmp_path / "base-hf")
    assert main(["convert", "--to-peft", str(tmp_path / "run"), "--out", str(tmp_path / "adapter")]) == 0
    merged, _ = load_run(tmp_path / "run")
    hf = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base-hf", attn_implementation="eager"),
        tmp_path / "adapter").eval()
    ids = torch.randint(0, 302, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs, before = merged(ids), hf(input_ids=ids, use_cache=False).logits, plain.eval()(ids)
    assert float((ours - theirs).abs().max() / theirs.abs().max()) < 1e-4
    assert float((ours - before).abs().max()) > 1e-4                  # the adapters changed the model


@pytest.mark.parametrize("preset", list(FAMILIES_OF))
def test_lora_checks_and_memory_estimate_on_the_meta_model_of_a_fused_family(preset):
    """What `train --init-from ... --set train.lora.r=8` and the memory plan run before any write."""
    from archlab.nn.lora import LoRAConfig
    from archlab.training.config import TrainConfig
    from archlab.training.lora import check, scale_memory

    cfg, train_cfg = _tiny(preset), TrainConfig(lora=LoRAConfig(r=8, targets=("c_attn",) if preset == "gpt2"
                                                                               else ("query_key_value",)))
    check(cfg, train_cfg)
    parts = scale_memory({"weights": 1000, "grads": 1000, "optimizer": 2000}, cfg, train_cfg)
    model = build_model(cfg)
    d, n = cfg.d_model, cfg.n_layers
    lora = n * 3 * 8 * (d + d)                                     # q, k, v per layer: A (8, d), B (d, 8)
    share = lora / (lora + sum(p.numel() for p in model.parameters()))
    assert parts == {"weights": 1000, "grads": int(1000 * share), "optimizer": int(2000 * share)}
