"""`convert --to-hf` writes a folder transformers uses as is: tokenizer files with the end-of-text token,
generation config, readable files; one-shot outputs are never overwritten without --overwrite."""
from __future__ import annotations

import os
import stat

import pytest
import torch

from archlab.cli import main
from archlab.config import ModelConfig
from archlab.models.decoder import TransformerLM
from archlab.runs.checkpoint import CHECKPOINT_DIR, save_checkpoint
from archlab.runs.model_folder import write_run_config

transformers = pytest.importorskip("transformers")
EOT = "<|endoftext|>"


def _chain_run(tmp_path):
    """A run folder whose model greedily continues 'a' -> 'b' -> 'c' -> <|endoftext|>: blocks whose
    residual outputs are zero pass the embedding through, and the head maps each token's normalized
    embedding to its successor."""
    from archlab.tokenizer import Tokenizer, train_bpe

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("abc def ghi " * 50)
    vocab, merges = train_bpe(str(corpus), 280, [EOT])
    tok = Tokenizer(vocab, merges, [EOT])
    a, b, c = (tok.encode(ch)[0] for ch in "abc")
    eot = tok.encode(EOT)[0]
    cfg = ModelConfig(vocab_size=len(vocab), d_model=64, n_layers=2, max_seq_len=64, attention={"n_heads": 4},
                      tie_embeddings=False)
    model = TransformerLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")) or ".mlp." in name and "down" in name:
                p.zero_()
        emb = model.embed.weight
        unit = emb / emb.norm(dim=-1, keepdim=True)
        model.lm_head.weight.zero_()
        for src, dst in ((a, b), (b, c), (c, eot)):
            model.lm_head.weight[dst] = 20 * unit[src]
    run = tmp_path / "run"
    run.mkdir()
    write_run_config(run, model=cfg.to_dict(), train={"seq_len": 64}, data={})
    save_checkpoint(run / CHECKPOINT_DIR, 1, model.state_dict(), {"step": 1})
    tok.save(run / "tokenizer")
    return run, tok, (a, b, c, eot)


def test_export_loads_in_transformers_and_generation_stops_at_eos(tmp_path):
    run, tok, (a, b, c, eot) = _chain_run(tmp_path)
    out = tmp_path / "exported"
    assert main(["convert", "--to-hf", str(run), "--out", str(out)]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                 "config.json", "model.safetensors"):
        assert (out / name).is_file(), name
        assert stat.S_IMODE((out / name).stat().st_mode) & 0o044 == 0o044, name    # readable by others
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.eos_token == EOT and hf_tok.eos_token_id == eot
    assert hf_tok("abc")["input_ids"] == tok.encode("abc")
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[a]])
    gen = model.generate(ids, max_new_tokens=20, do_sample=False)
    assert gen[0].tolist() == [a, b, c, eot]                       # stopped at EOS, not after 20 tokens
    assert hf_tok.decode(gen[0], skip_special_tokens=True) == "abc"


def test_to_hf_refuses_a_non_empty_folder_and_overwrite_replaces_it_cleanly(tmp_path, capsys):
    run, _, _ = _chain_run(tmp_path)
    out = tmp_path / "exported"
    out.mkdir()
    (out / "model.safetensors.index.json").write_text("{}")         # an earlier sharded export
    (out / "notes.txt").write_text("mine")
    assert main(["convert", "--to-hf", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--overwrite" in err and (out / "notes.txt").read_text() == "mine"
    assert main(["convert", "--to-hf", str(run), "--out", str(out), "--overwrite"]) == 0
    assert not (out / "model.safetensors.index.json").exists() and not (out / "notes.txt").exists()
    assert not list(tmp_path.glob(".exported.*"))


def test_from_hf_into_an_existing_run_is_refused_and_nothing_changes(tmp_path, capsys):
    run, _, _ = _chain_run(tmp_path)
    exported = tmp_path / "exported"
    assert main(["convert", "--to-hf", str(run), "--out", str(exported)]) == 0
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert main(["convert", "--from-hf", str(exported), "--out", str(run)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_failed_overwrite_leaves_the_old_folder_intact(tmp_path, monkeypatch):
    run, _, _ = _chain_run(tmp_path)
    out = tmp_path / "exported"
    assert main(["convert", "--to-hf", str(run), "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    import archlab.interop.hf as hf

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device", "model.safetensors")
    monkeypatch.setattr(hf, "write_tokenizer_files", broken)       # fails after the weights are written
    assert main(["convert", "--to-hf", str(run), "--out", str(out), "--overwrite"]) == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not list(tmp_path.glob(".exported.*"))


def test_converted_run_records_its_context_length(tmp_path):
    import yaml
    run, _, _ = _chain_run(tmp_path)
    exported = tmp_path / "exported"
    assert main(["convert", "--to-hf", str(run), "--out", str(exported)]) == 0
    assert main(["convert", "--from-hf", str(exported), "--out", str(tmp_path / "back")]) == 0
    cfg = yaml.safe_load((tmp_path / "back" / "config.yaml").read_text())
    assert cfg["train"]["seq_len"] == 64
    assert os.path.isfile(tmp_path / "back" / "tokenizer" / "tokenizer.json")
