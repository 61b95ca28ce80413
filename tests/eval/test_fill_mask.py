"""`archlab fill-mask`: an encoder's top-k tokens at each mask token, from a run folder or an HF folder.

The output: per mask the top-k pieces best first with probabilities (a softmax over the vocabulary, so they
sum to at most 1) and the text with the top-1 filled in; on an HF BERT / RoBERTa folder the text is wrapped by
the tokenizer's post-processor and the top-k equal the argsort of transformers' own logits at the mask."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_train_mlm import FAST, _docs, encoder

from archlab.cli import main
from archlab.config import ModelConfig
from archlab.data.prepare import prepare
from archlab.errors import UserError
from archlab.eval.fill_mask import encode_for_model, fill_mask
from archlab.models.encoder import EncoderLM
from archlab.runs.checkpoint import save_checkpoint
from archlab.runs.model_folder import load_masked_lm, load_run, write_run_config
from archlab.tokenizer import HFTokenizer
from archlab.tokenizer import train as train_tokenizer
from archlab.training.trainer import TrainConfig, train

TEXT = "the quick brown [MASK] jumps over a lazy dog while seven [MASK] quietly judge"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """An encoder trained briefly on the cyclic word corpus, and a decoder run on the same data."""
    root = tmp_path_factory.mktemp("fill")
    (root / "corpus.txt").write_text("\n".join(_docs()))
    tok = train_tokenizer([root / "corpus.txt"], 300, ["<|endoftext|>", "[MASK]"], kind="bpe")
    prepare(_docs(), tok, root / "data", num_workers=0, progress=False)
    train(encoder(), TrainConfig(budget=40, **{**FAST, "checkpoint_every": 40}), root / "data", root / "enc",
          progress=False)
    decoder = ModelConfig(vocab_size=300, d_model=32, n_layers=2, max_seq_len=64, attention={"n_heads": 4})
    train(decoder, TrainConfig(budget=1, **FAST), root / "data", root / "dec", progress=False)
    return {"enc": root / "enc", "dec": root / "dec", "root": root}


def _cli(argv, capsys) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = int(exc.code or 0)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_table_lists_top_k_per_mask_and_the_filled_text(runs, capsys):
    rc, out, err = _cli(["fill-mask", str(runs["enc"]), TEXT, "--top-k", "3"], capsys)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == f"text:   {TEXT}"
    assert lines[1].startswith("mask 1 of 2 (token ") and lines[5].startswith("mask 2 of 2 (token ")
    for rank_line in lines[2:5] + lines[6:9]:
        rank, piece, prob, token_id = rank_line.split()[0], rank_line.split()[1], rank_line.split()[-3], \
            rank_line.split()[-1]
        assert rank.rstrip(".").isdigit() and piece[0] in "'\"" and prob.endswith("%") and token_id.endswith(")")
    assert lines[9].startswith("filled: the quick brown") and "[MASK]" not in lines[9] and len(lines) == 10


def test_json_top_k_are_the_models_best_tokens_in_order(runs, capsys):
    rc, out, err = _cli(["fill-mask", str(runs["enc"]), TEXT, "--top-k", "7", "--json"], capsys)
    assert rc == 0, err
    result = json.loads(out)
    model, tok = load_run(runs["enc"])
    ids, body = encode_for_model(tok, TEXT, "[MASK]")
    assert body == slice(0, len(ids))                       # archlab's tokenizers add no special tokens
    assert ids == tok.encode(TEXT.replace(" [MASK]", "[MASK]"))   # the space before a mask goes with it
    mask_id = tok.token_to_id("[MASK]")
    assert [m["position"] for m in result["masks"]] == [i for i, t in enumerate(ids) if t == mask_id]
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([ids]))[0].float(), dim=-1)
    filled = list(ids)
    for mask in result["masks"]:
        preds = mask["predictions"]
        p = [x["probability"] for x in preds]
        assert len(preds) == 7 and p == sorted(p, reverse=True) and 0 < sum(p) <= 1 + 1e-6
        expected = probs[mask["position"]].topk(7)
        assert [x["token_id"] for x in preds] == expected.indices.tolist()
        assert p == pytest.approx(expected.values.tolist(), rel=1e-5)
        assert all(x["token"] == tok.decode([x["token_id"]]) for x in preds)
        filled[mask["position"]] = preds[0]["token_id"]
    assert result["filled"] == tok.decode(filled) and result["text"] == TEXT
    # the library call is the same computation
    direct = fill_mask(model, tok, TEXT, top_k=7)
    assert direct.to_dict() == result


def test_top_k_is_capped_at_the_tokenizers_vocabulary(runs):
    model, tok = load_run(runs["enc"])
    result = fill_mask(model, tok, "the [MASK]", top_k=10_000)
    preds = result.masks[0].predictions
    assert len(preds) == tok.vocab_size and len({p.token_id for p in preds}) == len(preds)
    assert sum(p.probability for p in preds) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("case", [
    ("decoder run", "{dec}", TEXT, "is a decoder-only model; fill-mask needs an encoder (arch=encoder)"),
    ("no mask", "{enc}", "the quick brown fox", "holds no mask token"),
    ("other spelling", "{enc}", "the quick brown <mask>", "<mask> is not this tokenizer's mask token"),
    ("past positions", "{enc}", "[MASK] " + "the quick brown fox " * 30, "past the model's max_seq_len=64"),
    ("missing folder", "{root}/nothing", TEXT, "does not exist"),
], ids=lambda c: c[0])
def test_mistakes_are_one_line(runs, capsys, case):
    _, folder, text, expected = case
    rc, out, err = _cli(["fill-mask", folder.format(**{k: str(v) for k, v in runs.items()}), text], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("archlab fill-mask: error: ") and expected in lines[0], lines[0]
    assert out == ""


def test_a_tokenizer_without_a_mask_token_is_one_line(runs, tmp_path, capsys):
    """A run folder built and saved by hand: an encoder whose tokenizer has no [MASK]."""
    root = runs["root"]
    tok = train_tokenizer([root / "corpus.txt"], 300, ["<|endoftext|>"], kind="bpe")
    run = tmp_path / "run"
    cfg = encoder(vocab_size=tok.vocab_size)
    run.mkdir()
    write_run_config(run, cfg.to_dict(), {}, {})
    save_checkpoint(run / "checkpoints", 1, EncoderLM(cfg).state_dict(), {"step": 1})
    tok.save(run / "tokenizer")
    with pytest.raises(UserError, match=r"no mask token \(\[MASK\] or <mask>\)"):
        fill_mask(*load_run(run), TEXT)
    rc, _, err = _cli(["fill-mask", str(run), TEXT], capsys)
    assert rc == 2 and "the tokenizer has no mask token" in err and len(err.strip().splitlines()) == 1


# ---- HF folders: a tiny random BertForMaskedLM / RobertaForMaskedLM and a tokenizer.json -------------------
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def bert_wordpiece(words: list[str]):
    """A `tokenizers` WordPiece over BERT_SPECIALS + `words` (ids in that order), lowercasing, [CLS] $A [SEP]."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(BERT_SPECIALS + words)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(BERT_SPECIALS)
    return tok


def _bert_folder(folder: Path) -> None:
    transformers = pytest.importorskip("transformers")
    words = sorted({w for doc in _docs(5, 30) for w in doc.split()}) + ["##s", "##ing", "##ed", ".", ","]
    tok = bert_wordpiece(words)
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=32,
                                  initializer_range=0.2)
    transformers.BertForMaskedLM(cfg).eval().save_pretrained(folder)


def _roberta_folder(folder: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_docs(5, 60), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    torch.manual_seed(0)
    cfg = transformers.RobertaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=34,
                                     pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1,
                                     initializer_range=0.2)
    transformers.RobertaForMaskedLM(cfg).eval().save_pretrained(folder)


@pytest.mark.parametrize("family, text, wrapped", [
    ("bert", "The quick brown [MASK] jumps over the lazy [MASK].", ("[CLS]", "[SEP]")),
    ("roberta", "the quick brown <mask> jumps over a lazy <mask>", ("<s>", "</s>")),
])
def test_an_hf_folder_predicts_what_transformers_logits_rank(tmp_path, capsys, family, text, wrapped):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / family
    (_bert_folder if family == "bert" else _roberta_folder)(folder)
    model, tok = load_masked_lm(folder)
    assert isinstance(tok, HFTokenizer)          # the post-processor applies (RoBERTa's BPE reads natively else)
    rc, out, err = _cli(["fill-mask", str(folder), text, "--top-k", "5", "--json"], capsys)
    assert rc == 0, err
    result = json.loads(out)

    from tokenizers import Tokenizer
    hf_tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    encoding = hf_tok.encode(text)                                  # add_special_tokens=True: as trained
    ids = encoding.ids
    assert (hf_tok.id_to_token(ids[0]), hf_tok.id_to_token(ids[-1])) == wrapped
    hf_model = transformers.AutoModelForMaskedLM.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0]
    mask_id = hf_tok.token_to_id("[MASK]" if family == "bert" else "<mask>")
    positions = [i for i, t in enumerate(ids) if t == mask_id]
    assert [m["position"] for m in result["masks"]] == positions and len(positions) == 2
    for mask in result["masks"]:
        ranked = logits[mask["position"]].argsort(descending=True)[:5].tolist()
        assert [p["token_id"] for p in mask["predictions"]] == ranked
        expected = torch.softmax(logits[mask["position"]], -1)[ranked].tolist()
        assert [p["probability"] for p in mask["predictions"]] == pytest.approx(expected, rel=1e-4)
    assert not any(t in result["filled"] for t in (*wrapped, "[MASK]", "<mask>"))


def test_an_hf_decoder_folder_is_refused_before_loading(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "gpt2"
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=32)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)
    (folder / "model.safetensors").unlink()     # never read: the kind comes from config.json
    rc, _, err = _cli(["fill-mask", str(folder), "a [MASK]"], capsys)
    assert rc == 2 and "is a decoder-only model; fill-mask needs an encoder (arch=encoder)" in err, err


def test_a_folder_copy_without_its_tokenizer_is_one_line(runs, tmp_path, capsys):
    shutil.copytree(runs["enc"], tmp_path / "copy")
    shutil.rmtree(tmp_path / "copy" / "tokenizer")
    rc, _, err = _cli(["fill-mask", str(tmp_path / "copy"), TEXT], capsys)
    assert rc == 2 and "no tokenizer" in err and len(err.strip().splitlines()) == 1
