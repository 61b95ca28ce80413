"""Diagnostics on hand-made models whose answers are known: a planted attention sink, a planted
massive activation, uniform attention (entropy ln n), and raw logits that reproduce the softmax."""
from __future__ import annotations

import json
import math

import pytest
import torch

from archlab.config import ModelConfig
from archlab.eval import diagnostics
from archlab.models.decoder import TransformerLM

D, SINK_DIM, MASSIVE_DIM, MASSIVE_POS, T = 16, 0, 7, 3, 10


def _frozen_stream_model(q_bias: float) -> TransformerLM:
    """Residual stream = token embedding at every layer (attention and MLP outputs zeroed); queries are
    the constant q_bias * e_0 and keys read the embedding's dim 0, so with q_bias large every query
    attends to whichever tokens have a nonzero dim 0 -- only token id 1, placed first."""
    cfg = ModelConfig(vocab_size=8, d_model=D, n_layers=3, max_seq_len=32, attention={"n_heads": 2},
                      mlp={"activation": "relu", "d_ff": 8}, position={"kind": "none"},
                      bias={"qkv": True}, norm={"kind": "rmsnorm"})
    model = TransformerLM(cfg)
    with torch.no_grad():
        model.embed.weight.zero_()
        model.embed.weight[:, 1:6] = 1.0                  # every token: small dims 1..5
        model.embed.weight[1, SINK_DIM] = 1.0             # token 1 (the first token): dim 0 on
        model.embed.weight[2, MASSIVE_DIM] = 1000.0       # token 2: a massive value in dim 7
        for blk in model.blocks:
            a = blk.attn
            a.q_proj.weight.zero_()
            a.q_proj.bias.zero_()
            a.q_proj.bias[0::8] = q_bias                  # each head's first query dim
            a.k_proj.weight.zero_()
            a.k_proj.bias.zero_()
            a.k_proj.weight[0, SINK_DIM] = 1.0            # head 0 key dim 0 <- stream dim 0
            a.k_proj.weight[8, SINK_DIM] = 1.0            # head 1 key dim 0 <- stream dim 0
            a.o_proj.weight.zero_()
            blk.mlp.down_proj.weight.zero_()
    return model


def _ids() -> torch.Tensor:
    ids = torch.full((1, T), 3)
    ids[0, 0] = 1
    ids[0, MASSIVE_POS] = 2
    return ids


def test_planted_sink_gives_first_token_mass_one_and_massive_activation_is_located():
    result = diagnostics.diagnose(_frozen_stream_model(q_bias=100.0), _ids(), tokens=list("abcdefghij"))
    for layer in result["layers"]:
        assert all(m > 0.999 for m in layer["first_token_mass"])
        assert all(e < 1e-3 for e in layer["entropy"])
        top = layer["top"][0]
        assert (top["token_index"], top["dim"], top["token"]) == (MASSIVE_POS, MASSIVE_DIM, "d")
        assert layer["ratio"] > 100
    assert result["summary"]["first_token_mass"] > 0.999


def test_uniform_attention_has_known_entropy_and_first_token_share():
    # q = 0: every score is 0, so query i attends uniformly to i+1 keys
    result = diagnostics.diagnose(_frozen_stream_model(q_bias=0.0), _ids())
    want_first = sum(1 / (i + 1) for i in range(1, T)) / (T - 1)
    want_entropy = sum(math.log(i + 1) for i in range(1, T)) / (T - 1)
    for layer in result["layers"]:
        assert layer["first_token_mass"] == pytest.approx([want_first] * 2, abs=1e-6)
        assert layer["entropy"] == pytest.approx([want_entropy] * 2, abs=1e-5)
    assert result["summary"]["uniform_entropy"] == pytest.approx(want_entropy)


@pytest.mark.parametrize("overrides", [
    {},
    {"attention.n_kv_heads": 1, "attention.qk_norm": "per_head"},
    {"attention.window": 4, "attention.layer_pattern": "LG", "attention.qk_norm": "full"},
    {"attention.qk_norm": "per_head_untied", "attention.n_kv_heads": 2},   # read from the layer's own call:
    {"attention.clip_qkv": 0.5},                                            # untied norms and clipping included
])
def test_raw_attention_logits_reproduce_the_models_softmax(overrides):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=2, max_seq_len=16, attention={"n_heads": 4},
                      mlp={"d_ff": 32}).with_overrides(overrides)
    model = TransformerLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(20)                                     # large logits: a real test of the max
    x = torch.randint(0, 50, (2, 12))
    scores = diagnostics.attention_scores(model, x)
    for a in (b.attn for b in model.blocks):
        a.record_probs = True
    model(x)
    for s, blk in zip(scores, model.blocks):
        torch.testing.assert_close(s.softmax(-1), blk.attn.last_probs, atol=1e-5, rtol=1e-4)
    maxes = diagnostics.max_attention_logits(model, x)
    assert maxes == pytest.approx([float(s[torch.isfinite(s)].abs().max()) for s in scores])
    assert min(maxes) > (0.5 if "attention.clip_qkv" in overrides else 10)


def test_save_report_writes_json_and_pngs(tmp_path):
    result = diagnostics.diagnose(_frozen_stream_model(q_bias=100.0), _ids())
    paths = diagnostics.save_report(result, tmp_path)
    assert json.loads(paths["json"].read_text())["summary"]["n_layers"] == 3
    for key in ("first_token_mass", "entropy", "prefix_matching", "massive", "effective_rank"):
        assert paths[key].stat().st_size > 1000


def test_layer_and_head_axes_have_integer_ticks(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt
    close, kept = plt.close, []
    monkeypatch.setattr(plt, "close", kept.append)      # keep each figure to look at its axes
    from archlab.models import build_model, presets

    torch.manual_seed(0)
    model = build_model(presets.tiny("gpt2"))
    diagnostics.save_report(diagnostics.diagnose(model, torch.randint(0, 256, (2, 12))), tmp_path)
    assert len(kept) == 5                              # sinks, entropy, induction, massive, rank
    for fig in kept:
        ax = fig.axes[0]
        fig.canvas.draw()
        axis, lim = (ax.yaxis, ax.get_ylim()) if ax.get_ylabel() == "layer" else (ax.xaxis, ax.get_xlim())
        shown = [t for t in axis.get_majorticklocs() if min(lim) <= t <= max(lim)]
        assert shown and all(float(t).is_integer() for t in shown), (ax.get_title(), shown)
        close(fig)


def test_effective_rank_of_hand_made_matrices():
    assert diagnostics.effective_rank(torch.eye(4)) == pytest.approx(4.0)
    assert diagnostics.effective_rank(torch.ones(5, 3)) == pytest.approx(1.0)           # rank collapse
    assert diagnostics.effective_rank(torch.diag(torch.tensor([2.0, 2.0, 0.0]))) == pytest.approx(2.0)
    # singular values 3 and 1: p = (3/4, 1/4), exp(H) = exp(-(0.75 ln 0.75 + 0.25 ln 0.25))
    expected = math.exp(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))
    assert diagnostics.effective_rank(torch.diag(torch.tensor([3.0, 1.0]))) == pytest.approx(expected)
    rotated = torch.linalg.qr(torch.randn(6, 6))[0] @ torch.diag(torch.tensor([3.0, 1.0, 0, 0, 0, 0]))
    assert diagnostics.effective_rank(rotated) == pytest.approx(expected)                 # basis-free


def test_diagnose_reports_effective_rank_for_an_encoder_and_a_decoder():
    from archlab.models import build_model, presets

    for name in ("bert-base", "gpt2"):
        model = build_model(presets.tiny(name))
        result = diagnostics.diagnose(model, torch.randint(0, 256, (2, 12)))
        ranks = [layer["effective_rank"] for layer in result["layers"]]
        assert all(1.0 <= r <= 12 for r in ranks)
        assert result["summary"]["final_effective_rank"] == ranks[-1]
    assert result["summary"]["uniform_entropy"] < math.log(12)        # a causal query sees fewer keys
