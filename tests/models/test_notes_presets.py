"""The presets the notes' table names that archlab lacked: mT5, Grok-1, Phi-3-small, Reka Flash 3, each at its
published size (parameter count within 1% of the published figure, the source config named beside it) and
with the switches that set it apart."""
from __future__ import annotations

import pytest

from archlab.models import accounting, presets

# published figure, and our count worked out by hand from the source config
COUNTS = {
    # T5 v1.1 XXL's exact 11,135,332,352 plus the larger vocabulary in the embedding and the untied head
    "mt5-xxl": (13e9, 11_135_332_352 + 2 * (250_112 - 32_128) * 4096),
    # 64 x (attention 88,080,384 + 8 experts x 3 x 6144 x 32768 + router 6144 x 8 + 4 norms) + tied embedding + norm
    "grok-1": (314e9, 64 * (88_080_384 + 8 * 3 * 6144 * 32_768 + 6144 * 8 + 4 * 6144) + 131_072 * 6144 + 6144),
    # 32 x (qkv 6144 x 4096 + b, dense + b, up 2 x 14336 + b, down + b, 2 LayerNorms) + tied embedding + LayerNorm
    "phi3-small": (7.39e9, 32 * (6144 * 4097 + 4096 * 4097 + 28_672 * 4097 + 4096 * 14_337 + 4 * 4096)
                   + 100_352 * 4096 + 2 * 4096),
    # 44 x (q, o 6144^2; k, v 6144 x 768; SwiGLU 3 x 6144 x 19648; 2 norms) + untied embedding and head + norm
    "reka-flash-3": (21e9, 44 * (2 * 6144 ** 2 + 2 * 6144 * 768 + 3 * 6144 * 19_648 + 2 * 6144)
                     + 2 * 100_352 * 6144 + 6144),
}


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_param_count_matches_hand_count_and_is_within_1_percent_of_published(name):
    published, by_hand = COUNTS[name]
    info = presets.info(name)
    assert info.published_params == published and info.source
    count = accounting.param_count(presets.get(name))
    assert count == by_hand
    assert abs(count / published - 1) < 0.01


def test_each_keeps_what_sets_it_apart():
    grok = presets.get("grok-1")
    assert grok.mlp.moe.n_experts == 8 and grok.mlp.moe.top_k == 2 and grok.norm.position == "sandwich"
    assert grok.attention.logit_softcap == 30.0 and grok.tie_embeddings and grok.scale_embeddings
    mt5 = presets.get("mt5-xxl")
    assert mt5.arch == "encoder_decoder" and mt5.vocab_size == 250_112 and mt5.mlp.activation == "geglu_tanh"
    phi = presets.get("phi3-small")
    assert phi.norm.kind == "layernorm" and phi.bias.qkv and phi.bias.mlp and phi.attention.n_kv_heads == 8
    assert phi.attention.query_pre_attn_scalar == 128 ** 2 and presets.info("phi3-small").approximation
    reka = presets.get("reka-flash-3")
    assert reka.head_dim == 96 and reka.position.rope_theta == 8e6 and not reka.tie_embeddings
