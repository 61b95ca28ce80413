"""SentencePiece-style tokenizer.json files (Metaspace, byte fallback, normalizers) load through the
`tokenizers` library (HFTokenizer) and encode exactly as that library does."""
import json
import sys

import pytest

from archlab.tokenizer import HFTokenizer, Tokenizer, load

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a little tokenizer that wanted to read every file.",
    "Sentence pieces mark the start of a word with a lower one eighth block.",
    "Numbers like 12345 and 2024 appear, as do commas, periods and quotes.",
] * 20
TEXTS = [
    "The quick brown fox",
    "  leading spaces and   runs of spaces  ",
    "unseen wørds ✓ and émojis 🙂 fall back to bytes",
    "line one\nline two\n\ttabbed",
    "</s> a special token in the middle </s>",
    "",
]


def _unigram(folder):
    """A Unigram model with a Metaspace pre-tokenizer and decoder (Gemma/T5 style), trained here."""
    tok = tokenizers.Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"],
                                      unk_token="<unk>", show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return tok


def _bpe_byte_fallback(folder):
    """A BPE with byte fallback, a Prepend/Replace normalizer and no pre-tokenizer (Llama 2 style)."""
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator([s.replace(" ", "▁") for s in CORPUS], trainer)
    data = json.loads(tok.to_str())              # byte pieces <0x00>..<0xFF> as ordinary vocabulary
    vocab = data["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))


BUILDERS = {"unigram_metaspace": _unigram, "bpe_byte_fallback": _bpe_byte_fallback}


@pytest.fixture(params=sorted(BUILDERS))
def pair(request, tmp_path):
    hf = BUILDERS[request.param](tmp_path / "tok")
    return hf, load(tmp_path / "tok"), tmp_path


def test_native_readers_reject_these_files(pair):
    _, _, tmp_path = pair
    with pytest.raises(ValueError):
        load(tmp_path / "tok", hf_fallback=False)


def test_ids_match_the_tokenizers_library(pair):
    hf, ours, _ = pair
    assert isinstance(ours, HFTokenizer)
    assert ours.vocab_size == hf.get_vocab_size() and ours.vocab_size > 50
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False).ids, text
        assert ours(text) == ids


def test_special_tokens_and_lookups(pair):
    hf, ours, _ = pair
    assert ours.special_tokens == ["<unk>", "<s>", "</s>"]
    assert ours.eot_id == hf.token_to_id("</s>") == ours.special_token_id("</s>")
    assert ours.encode("a </s> b").count(ours.eot_id) == 1      # specials in text map to their id
    assert ours.token_to_id("</s>") == ours.eot_id and ours.token_to_id(b"</s>") == ours.eot_id
    assert ours.token_to_id("surely not a piece ###") is None
    piece = ours.id_to_token(ours.encode("quick")[0])
    assert ours.token_to_id(piece) == ours.encode("quick")[0]
    with pytest.raises(IndexError):
        ours.id_to_token(10**6)


def test_decode_round_trip(pair):
    hf, ours, _ = pair
    for text in ["The quick brown fox jumps", "unseen wørds ✓ 🙂", "a line\nanother line"]:
        ids = ours.encode(text)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False)
    # byte fallback loses nothing; Unigram maps unseen characters to <unk>
    if ours.token_to_id("<0x41>") is not None:
        text = "unseen wørds ✓ 🙂 and\nnewlines"
        assert ours.decode(ours.encode(text)) == text
    assert ours.decode([ours.eot_id]) == "</s>"                 # specials are kept, as BaseTokenizer does
    assert ours.decode([ours.eot_id], skip_special_tokens=True) == ""


def test_save_load_round_trip(pair, tmp_path):
    _, ours, _ = pair
    (tmp_path / "tok" / "tokenizer_config.json").write_text('{"eos_token": "<s>"}')
    with_config = load(tmp_path / "tok")
    assert with_config.eot_id == with_config.token_to_id("<s>") != ours.eot_id   # config's eos wins
    with_config.save(tmp_path / "again")
    again = load(tmp_path / "again")
    assert isinstance(again, HFTokenizer) and again.vocab_size == ours.vocab_size
    assert again.eot_id == with_config.eot_id
    for text in TEXTS:
        assert again.encode(text) == ours.encode(text)


def test_encode_iterable_equals_encode(pair):
    _, ours, _ = pair
    text = "".join(f"{s} {i}\n" for i, s in enumerate(CORPUS)) + TEXTS[2] + " </s> tail"
    chunks = [text[i:i + 7] for i in range(0, len(text), 7)]
    expected = ours.encode(text)
    assert list(ours.encode_iterable(chunks, buffer_chars=256)) == expected
    assert list(ours.encode_iterable(iter([text]), buffer_chars=64)) == expected
    # lazy: most ids come out before the input is used up, so the buffer stays small
    pulled = []

    def source():
        for i, chunk in enumerate(chunks):
            pulled.append(i)
            yield chunk

    stream = ours.encode_iterable(source(), buffer_chars=256)
    first_half = [next(stream) for _ in range(len(expected) // 2)]
    assert len(pulled) < 0.75 * len(chunks) and first_half + list(stream) == expected


def test_missing_tokenizers_gives_a_clear_error(pair, monkeypatch):
    _, _, tmp_path = pair
    monkeypatch.setitem(sys.modules, "tokenizers", None)        # `import tokenizers` now raises
    with pytest.raises(ValueError, match=r"archlab cannot read .*tokenizer.json.*archlab\[hf\]"):
        load(tmp_path / "tok")


def test_native_files_still_load_natively(tmp_path):
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    tok.save(tmp_path)
    assert type(load(tmp_path)) is Tokenizer


def test_unparseable_file_names_both_readers(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "Nonsense"}, "pre_tokenizer": null}')
    with pytest.raises(ValueError, match="neither archlab .* nor `tokenizers`"):
        load(tmp_path)


def test_continuation_keeps_the_space_metaspace_drops(tmp_path):
    """Decoded alone, a continuation loses its leading "▁"; generate decodes it after the prompt."""
    from archlab.cli.generate import _continuation

    _unigram(tmp_path / "tok")
    tok = load(tmp_path / "tok")
    prompt, new = tok.encode("The quick"), tok.encode(" brown fox")
    assert tok.decode(new) == "brown fox"
    assert _continuation(tok, prompt, new) == " brown fox"


@pytest.fixture
def hf_llama(tmp_path):
    """A tiny random Llama HF folder whose tokenizer.json is SentencePiece-style (Unigram + Metaspace)."""
    import torch
    transformers = pytest.importorskip("transformers")
    hf_tok = _unigram(tmp_path / "hf")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=hf_tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, eos_token_id=hf_tok.token_to_id("</s>"))
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf", safe_serialization=True)
    return tmp_path / "hf", hf_tok


def test_generate_and_diagnose_read_an_hf_folder_with_such_a_tokenizer(hf_llama, capsys):
    import torch

    import archlab
    from archlab.cli import main
    from archlab.cli.generate import load_model_and_tokenizer
    from archlab.eval import diagnostics

    folder, hf_tok = hf_llama
    model, tok = load_model_and_tokenizer(folder)
    assert isinstance(tok, HFTokenizer) and tok.eot_id == hf_tok.token_to_id("</s>")
    prompt = "The quick brown fox"
    ids = tok.encode(prompt)
    out = archlab.generate(model, ids, max_new_tokens=8, eos_token_id=tok.eot_id).tolist()
    new = out[len(ids):out.index(tok.eot_id)] if tok.eot_id in out[len(ids):] else out[len(ids):]
    assert main(["generate", str(folder), "--prompt", prompt, "--max-new-tokens", "8"]) == 0
    # the printed text is the prompt followed by what the new ids add to it, spaces included
    printed = capsys.readouterr().out
    assert printed == hf_tok.decode(ids + new, skip_special_tokens=False) + "\n"

    d_model, d_tok = diagnostics.load_model_and_tokenizer(folder)
    d_ids, pieces = diagnostics.encode_text(d_tok, prompt, 16)
    assert d_ids == hf_tok.encode(prompt, add_special_tokens=False).ids and len(pieces) == len(d_ids)
    result = diagnostics.diagnose(d_model, torch.tensor([d_ids]), pieces)
    assert result["summary"]["n_tokens"] == len(d_ids)
