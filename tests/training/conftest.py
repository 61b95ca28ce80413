"""Shared pieces of the fine-tuning tests: a BPE tokenizer with the ChatML template, a small chat .jsonl, and
run folders holding an untrained tiny model (`make_base(folder, cfg)`), so `archlab finetune` has a base."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from finetune_runs import VOCAB, WORDS


@pytest.fixture(scope="module")
def chat_world(tmp_path_factory) -> dict:
    """{"tok": tokenizer folder with ChatML, "data": sft.jsonl of 32 lines}."""
    from archlab.tokenizer import train as train_bpe
    from archlab.tokenizer.chat_builtin import install_chat_template

    root = tmp_path_factory.mktemp("chat")
    rng = random.Random(0)
    (root / "corpus.txt").write_text("\n".join(f"Repeat {w}: {w}." for w in WORDS * 6))
    train_bpe(root / "corpus.txt", 300, ["<|endoftext|>"]).save(root / "tok")
    install_chat_template(root / "tok", "chatml")
    rows = [{"messages": [{"role": "user", "content": f"Repeat {w}"}, {"role": "assistant", "content": w}]}
            for w in (rng.choice(WORDS) for _ in range(32))]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"root": root, "tok": root / "tok", "data": root / "sft.jsonl"}


@pytest.fixture(scope="module")
def make_base(chat_world):
    """make_base(folder, cfg=None, seed=0) -> a run folder with an untrained model of `cfg` (default: a 2-layer
    decoder of the chat tokenizer's vocabulary), its weights drawn from `seed`, and the chat tokenizer."""
    from archlab.config import ModelConfig
    from archlab.models import build_model
    from archlab.runs.checkpoint import save_checkpoint

    def make(folder: Path, cfg: ModelConfig | None = None, seed: int = 0) -> Path:
        cfg = cfg or ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, max_seq_len=64,
                                 attention={"n_heads": 4})
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text(yaml.safe_dump({"model": cfg.to_dict()}))
        state = build_model(cfg).state_dict()         # the config's own init: the same for every seed
        if seed:
            gen = torch.Generator().manual_seed(seed)
            state = {k: v + 0.02 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
                     for k, v in state.items()}
        save_checkpoint(folder / "checkpoints", 1, state, {})
        shutil.copytree(chat_world["tok"], folder / "tokenizer")
        return folder

    return make
