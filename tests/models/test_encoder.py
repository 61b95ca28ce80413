"""EncoderLM: bidirectional attention over the real tokens, padding that changes nothing, the MLM head and loss,
and the embedder and init it shares with the decoder-only LM."""
import pytest
import torch
import torch.nn.functional as F

import archlab
from archlab.config import ConfigError
from archlab.models import accounting, build_model, presets
from archlab.models.encoder import EncoderLM, padded_positions
from archlab.nn.attention_backends import forced
from archlab.nn.masks import MaskSpec

ENCODERS = ["bert-base", "roberta-base"]


def _model(name="bert-base", **overrides):
    cfg = presets.tiny(name).with_overrides({"init.std": 0.2, **overrides})
    return EncoderLM(cfg).eval()


def test_padded_positions_count_real_tokens_from_zero():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1]])
    assert padded_positions(mask).tolist() == [[0, 1, 2, -1, -1], [-1, -1, 0, 1, 2]]


@pytest.mark.parametrize("name", ENCODERS)
def test_a_later_token_changes_earlier_outputs(name):
    """Bidirectional: unlike a decoder, position 0 sees position 5."""
    model = _model(name)
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    changed = ids.clone()
    changed[0, 5] = (ids[0, 5] + 1) % model.config.vocab_size
    assert not torch.allclose(model(ids)[0, 0], model(changed)[0, 0])


@pytest.mark.parametrize("name", ENCODERS)
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_rows_equal_each_row_alone(name, side):
    model = _model(name)
    torch.manual_seed(0)
    lengths = [7, 4, 2]
    rows = [torch.randint(0, model.config.vocab_size, (n,)) for n in lengths]
    ids = torch.zeros(3, 7, dtype=torch.long)
    mask = torch.zeros(3, 7, dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(0, len(row)) if side == "right" else slice(7 - len(row), 7)
        ids[i, span], mask[i, span] = row, 1
    batch = model(ids, mask)
    for i, row in enumerate(rows):
        alone = model(row[None])[0]
        torch.testing.assert_close(batch[i][mask[i].bool()], alone, rtol=1e-5, atol=1e-5)


def test_pad_token_ids_change_nothing_real():
    model = _model()
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    mask = torch.ones_like(ids)
    mask[:, 4:] = 0
    other = ids.clone()
    other[:, 4:] = (ids[:, 4:] + 7) % model.config.vocab_size
    torch.testing.assert_close(model(ids, mask)[:, :4], model(other, mask)[:, :4])


def test_token_types_enter_the_embedding_and_default_to_zero():
    model = _model()
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    zeros, ones = torch.zeros_like(ids), torch.ones_like(ids)
    torch.testing.assert_close(model(ids), model(ids, token_type_ids=zeros))
    assert not torch.allclose(model(ids), model(ids, token_type_ids=ones))
    no_types = _model(type_vocab_size=0)
    with pytest.raises(ValueError, match="type_vocab_size=0"):
        no_types(ids, token_type_ids=zeros)


def test_mlm_head_is_transform_norm_then_the_tied_decoder_with_its_bias():
    model = _model()
    with torch.no_grad():
        model.mlm_head.decoder.bias.normal_()
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    hidden = model(ids, return_hidden=True)
    head = model.mlm_head
    by_hand = F.layer_norm(F.gelu(hidden @ head.dense.weight.T + head.dense.bias), (hidden.shape[-1],),
                           head.norm.weight, head.norm.bias, model.config.norm.eps)
    expected = by_hand @ model.embed.weight.T + model.mlm_head.decoder.bias
    torch.testing.assert_close(model(ids), expected, rtol=1e-5, atol=1e-5)
    assert model.mlm_head.decoder.weight is None and model.mlm_head.decoder.matrix is model.embed.weight


def test_mlm_loss_counts_only_labelled_slots_and_equals_cross_entropy_of_the_logits():
    model = _model()
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    labels = torch.full_like(ids, -100)
    labels[0, 1], labels[0, 5], labels[1, 3] = 11, 12, 13
    out = model.loss(ids, labels, mask)
    logits = model(ids, mask)
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(out.ce, expected, rtol=1e-5, atol=1e-6)
    out.total.backward()
    assert model.embed.weight.grad is not None and model.mlm_head.dense.weight.grad.abs().sum() > 0


def test_every_backend_choice_gives_the_eager_reference_logits():
    model = _model()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with forced("eager"):
        reference = model(ids, mask)
    torch.testing.assert_close(model(ids, mask)[mask.bool()], reference[mask.bool()], rtol=1e-5, atol=1e-5)


def test_windowed_encoder_sees_both_sides_of_its_window_and_counts_those_pairs():
    model = _model(**{"attention.window": 4})        # bidirectional window: 2 keys each side
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    far, near = ids.clone(), ids.clone()
    far[0, 11] = (ids[0, 11] + 1) % model.config.vocab_size
    near[0, 2] = (ids[0, 2] + 1) % model.config.vocab_size
    # two layers of reach 2: position 0 sees at most position 4
    torch.testing.assert_close(model(ids)[0, 0], model(far)[0, 0])
    assert not torch.allclose(model(ids)[0, 0], model(near)[0, 0])
    cfg = model.config
    pos = torch.arange(12)[None]
    pairs = MaskSpec(causal=False, window=(2, 2)).allows(pos, pos).sum().item()
    assert accounting.keys_per_query(cfg, 0, 12) == pairs / 12
    assert accounting.keys_per_query(cfg.with_overrides({"attention.window": None}), 0, 12) == 12


def test_an_encoder_caches_nothing_and_its_params_are_counted():
    cfg = presets.tiny("roberta-base")
    assert accounting.kv_cache_bytes(cfg, 128) == 0
    assert EncoderLM(cfg).num_params() == accounting.param_count(cfg)
    assert archlab.build_model(cfg).__class__ is EncoderLM


def test_the_wrong_class_for_an_arch_is_a_config_error_naming_the_right_one():
    with pytest.raises(ConfigError, match="EncoderLM"):
        archlab.TransformerLM(presets.tiny("bert-base"))
    with pytest.raises(ConfigError, match="arch='encoder'"):
        EncoderLM(presets.tiny("gpt2"))
    with pytest.raises(ConfigError, match="EncoderDecoderLM"):
        archlab.TransformerLM(presets.tiny("t5-11b"))
    assert type(build_model(presets.tiny("gpt2").with_overrides({"arch": "encoder_decoder"}))).__name__ == \
        "EncoderDecoderLM"
    with pytest.raises(ConfigError, match="arch"):
        presets.tiny("gpt2").with_overrides({"arch": "seq2seq"})


def test_encoder_and_decoder_share_one_init():
    """Same seed and shapes: the embedder and blocks start from the same numbers in both kinds."""
    dec_cfg = presets.tiny("gpt").with_overrides({"type_vocab_size": 0})
    enc_cfg = dec_cfg.with_overrides({"arch": "encoder"})
    dec, enc = archlab.TransformerLM(dec_cfg), EncoderLM(enc_cfg)
    torch.testing.assert_close(dec.embed.weight, enc.embed.weight)
    torch.testing.assert_close(dec.blocks[1].mlp.up_proj.weight, enc.blocks[1].mlp.up_proj.weight)
