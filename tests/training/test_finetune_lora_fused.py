"""`archlab finetune --lora-r` on the families whose attention holds q, k and v in one HF projection (GPT-2's
c_attn, GPT-NeoX's query_key_value, BLOOM's query_key_value): the LoRA checks run on a meta model, where the
PEFT row map used to compare meta tensors and crash every such run before it started. The run trains, and its
`convert --to-peft` adapter gives PEFT the run's logits on the base's HF folder."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from finetune_runs import VOCAB, finetune_argv

import archlab
from archlab.cli import main
from archlab.models import build_model
from archlab.runs.model_folder import load_run

FAMILIES_OF = {"gpt2": "gpt2", "gpt-neox-20b": "gpt_neox", "bloom-176b": "bloom"}


def _tiny(preset: str, vocab_size: int = 256) -> archlab.ModelConfig:
    """`preset` test-sized and still its HF family (BLOOM's d_ff is 4 d_model), so the fused row map runs."""
    from archlab.interop.families import FAMILIES, infer_family

    cfg = archlab.presets.tiny(preset, d_model=32, vocab_size=vocab_size).with_overrides({"mlp.d_ff": 128})
    assert infer_family(cfg) is FAMILIES.get(FAMILIES_OF[preset])
    return cfg


def _finetune(world: dict, base: Path, out: Path) -> int:
    return main(finetune_argv(base, world["data"], out, "--lora-r", "4", "--lora-targets", "q,k,v,o"))


@pytest.mark.parametrize("preset", ["gpt2", "gpt-neox-20b", "bloom-176b"])
def test_lora_finetune_on_a_fused_qkv_family_trains(chat_world, make_base, tmp_path, preset):
    base = make_base(tmp_path / "base", _tiny(preset, VOCAB))
    assert _finetune(chat_world, base, tmp_path / "run") == 0
    adapted, _ = load_run(tmp_path / "run", merge_adapters=False)
    trained = {k: v for k, v in adapted.state_dict().items() if k.endswith("lora_B")}
    assert {k.split(".")[-2] for k in trained} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert all(v.abs().max() > 0 for v in trained.values())          # B starts at zero: it trained


@pytest.mark.slow
def test_lora_finetune_of_gpt2_exports_an_adapter_peft_computes(chat_world, make_base, tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base = make_base(tmp_path / "base", _tiny("gpt2", VOCAB))
    assert _finetune(chat_world, base, tmp_path / "run") == 0
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
