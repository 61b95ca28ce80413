"""Random combinations of switches and sizes either build and train a step, or raise ConfigError."""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from archlab import ConfigError, ModelConfig, TransformerLM
from archlab.nn.mlp import ACTIVATIONS
from archlab.nn.norms import NORMS
from archlab.nn.position import ATTENTION_POSITIONS

maybe = lambda s: st.none() | s  # noqa: E731

overrides = st.fixed_dictionaries({
    "d_model": st.sampled_from([8, 12, 16, 24, 30]),
    "n_layers": st.integers(1, 3),
    "vocab_size": st.integers(2, 40),
    "attention.n_heads": st.integers(1, 6),
    "attention.n_kv_heads": st.none() | st.none() | st.integers(1, 6),
    "attention.head_dim": maybe(st.sampled_from([2, 3, 4, 8])),
    "attention.window": maybe(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 3, 4])),
    "attention.layer_pattern": st.none() | st.none() | st.sampled_from(["LG", "G", "LLG", "GL"]),
    "attention.qk_norm": st.sampled_from(["none", "per_head", "full"]),
    "attention.logit_softcap": maybe(st.sampled_from([-1.0, 2.0, 30.0, 2.0, 30.0, 5.0])),
    "attention.gated": st.booleans(),
    "attention.learned_sinks": st.booleans(),
    "norm.kind": st.sampled_from(NORMS.names() * 3 + ["bogus"]),
    "norm.position": st.sampled_from(["post", "pre", "sandwich", "post_sublayer", "pre", "pre"]),
    "block.parallel": st.sampled_from([False, False, True]),
    "block.parallel_norms": st.sampled_from([1, 2]),
    "mlp.activation": st.sampled_from(list(ACTIVATIONS)),
    "mlp.d_ff": maybe(st.integers(0, 20)),
    "mlp.moe": maybe(st.fixed_dictionaries({"n_experts": st.integers(1, 3), "top_k": st.integers(1, 3)})),
    "position.kind": st.sampled_from(ATTENTION_POSITIONS.names()),
    "position.global_kind": maybe(st.sampled_from(["none", "rope", "alibi", "learned"])),
    "position.rotary_fraction": st.sampled_from([1.0, 0.5, 0.25]),
    "position.rope_layout": st.sampled_from(["half", "interleaved"]),
    "tie_embeddings": st.booleans(),
    "final_logit_softcap": maybe(st.sampled_from([0.0, 10.0, 10.0, 10.0])),
})


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(overrides, st.integers(1, 7))
def test_random_switches_build_and_train_or_raise_config_error(values, seq):
    try:
        cfg = ModelConfig(max_seq_len=16).with_overrides(values)
    except ConfigError:
        return
    model = TransformerLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, seq))
    out = model.loss(ids, ids)
    assert torch.isfinite(out.total)
    out.total.backward()
    assert model(ids).shape == (2, seq, cfg.vocab_size)
