"""`convert --to-hf` keeps a tokenizer's special tokens and post-processing: an HF folder converted to a run folder
and back loads in transformers' AutoTokenizer with the same ids and the same special tokens (BERT's WordPiece with
[CLS] $A [SEP], T5's Unigram with </s> appended and <extra_id_N> sentinels, BART's byte-level BPE with RoBERTa's
<s> $A </s>), and archlab's fill-mask / generate --source encode alike on all three folders; a tokenizer archlab
trained exports the roles of its own special tokens. Tokenizers are built here with the `tokenizers` library."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from archlab.cli import main
from archlab.cli.generate import _encode_source
from archlab.eval.fill_mask import encode_for_model
from archlab.runs.model_folder import load_masked_lm, load_model_and_tokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
from test_fill_mask import bert_wordpiece  # noqa: E402
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors  # noqa: E402

WORDS = "hello world the cat sat on a mat while seven dogs quietly judge".split()
TEXT = "hello world"
ROLE_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _bert():
    tok = bert_wordpiece(WORDS + ["##s", "."])
    roles = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "mask_token": "[MASK]",
             "unk_token": "[UNK]", "do_lower_case": True}
    model = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32))
    return tok, roles, "BertTokenizer", model


def _t5():
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += [(w, -1.0 - i * 0.01) for i, w in enumerate(letters + ["▁" + c for c in letters] + ["▁", "▁hello"])]
    sentinels = [f"<extra_id_{i}>" for i in range(4)]
    tok = Tokenizer(models.Unigram(pieces + [(s, 0.0) for s in reversed(sentinels)], unk_id=2, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    tok.add_special_tokens(["<pad>", "</s>", "<unk>"] + sentinels)
    roles = {"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>", "additional_special_tokens": sentinels,
             "extra_ids": len(sentinels)}
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=tok.get_vocab_size(), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    return tok, roles, "T5Tokenizer", model


def _bart():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(WORDS)] * 20, tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    roles = {"bos_token": "<s>", "eos_token": "</s>", "cls_token": "<s>", "sep_token": "</s>", "pad_token": "<pad>",
             "unk_token": "<unk>", "mask_token": "<mask>"}
    model = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=tok.get_vocab_size(), d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2))
    return tok, roles, "BartTokenizer", model


def _hf_folder(folder: Path, kind: str, layout: str) -> Path:
    """A tiny random model with its tokenizer: tokenizer.json plus either the classic side files (the family's
    tokenizer_class, tokenizer_config.json and special_tokens_map.json) or what transformers 5 writes itself."""
    torch.manual_seed(0)
    tok, roles, tokenizer_class, model = {"bert": _bert, "t5": _t5, "bart": _bart}[kind]()
    folder.mkdir(parents=True)
    model.eval().save_pretrained(folder)
    if layout == "classic":
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": tokenizer_class,
                                                                  "model_max_length": 32, **roles}))
        (folder / "special_tokens_map.json").write_text(json.dumps({k: v for k, v in roles.items()
                                                                    if k.endswith("tokens") or k.endswith("token")}))
    else:
        named = {k: v for k, v in roles.items() if k.endswith("_token") or k == "additional_special_tokens"}
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **named).save_pretrained(folder)
    return folder


def _round_trip(tmp_path: Path, source: Path) -> tuple[Path, Path]:
    run, out = tmp_path / "run", tmp_path / "out"
    assert main(["convert", "--from-hf", str(source), "--out", str(run)]) == 0
    assert (run / "tokenizer" / "tokenizer.json").is_file()
    assert main(["convert", "--to-hf", str(run), "--out", str(out)]) == 0
    return run, out


def _specials(tok) -> dict:
    """What transformers' tokenizer says its special tokens are: each role (token and id), the extra ones, all."""
    roles = {name: (getattr(tok, name, None), getattr(tok, f"{name}_id", None)) for name in ROLE_NAMES}
    extra = getattr(tok, "additional_special_tokens", None) or getattr(tok, "extra_special_tokens", None) or []
    return {**roles, "extra": list(extra), "all": sorted(zip(tok.all_special_tokens, tok.all_special_ids))}


@pytest.mark.parametrize("kind, layout", [("bert", "classic"), ("bert", "transformers5"), ("t5", "classic"),
                                          ("bart", "classic")])
def test_an_hf_tokenizer_keeps_its_ids_and_special_tokens_through_convert(tmp_path, kind, layout):
    source = _hf_folder(tmp_path / "source", kind, layout)
    run, out = _round_trip(tmp_path, source)
    theirs = transformers.AutoTokenizer.from_pretrained(source)
    ours = transformers.AutoTokenizer.from_pretrained(out)
    ids = theirs(TEXT)["input_ids"]
    wrapped = {"bert": ("[CLS]", "[SEP]"), "t5": (None, "</s>"), "bart": ("<s>", "</s>")}[kind]
    assert wrapped == (theirs.convert_ids_to_tokens(ids[0]) if wrapped[0] else None,
                       theirs.convert_ids_to_tokens(ids[-1]))           # the post-processor wraps the text
    assert ours(TEXT)["input_ids"] == ids
    assert _specials(ours) == _specials(theirs)
    if kind == "t5":
        assert _specials(ours)["extra"] == [f"<extra_id_{i}>" for i in range(4)]
    # archlab reads the three folders alike: fill-mask for the encoder, generate --source for the others
    if kind == "bert":
        text = f"{TEXT} [MASK]"
        seen = [encode_for_model(load_masked_lm(folder)[1], text) for folder in (source, run, out)]
        assert seen[0] == seen[1] == seen[2] and seen[0][0] == theirs(text)["input_ids"]
    else:
        tokenizers_ = [load_model_and_tokenizer(f, archs=("encoder_decoder",))[1] for f in (source, run, out)]
        seen = [_encode_source(tok, str(f), TEXT) for tok, f in zip(tokenizers_, (source, run, out))]
        assert seen == [ids, ids, ids] and len({tok.eot_id for tok in tokenizers_}) == 1


@pytest.mark.parametrize("kind, specials, expected", [
    ("wordpiece", ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
     {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"}),
    ("bpe", ["<|endoftext|>", "[MASK]", "<|tool|>"],
     {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "mask_token": "[MASK]",
      "extra": ["<|tool|>"]}),
])
def test_an_archlab_tokenizer_exports_the_roles_of_its_own_special_tokens(tmp_path, kind, specials, expected):
    from archlab.tokenizer import train

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(WORDS * 30))
    tok = train([corpus], 540 if kind == "wordpiece" else 300, specials, kind=kind)   # wordpiece: 517 base tokens
    source = tmp_path / "source"          # an HF encoder without tokenizer files: the run's tokenizer is archlab's
    torch.manual_seed(0)
    transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32)).save_pretrained(source)
    run, out = tmp_path / "run", tmp_path / "out"
    assert main(["convert", "--from-hf", str(source), "--out", str(run)]) == 0
    tok.save(run / "tokenizer")
    assert main(["convert", "--to-hf", str(run), "--out", str(out)]) == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    got = _specials(hf_tok)
    assert {k: got[k][0] for k in ROLE_NAMES if got[k][0] is not None} == {k: v for k, v in expected.items()
                                                                          if k != "extra"}
    assert got["extra"] == expected.get("extra", [])
    assert got["all"] == sorted((s, tok.special_to_id[s]) for s in specials)
    assert hf_tok(TEXT)["input_ids"] == tok.encode(TEXT)                # archlab's tokenizers wrap nothing
    text = f"{TEXT} [MASK]"
    assert encode_for_model(load_masked_lm(out)[1], text) == encode_for_model(load_masked_lm(run)[1], text)
    generation = json.loads((out / "generation_config.json").read_text())
    pad = tok.special_to_id["[PAD]" if "[PAD]" in specials else "<|endoftext|>"]
    assert generation.get("pad_token_id") == pad
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == 0     # BERT's, the family's own
