"""BERT and RoBERTa masked LMs: a tiny random BertForMaskedLM / RobertaForMaskedLM -> save_pretrained ->
load_hf (an EncoderLM) gives transformers' logits on padded batches (the real tokens), and save_hf of
ours loads back into transformers with the same logits; parameter counts equal num_parameters()."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from archlab.config import ConfigError  # noqa: E402
from archlab.interop import FAMILIES, load_hf, save_hf  # noqa: E402
from archlab.models import presets  # noqa: E402
from archlab.models.accounting import param_count  # noqa: E402
from archlab.models.encoder import EncoderLM  # noqa: E402

TOLERANCE = 1e-4
VOCAB, SEQ = 96, 12
TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=48, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            initializer_range=0.1)
ROBERTA_PAD = 1
CLASSES = {"bert": ("BertConfig", "BertForMaskedLM"), "roberta": ("RobertaConfig", "RobertaForMaskedLM")}


def randomize_1d(model: torch.nn.Module, seed: int = 0) -> None:
    """Every 1-D parameter (LayerNorm weights and biases, all biases) random (HF starts them constant)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn(p.shape, generator=gen))


def hf_config(model_type: str, **overrides):
    config_cls, _ = CLASSES[model_type]
    extra = dict(max_position_embeddings=40, type_vocab_size=2)
    if model_type == "roberta":
        extra = dict(max_position_embeddings=SEQ + 2 + 4, type_vocab_size=1, pad_token_id=ROBERTA_PAD,
                     layer_norm_eps=1e-5)
    return getattr(transformers, config_cls)(**{**TINY, **extra, **overrides})


def build_hf(model_type: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = hf_config(model_type, **overrides)
    config._attn_implementation = "eager"
    model = getattr(transformers, CLASSES[model_type][1])(config)
    randomize_1d(model, seed)
    return model.eval()


def padded_batch(pad_id: int, side: str, seed: int = 1):
    """(ids, mask, token types): row 0 full, row 1 with 5 padded slots on `side`; real ids avoid pad_id."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    ids = torch.where(ids == pad_id, (pad_id + 1) % VOCAB, ids)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    pad = slice(SEQ - 5, SEQ) if side == "right" else slice(0, 5)
    mask[1, pad] = 0
    ids[1, pad] = pad_id
    types = torch.zeros(2, SEQ, dtype=torch.long)
    types[:, SEQ // 2:] = 1
    return ids, mask, types * mask


@torch.no_grad()
def assert_same_on_real_tokens(ours, theirs, ids, mask, types=None) -> None:
    kw = {} if types is None else {"token_type_ids": types}
    a = ours(ids, attention_mask=mask, **kw)
    b = theirs(input_ids=ids, attention_mask=mask, **kw).logits
    assert a.shape == b.shape
    real = mask.bool()
    err = float((a[real] - b[real]).abs().max() / b[real].abs().max())
    assert err < TOLERANCE, f"logits differ on the real tokens: max relative error {err:.2e}"


def reload_hf(model_type: str, folder):
    return getattr(transformers, CLASSES[model_type][1]).from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32).eval()


@pytest.mark.parametrize("tied", [True, False])
def test_bert_logits_match_transformers(tmp_path, tied):
    hf = build_hf("bert", tie_word_embeddings=tied)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    assert isinstance(ours, EncoderLM) and not ours.training
    cfg = ours.config
    assert (cfg.arch, cfg.type_vocab_size, cfg.position.learned_offset, cfg.tie_embeddings) == ("encoder", 2, 0, tied)
    ids, mask, types = padded_batch(pad_id=0, side="right")   # BERT numbers every slot: right padding
    assert_same_on_real_tokens(ours, hf, ids, mask, types)
    # transformers 5 gives an untied decoder its own bias; the head's `bias` it keeps is unused
    assert ours.num_params() == param_count(cfg) == hf.num_parameters() - (0 if tied else VOCAB)

    fam = save_hf(ours, tmp_path / "back")
    assert fam.model_type == "bert"
    back = reload_hf("bert", tmp_path / "back")
    assert_same_on_real_tokens(ours, back, ids, mask, types)


@pytest.mark.parametrize("side", ["right", "left"])
def test_roberta_logits_match_transformers(tmp_path, side):
    hf = build_hf("roberta")
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    cfg = ours.config
    assert (cfg.position.learned_offset, cfg.max_seq_len, cfg.type_vocab_size) == (2, SEQ + 4, 1)
    ids, mask, _ = padded_batch(pad_id=ROBERTA_PAD, side=side)
    assert_same_on_real_tokens(ours, hf, ids, mask)
    assert ours.num_params() == param_count(cfg) == hf.num_parameters()

    fam = save_hf(ours, tmp_path / "back")
    assert fam.model_type == "roberta"
    back = reload_hf("roberta", tmp_path / "back")
    assert back.config.pad_token_id == ROBERTA_PAD and back.config.max_position_embeddings == SEQ + 6
    assert_same_on_real_tokens(ours, back, ids, mask)


def test_roberta_other_pad_token_moves_the_offset(tmp_path):
    """positions start at pad_token_id + 1 whatever the pad id: offset 4 for pad 3."""
    hf = build_hf("roberta", pad_token_id=3, max_position_embeddings=SEQ + 4)
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    assert (ours.config.position.learned_offset, ours.config.max_seq_len) == (4, SEQ)
    ids, mask, _ = padded_batch(pad_id=3, side="left")
    assert_same_on_real_tokens(ours, hf, ids, mask)


def test_bert_pretraining_checkpoint_with_legacy_names_loads(tmp_path):
    """A BertForPreTraining checkpoint (pooler + next-sentence head) with TF-era LayerNorm names
    (gamma / beta, as bert-base-uncased stores them) loads as its masked LM."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    config = hf_config("bert")
    pre = transformers.BertForPreTraining(config).eval()
    randomize_1d(pre)
    pre.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert any(k.startswith("bert.pooler.") for k in tensors) and "cls.seq_relationship.weight" in tensors
    legacy = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
              for k, v in tensors.items()}
    legacy["cls.predictions.decoder.weight"] = tensors["bert.embeddings.word_embeddings.weight"].clone()
    save_file(legacy, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = load_hf(tmp_path)
    mlm = transformers.BertForMaskedLM(config).eval()
    mlm.load_state_dict(pre.state_dict(), strict=False)
    mlm.tie_weights()
    ids, mask, types = padded_batch(pad_id=0, side="right")
    assert_same_on_real_tokens(ours, mlm, ids, mask, types)


@pytest.mark.parametrize("name,model_type", [("bert-base", "bert"), ("bert-large", "bert"),
                                             ("roberta-base", "roberta")])
def test_presets_save_as_their_family_and_count_as_transformers(name, model_type):
    """The presets round-trip through their family exactly, and the config.json they write builds a
    transformers *ForMaskedLM (meta device) of the preset's parameter count."""
    cfg = presets.get(name)
    fam = FAMILIES.get(model_type)
    hf = fam.to_hf(cfg)
    assert hf["architectures"] == [CLASSES[model_type][1]]
    config = getattr(transformers, CLASSES[model_type][0])(**hf)
    with torch.device("meta"):
        model = getattr(transformers, CLASSES[model_type][1])(config)
    assert model.num_parameters() == param_count(cfg)


@pytest.mark.parametrize("field,value", [
    ("position_embedding_type", "relative_key"),
    ("is_decoder", True),
    ("add_cross_attention", True),
    ("hidden_act", "tanh"),
    ("type_vocab_size", 0),
])
def test_unsupported_bert_fields_are_named(field, value):
    hf = {**hf_config("bert").to_dict(), "model_type": "bert", field: value}
    with pytest.raises(ConfigError, match=field):
        FAMILIES.get("bert").to_config(hf)


def test_roberta_refuses_a_head_activation_it_would_change():
    hf = {**hf_config("roberta").to_dict(), "model_type": "roberta", "hidden_act": "relu"}
    with pytest.raises(ConfigError, match="hidden_act"):
        FAMILIES.get("roberta").to_config(hf)


def test_save_refuses_what_bert_cannot_express(tmp_path):
    """A decoder never saves as bert; an encoder with RoPE has no family."""
    decoder = presets.tiny("gpt2")
    with pytest.raises(ConfigError, match="arch"):
        FAMILIES.get("bert").from_config(decoder)
    rope = presets.tiny("bert-base").with_overrides({"position.kind": "rope"})
    with pytest.raises(ConfigError, match="position.kind"):
        save_hf(EncoderLM(rope), tmp_path)


def test_verify_compares_an_encoder_with_automodel_for_masked_lm(tmp_path):
    from archlab.interop.convert import compare_with_transformers

    build_hf("roberta").save_pretrained(tmp_path)
    stats = compare_with_transformers(tmp_path, seq_len=SEQ, batch=2)
    assert stats["max_rel"] < TOLERANCE
