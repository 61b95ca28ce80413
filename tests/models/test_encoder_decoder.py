"""EncoderDecoderLM (T5): the decoder is causal, the encoder's padding is inert, cross-attention projects the
encoder's output once per Context, the loss is the cross-entropy of the logits with the labels shifted right
behind the start token, every parameter learns; the cross sublayer follows every norm wiring; accounting
(parameters, FLOPs against torch's counter, KV cache by hand) and the config's checks."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from archlab.config import ConfigError
from archlab.models import accounting, build_model, presets
from archlab.models.encoder_decoder import EncoderDecoderLM, shift_right
from archlab.nn.attention import Attention
from archlab.nn.masks import AttnInputs

pytestmark = pytest.mark.usefixtures("one_thread")

T5 = ["t5-11b", "t5-v1.1-xxl"]


def _model(name="t5-v1.1-xxl", **overrides) -> EncoderDecoderLM:
    cfg = presets.tiny(name).with_overrides(overrides) if overrides else presets.tiny(name)
    torch.manual_seed(0)
    model = build_model(cfg)
    assert isinstance(model, EncoderDecoderLM)
    with torch.no_grad():          # norms and T5 tables away from their constant init: wiring errors show
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape))
    return model.eval()


def _ids(cfg, *shape, seed=1):
    return torch.randint(1, cfg.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", T5)
def test_a_later_decoder_token_does_not_change_earlier_logits(name):
    model = _model(name)
    src, dec = _ids(model.config, 2, 9), _ids(model.config, 2, 7, seed=2)
    changed = dec.clone()
    changed[:, 4:] = (changed[:, 4:] + 1) % model.config.vocab_size
    with torch.no_grad():
        a, b = model(src, dec), model(src, changed)
    assert a.shape == (2, 7, model.config.vocab_size)
    torch.testing.assert_close(a[:, :4], b[:, :4], rtol=0, atol=0)
    assert not torch.allclose(a[:, 4:], b[:, 4:])


def test_every_source_token_reaches_every_decoder_position():
    model = _model()
    src, dec = _ids(model.config, 1, 9), _ids(model.config, 1, 5, seed=2)
    changed = src.clone()
    changed[0, -1] = (changed[0, -1] + 1) % model.config.vocab_size    # the last source token
    with torch.no_grad():
        a, b = model(src, dec), model(changed, dec)
    assert ((a - b).abs().amax(-1) > 0).all()                         # even the first decoder position sees it


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_padded_source_gives_the_logits_of_the_row_alone(side):
    model = _model("t5-11b")
    src, dec = _ids(model.config, 2, 9), _ids(model.config, 2, 6, seed=2)
    short = src[1, :5].clone()
    pad, real, none = torch.full((4,), 7), torch.ones(5, dtype=torch.long), torch.zeros(4, dtype=torch.long)
    src[1] = torch.cat([short, pad]) if side == "right" else torch.cat([pad, short])
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1] = torch.cat([real, none]) if side == "right" else torch.cat([none, real])
    with torch.no_grad():
        padded = model(src, dec, attention_mask=mask)
        alone = model(short[None], dec[1:])
        pad_ids = src.clone()
        pad_ids[mask == 0] = 3
        repadded = model(pad_ids, dec, attention_mask=mask)
    torch.testing.assert_close(padded[1], alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded, repadded, rtol=0, atol=0)      # padded ids are inert


def test_a_padded_decoder_input_gives_the_logits_of_the_row_alone_on_its_real_tokens():
    model = _model()
    src, dec = _ids(model.config, 2, 8), _ids(model.config, 2, 7, seed=2)
    dec_mask = torch.ones(2, 7, dtype=torch.long)
    dec_mask[1, 4:] = 0
    with torch.no_grad():
        padded = model(src, dec, decoder_attention_mask=dec_mask)
        alone = model(src[1:], dec[1:, :4])
    torch.testing.assert_close(padded[1, :4], alone[0], rtol=1e-5, atol=1e-5)


def test_cross_attention_projects_keys_and_values_once_per_context():
    model = _model()
    cfg = model.config
    src, dec = _ids(cfg, 2, 9), _ids(cfg, 2, 5, seed=2)
    with torch.no_grad():
        context = model.encode(src)
        first = model.decode(dec, context)
        cross = [block.cross_attn for block in model.decoder]
        assert len(context.kv) == cfg.stack_depth("cross_decoder") and set(context.kv) == set(cross)
        kv = {layer: tuple(t.clone() for t in pair) for layer, pair in context.kv.items()}
        for layer in cross:                   # projected once: a second decode reads the Context's k/v
            layer.k_proj.weight.mul_(2.0)
            layer.v_proj.weight.mul_(-1.0)
        again = model.decode(dec, context)
        torch.testing.assert_close(again, first, rtol=0, atol=0)
        for layer, (k, v) in context.kv.items():
            torch.testing.assert_close((k, v), kv[layer], rtol=0, atol=0)
        fresh = model.decode(dec, model.encode(src))              # a new Context projects with the new weights
    assert not torch.allclose(fresh, first)
    assert all(block.attn not in context.kv for block in model.decoder)   # self-attention is not cached there


@pytest.mark.parametrize("name", T5)
def test_loss_is_the_cross_entropy_of_the_logits_with_labels_shifted_right(name):
    model = _model(name)
    cfg = model.config
    src, labels = _ids(cfg, 2, 9), _ids(cfg, 2, 6, seed=2)
    labels[1, 4:] = -100                                              # unscored target padding
    dec = shift_right(labels, cfg.decoder_start_token_id)
    assert (dec[:, 0] == cfg.decoder_start_token_id).all() and (dec[:, 1:] == labels[:, :-1].clamp(min=0)).all()
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, 7:] = 0
    with torch.no_grad():
        out = model.loss(src, labels, attention_mask=mask)
        logits = model(src, dec, attention_mask=mask)
        via_forward = model(src, attention_mask=mask, targets=labels)
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(out.ce, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.total, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(via_forward.total, out.total)


@pytest.mark.parametrize("overrides", [{}, {"norm.position": "post"}, {"norm.position": "sandwich"},
                                       {"norm.position": "post_sublayer"}, {"decoder_layers": 3},
                                       {"tie_embeddings": True, "attention.n_kv_heads": 2}])
def test_every_parameter_learns_and_the_count_is_the_analytic_one(overrides):
    model = _model("t5-v1.1-xxl", **overrides).train()
    cfg = model.config
    ids = _ids(cfg, 2, 12)
    out = model.loss(ids[:, :8], ids[:, 8:], attention_mask=torch.tensor([[1] * 8, [1] * 6 + [0] * 2]))
    out.total.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"no gradient reaches {missing}"
    assert model.num_params() == accounting.param_count(cfg)
    assert len(model.decoder) == cfg.stack_depth("cross_decoder") and len(model.encoder) == cfg.n_layers
    assert sum(accounting.param_breakdown(cfg).values()) == model.num_params()


@pytest.mark.parametrize("position", ["pre", "post", "sandwich", "post_sublayer"])
def test_the_cross_sublayer_is_wired_like_the_others(position):
    """Block by hand: self-attention, cross-attention and MLP each in the configured residual wiring."""
    model = _model(**{"norm.position": position})
    block = model.decoder[0]
    cfg = model.config
    x = torch.randn(2, 5, cfg.d_model)
    with torch.no_grad():
        context = model.encode(_ids(cfg, 2, 7))
        inputs = AttnInputs(torch.arange(5)[None], model.decoder.mask_spec(), plain=True)
        out = block(x, inputs, context)

        def wire(h, norm, post, fn):
            if position == "pre":
                return h + fn(norm(h))
            if position == "post":
                return norm(h + fn(h))
            if position == "sandwich":
                return h + post(fn(norm(h)))
            return h + norm(fn(h))

        h = wire(x, block.attn_norm, block.attn_post_norm, lambda y: block.attn(y, inputs))
        h = wire(h, block.cross_norm, block.cross_post_norm, lambda y: block.cross_attn(y, inputs, context))
        h = wire(h, block.mlp_norm, block.mlp_post_norm, block.mlp)
    torch.testing.assert_close(out, h, rtol=0, atol=0)
    with pytest.raises(ValueError, match="Context"):
        block(x, inputs)


def test_the_shared_embedding_feeds_both_stacks_and_the_tied_head():
    model = _model("t5-11b")
    assert model.lm_head.weight is None and model.lm_head.matrix is model.embed.weight
    names = [n for n, _ in model.named_parameters()]
    assert [n for n in names if n.startswith("embed")] == ["embed.weight"]   # one token embedding
    assert "encoder.t5_bias.embedding.weight" in names and "decoder.t5_bias.embedding.weight" in names
    assert model.encoder.t5_bias.bidirectional and not model.decoder.t5_bias.bidirectional
    untied = _model("t5-v1.1-xxl")
    assert untied.lm_head.weight is not None and untied.config.logit_scale is None
    assert model.config.logit_scale == pytest.approx(model.config.d_model ** -0.5)   # v1.0's rescale
    assert len(model.blocks) == len(model.encoder) + len(model.decoder)


def test_tiny_t5_presets_are_encoder_decoders_with_t5_switches():
    for name in T5:
        cfg = presets.get(name)
        assert cfg.arch == "encoder_decoder" and cfg.position.kind == "t5" and cfg.norm.kind == "rmsnorm"
        assert cfg.attention.query_pre_attn_scalar == 1.0 and cfg.decoder_start_token_id == 0
        spec = cfg.layer_spec(0, "cross_decoder")
        assert spec.attn_scale == 1.0 and spec.cross_attention and spec.causal
        assert presets.tiny(name).arch == "encoder_decoder"
    assert presets.get("t5-11b").mlp.activation == "relu" and presets.get("t5-11b").tie_embeddings
    assert presets.get("t5-v1.1-xxl").mlp.activation == "geglu_tanh"
    assert not presets.get("t5-v1.1-xxl").tie_embeddings
    assert accounting.param_count(presets.get("t5-11b")) == 11_307_321_344
    assert accounting.param_count(presets.get("t5-v1.1-xxl")) == 11_135_332_352


# ---- accounting --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", T5)
@pytest.mark.parametrize("source_len", [1, 6])
def test_flops_equal_torch_flop_counter_for_one_target_token(name, source_len):
    """One decoder query: the eager path's matmuls are exactly the convention's (the encoder is bidirectional,
    so its full QK^T is what it attends to)."""
    cfg = presets.tiny(name)
    model = build_model(cfg).eval()
    for module in model.modules():
        if isinstance(module, Attention):
            module.record_probs = True    # eager path: QK^T and PV are plain matmuls the counter sees
    src, dec = _ids(cfg, 1, source_len), _ids(cfg, 1, 1)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(src, dec)
    flops = accounting.encoder_decoder_flops(cfg, source_len, 1)
    assert counter.get_total_flops() == sum(flops.values())
    if source_len == 1:
        assert counter.get_total_flops() == 2 * accounting.flops_per_token(cfg, 1)   # per token processed


def test_kv_cache_counts_self_and_cross_keys_by_hand():
    cfg = presets.get("t5-11b")   # 24 decoder layers, 128 heads of 128 (MHA)
    per_token_layer = 2 * 128 * 128 * 2
    assert accounting.kv_cache_bytes(cfg, 100, source_len=512) == 24 * (100 + 512) * per_token_layer
    assert accounting.kv_cache_bytes(cfg, 64, batch=2) == 2 * 24 * 128 * per_token_layer   # source_len = seq_len
    assert accounting.kv_bytes_per_token(cfg) == 24 * per_token_layer
    deeper = cfg.with_overrides({"decoder_layers": 12})
    assert accounting.kv_cache_bytes(deeper, 10, source_len=20) == 12 * 30 * per_token_layer
    assert accounting.training_memory_bytes(presets.tiny("t5-11b"), 2, 16) > 0


# ---- config ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, field", [
    ({"decoder_layers": 2}, "decoder_layers"),                                     # a decoder-only config
    ({"arch": "encoder_decoder", "decoder_layers": 0}, "decoder_layers"),
    ({"arch": "encoder_decoder", "decoder_start_token_id": 256}, "decoder_start_token_id"),
    ({"arch": "encoder_decoder", "block.parallel": True}, "block.parallel"),
    ({"arch": "encoder_decoder", "attention.prefix_lm": True}, "attention.prefix_lm"),
    ({"arch": "encoder_decoder", "type_vocab_size": 2}, "type_vocab_size"),
])
def test_impossible_encoder_decoder_configs_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        presets.tiny("llama2-7b").with_overrides(overrides)


def test_the_decoder_depth_is_its_own():
    cfg = presets.tiny("t5-11b").with_overrides({"decoder_layers": 3})
    assert cfg.stack_depth("encoder") == 2 and cfg.stack_depth("cross_decoder") == 3
    assert cfg.layer_spec(2, "cross_decoder").index == 2
    with pytest.raises(ConfigError, match="outside"):
        cfg.layer_spec(2, "encoder")
    with pytest.raises(ValueError, match="decoder_input_ids"):
        build_model(cfg)(_ids(cfg, 1, 4))
