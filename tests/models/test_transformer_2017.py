"""The 2017 Transformer presets (Vaswani et al. 2017, Table 3): encoder-decoders whose counts equal the hand
derivation in presets.py, with one shared sqrt(d)-scaled embedding as the pre-softmax projection, the paper's
interleaved sinusoids, and a tiny twin that trains and decodes alike with and without a KV cache. Parity with
transformers' MarianMTModel: tests/interop/test_parity_transformer_2017.py."""
import math

import pytest
import torch

import archlab
from archlab.models import accounting, build_model, presets
from archlab.models.encoder_decoder import EncoderDecoderLM

V = 37_000   # "a shared source-target vocabulary of about 37000 tokens" (sec. 5.1)


def _by_hand(d: int, f: int, n: int = 6) -> int:
    """The paper's model counted term by term: the embedding once (source, target, softmax), each layer's
    attention 4d^2 + 4d, FFN 2df + f + d, LayerNorms 2d each (2 per encoder layer, 3 per decoder layer)."""
    attention, ffn, norm = 4 * d * d + 4 * d, 2 * d * f + f + d, 2 * d
    encoder_layer = attention + ffn + 2 * norm
    decoder_layer = 2 * attention + ffn + 3 * norm
    return V * d + n * (encoder_layer + decoder_layer)


@pytest.mark.parametrize("name, d, f, count, paper, gap", [
    ("transformer-2017", 512, 2048, 63_082_496, 65e6, 0.03),        # 3.0% under 65M: see presets.py
    ("transformer-2017-big", 1024, 4096, 214_245_376, 213e6, 0.006),  # rounds to 213M-214M
])
def test_count_is_the_hand_derivation_and_near_the_paper(name, d, f, count, paper, gap):
    cfg = presets.get(name)
    assert _by_hand(d, f) == count
    assert accounting.param_count(cfg) == count
    with torch.device("meta"):
        model = EncoderDecoderLM(cfg)
    assert model.num_params() == count
    assert abs(count / paper - 1) <= gap
    info = presets.info(name)
    assert info.published_params == paper and not info.exact
    assert "vocabulary unpublished" in info.approximation and "max_seq_len unpublished" in info.approximation


@pytest.mark.parametrize("name, d, h, f, p_drop", [("transformer-2017", 512, 8, 2048, 0.1),
                                                   ("transformer-2017-big", 1024, 16, 4096, 0.3)])
def test_presets_are_table_3_encoder_decoders(name, d, h, f, p_drop):
    cfg = presets.get(name)
    assert cfg.arch == "encoder_decoder" and cfg.n_layers == cfg.stack_depth("cross_decoder") == 6
    assert (cfg.d_model, cfg.attention.n_heads, cfg.d_ff, cfg.vocab_size) == (d, h, f, V)
    assert cfg.block.residual_dropout == cfg.embedding_dropout == p_drop and cfg.attention.dropout == 0.0
    assert cfg.tie_embeddings and cfg.scale_embeddings and cfg.mlp.activation == "relu"
    assert cfg.norm.kind == "layernorm" and cfg.norm.position == "post" and not cfg.norm.final_norm
    assert cfg.position.kind == "sinusoidal" and cfg.position.sinusoid_layout == "interleaved"
    assert cfg.bias.qkv and cfg.bias.attn_out and cfg.bias.mlp and cfg.bias.norm and not cfg.bias.head


def _tiny_model() -> EncoderDecoderLM:
    torch.manual_seed(0)
    model = build_model(presets.tiny("transformer-2017"))
    assert isinstance(model, EncoderDecoderLM)
    return model.eval()


def test_one_embedding_scaled_by_sqrt_d_is_also_the_softmax_weight():
    model = _tiny_model()
    cfg = model.config
    assert model.lm_head.weight is None and model.lm_head.bias is None
    assert model.encoder.final_norm is model.decoder.final_norm is None
    src = torch.randint(0, cfg.vocab_size, (2, 7))
    tgt = torch.randint(0, cfg.vocab_size, (2, 5))
    with torch.no_grad():
        zero = torch.zeros_like(src)
        x = model.embed_tokens(src, torch.zeros_like(src))               # position 0: sin 0 = 0, cos 0 = 1
        pe0 = torch.tensor([0.0, 1.0] * (cfg.d_model // 2))
        torch.testing.assert_close(x, model.embed.weight[src] * math.sqrt(cfg.d_model) + pe0)
        assert not torch.equal(model.embed_tokens(src, zero + 3), x)    # positions enter at the input
        hidden = model(src, tgt, return_hidden=True)                     # (b, t, d)
        torch.testing.assert_close(model(src, tgt), hidden @ model.embed.weight.T)


def test_positions_are_the_papers_interleaved_sinusoids():
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)) (sec. 3.5)."""
    model = _tiny_model()
    d = model.config.d_model
    expected = torch.tensor([[math.sin(pos / 10_000 ** (2 * (j // 2) / d)) if j % 2 == 0 else
                              math.cos(pos / 10_000 ** (2 * (j // 2) / d)) for j in range(d)]
                             for pos in range(40)])
    with torch.no_grad():
        ours = model.abs_position(torch.arange(40)[None])[0]             # (t, d)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)
    assert model.decoder_abs_position is None                            # one function serves both stacks


def test_tiny_twin_forward_loss_backward_and_learns():
    """Teacher-forced loss (targets shifted right behind the start token), dropout on: every parameter gets a
    gradient and a few Adam steps on one batch lower the loss."""
    model = _tiny_model().train()
    cfg = model.config
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(1, cfg.vocab_size, (4, 12), generator=gen)
    tgt = torch.randint(1, cfg.vocab_size, (4, 10), generator=gen)
    logits = model(src, tgt)
    assert logits.shape == (4, 10, cfg.vocab_size)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        out = model.loss(src, tgt)
        assert torch.isfinite(out.total)
        opt.zero_grad()
        out.total.backward()
        if not losses:
            missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
            assert not missing, f"no gradient reaches {missing}"
        opt.step()
        losses.append(float(out.total.detach()))
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("num_beams", [1, 3])
def test_cached_generation_equals_uncached(num_beams):
    """Decode steps add the sinusoid of each new position to the scaled embedding as the full forward does."""
    torch.manual_seed(0)
    model = build_model(presets.tiny("transformer-2017").with_overrides({"init.std": 0.2})).eval()
    src = torch.randint(3, model.config.vocab_size, (2, 9))
    kw = dict(max_new_tokens=12, decoder_start_token_id=0, num_beams=num_beams, no_repeat_ngram_size=2)
    cached = archlab.generate(model, src, **kw)
    assert cached.shape == (2, 13) and not torch.equal(cached[0], cached[1])
    assert torch.equal(cached, archlab.generate(model, src, use_cache=False, **kw))
