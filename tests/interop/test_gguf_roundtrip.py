"""GGUF out and in on tiny models: a file archlab writes reads back to the same logits through archlab and through
transformers' own GGUF loader (which undoes llama.cpp's Q/K row order with its own code: an independent check of
ours); the tokenizer and chat template survive the trip; configs llama.cpp cannot express are refused."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import archlab
from archlab.cli import main
from archlab.interop.gguf import GGUFFile, load_gguf
from archlab.interop.gguf.validate import perplexity
from archlab.interop.gguf.write import save_gguf

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")


def _randomized(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """1-D parameters random too, so a (1 + w) norm or a lost bias shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + 1.0)
    return model.eval()


@pytest.mark.parametrize("hf_class, config_class, extra", [
    ("LlamaForCausalLM", "LlamaConfig", {}),
    ("LlamaForCausalLM", "LlamaConfig", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    ("Qwen2ForCausalLM", "Qwen2Config", {}),
], ids=["llama-gqa", "llama-tied-mha", "qwen2-biases"])
def test_hf_model_through_gguf_matches_transformers(tmp_path, tiny_kwargs, hf_class, config_class, extra):
    """HF model -> archlab -> GGUF (f32) -> archlab and transformers' GGUF loader: the HF model's logits."""
    from archlab.interop.hf import load_hf

    torch.manual_seed(0)
    hf_model = _randomized(getattr(transformers, hf_class)(getattr(transformers, config_class)(
        **tiny_kwargs(**extra))))
    hf_model.save_pretrained(tmp_path / "hf")
    save_gguf(load_hf(tmp_path / "hf"), tmp_path / "m.gguf", qtype="f32")
    ids = torch.randint(0, hf_model.config.vocab_size, (2, 16))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    with torch.no_grad():
        want = hf_model(ids).logits
        for got in (load_gguf(tmp_path / "m.gguf")(ids), theirs(ids, use_cache=False).logits):
            assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def _gemma3_config():
    cfg = archlab.presets.tiny("gemma3-27b")
    return dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, query_pre_attn_scalar=None))


@pytest.mark.parametrize("make", [
    lambda: archlab.presets.tiny("llama3-8b"), lambda: archlab.presets.tiny("qwen3-8b"),
    lambda: archlab.presets.tiny("gemma2-9b"), _gemma3_config, lambda: archlab.presets.tiny("gpt2"),
    lambda: archlab.presets.tiny("phi3-mini"),
], ids=["llama", "qwen3", "gemma2", "gemma3", "gpt2", "phi3-as-llama"])
def test_archlab_model_round_trips_exactly_in_f32_and_closely_quantized(tmp_path, make):
    torch.manual_seed(0)
    model = _randomized(archlab.TransformerLM(make()))
    ids = torch.randint(0, model.config.vocab_size, (1, 24))
    with torch.no_grad():
        want = model(ids)
        for qtype, tolerance in (("f32", 0.0), ("f16", 1e-2), ("q8_0", None)):
            got = load_gguf(save_gguf(model, tmp_path / f"{qtype}.gguf", qtype=qtype))(ids)
            rel = float((got - want).abs().max() / want.abs().max())
            if tolerance is not None:
                assert rel <= tolerance, (qtype, rel)
            else:    # q8_0: perplexity within 2%
                assert abs(perplexity(got, ids) / perplexity(want, ids) - 1) < 0.02
    assert GGUFFile(tmp_path / "q8_0.gguf").tensors["blk.0.ffn_down.weight"].type_name in ("Q8_0", "F16")


@pytest.fixture
def run_with_tokenizer(tmp_path, tiny_kwargs):
    """A run converted from a tiny HF Llama with a byte-level BPE tokenizer (merges, specials, a chat template)."""
    tokenizers = pytest.importorskip("tokenizers")
    torch.manual_seed(0)
    model = _randomized(transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny_kwargs(vocab_size=300))))
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": "<|im_start|>",
         "chat_template": template}))
    assert main(["convert", "--from-hf", str(folder), "--out", str(tmp_path / "run")]) == 0
    return tmp_path / "run"


def test_run_to_gguf_and_back_keeps_logits_tokenizer_and_template(tmp_path, run_with_tokenizer, capsys):
    from archlab.runs.model_folder import load_run
    from archlab.tokenizer.chat import apply_chat_template

    file = tmp_path / "out" / "model.gguf"
    assert main(["convert", "--to-gguf", str(run_with_tokenizer), "--out", str(file), "--type", "f32"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "read back by archlab" in out and "read back by transformers" in out
    assert "GGUF tensors" not in captured.err and "it/s" not in captured.err, captured.err   # transformers' bars
    assert main(["convert", "--from-gguf", str(file), "--out", str(tmp_path / "back")]) == 0
    (model, tok), (back, back_tok) = load_run(run_with_tokenizer), load_run(tmp_path / "back")
    text = "hello world, <|im_start|>héllo\n\n  x"
    assert back_tok.encode(text) == tok.encode(text)
    their_tok = transformers.AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    assert their_tok(text, add_special_tokens=False).input_ids == tok.encode(text)
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        assert torch.equal(model(ids), back(ids))
    chat = [{"role": "user", "content": "hello"}]
    assert (apply_chat_template(tmp_path / "back", chat, add_generation_prompt=True)
            == apply_chat_template(run_with_tokenizer, chat, add_generation_prompt=True)
            == their_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))
    generation = json.loads((tmp_path / "back" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.encode("<|im_end|>")[0]


def test_config_llama_cpp_cannot_express_is_refused(tmp_path, capsys):
    """Gemma 3 with a query scale other than llama.cpp's fixed one: refused by name, no file left."""
    from archlab.interop.convert import _write_converted_run

    model = archlab.TransformerLM(archlab.presets.tiny("gemma3-27b"))
    run = tmp_path / "run"
    run.mkdir()
    _write_converted_run(run, model, {"test": True})
    assert main(["convert", "--to-gguf", str(run), "--out", str(tmp_path / "m.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "query_pre_attn_scalar" in err, err
    assert not list(tmp_path.glob("*.gguf*")) and not list(tmp_path.glob(".m.gguf*"))


def test_an_out_ending_in_a_slash_is_refused_not_written_as_a_file_of_that_name(tmp_path, capsys):
    from archlab.interop.convert import _write_converted_run

    run = tmp_path / "run"
    run.mkdir()
    _write_converted_run(run, archlab.TransformerLM(archlab.presets.tiny("llama3-8b")), {"test": True})
    assert main(["convert", "--to-gguf", str(run), "--out", f"{tmp_path / 'exported'}/", "--no-check"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "names a folder; --to-gguf writes one .gguf file" in err, err
    assert not (tmp_path / "exported").exists()


@pytest.mark.parametrize("filled", [False, True])
def test_an_out_that_is_a_folder_is_refused_even_with_overwrite_and_kept(tmp_path, capsys, filled):
    from archlab.interop.convert import _write_converted_run

    run = tmp_path / "run"
    run.mkdir()
    _write_converted_run(run, archlab.TransformerLM(archlab.presets.tiny("llama3-8b")), {"test": True})
    (tmp_path / "exported").mkdir()
    if filled:
        (tmp_path / "exported" / "notes.txt").write_text("mine")
    assert main(["convert", "--to-gguf", str(run), "--out", str(tmp_path / "exported"), "--no-check",
                 "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "names a folder; --to-gguf writes one .gguf file" in err, err
    assert [p.name for p in (tmp_path / "exported").iterdir()] == (["notes.txt"] if filled else [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "run"]


def test_sampling_defaults_travel_and_a_file_without_tokenizer_converts(tmp_path, capsys):
    """generation_config.json's sampling (do_sample, temperature, top_k, top_p) -> llama.cpp's general.sampling.*
    -> the converted run's generation_config.json; a file without a tokenizer gives a run without tokenizer/."""
    model = archlab.TransformerLM(archlab.presets.tiny("llama3-8b"))
    file = save_gguf(model, tmp_path / "m.gguf", qtype="f32",
                     generation={"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9})
    assert GGUFFile(file).metadata["general.sampling.top_k"] == 20
    assert main(["convert", "--from-gguf", str(file), "--out", str(tmp_path / "run")]) == 0
    assert "holds no tokenizer" in capsys.readouterr().err
    generation = json.loads((tmp_path / "run" / "generation_config.json").read_text())
    assert generation == {"_from_model_config": False, "do_sample": True, "temperature": 0.7, "top_k": 20,
                          "top_p": 0.9}
    assert not (tmp_path / "run" / "tokenizer").exists()
