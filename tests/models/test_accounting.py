"""Analytic accounting equals the built model, the published counts, and hand computations."""
import random

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from variants import VARIANTS, variant

from archlab.cli import main
from archlab.config import AttentionConfig, ConfigError, MLPConfig, ModelConfig
from archlab.models import accounting, presets
from archlab.models.decoder import TransformerLM
from archlab.nn.attention import Attention

EXACT = [n for n in presets.names() if presets.info(n).exact]


def test_llama2_7b_and_gpt2_param_counts_match_published():
    assert accounting.param_count(presets.get("llama2-7b")) == 6_738_415_616
    assert accounting.param_count(presets.get("gpt2")) == 124_439_808


@pytest.mark.parametrize("name", EXACT)
def test_published_exact_param_counts(name):
    """Counts from the released checkpoints (HF model cards / num_parameters of the HF model)."""
    assert accounting.param_count(presets.get(name)) == presets.info(name).published_params


def test_exact_published_figures_cover_the_tricky_parts():
    # learned positions (GPT-2), MQA (Falcon),
    # MoE router (Mixtral), embedding norm + ALiBi (BLOOM), sandwich norms + tied (Gemma 2),
    # parallel two-norm + partial rotary (NeoX), qkv bias + tied (Qwen2.5)
    for name in ["gpt2", "falcon-7b", "mixtral-8x7b", "bloom-176b", "gemma2-9b", "gpt-neox-20b",
                 "qwen2.5-0.5b", "llama3-8b", "mistral-7b"]:
        assert name in EXACT


def test_opt_125m_counts_the_two_offset_position_rows():
    """OPT-125m (HF facebook/opt-125m): 125,239,296 parameters, 2050 position rows."""
    cfg = presets.gpt2_like("opt-125m", vocab_size=50_272, d_model=768, n_layers=12, n_heads=12,
                            max_seq_len=2048, activation="relu", learned_offset=2)
    assert accounting.param_breakdown(cfg)["position"] == 2050 * 768
    assert accounting.param_count(cfg) == 125_239_296


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_param_count_equals_built_model_for_every_switch(name):
    cfg = variant(name)
    assert accounting.param_count(cfg) == TransformerLM(cfg).num_params()


def test_param_count_equals_built_model_for_random_switch_combinations():
    rng = random.Random(0)
    keys = [k for k in VARIANTS if k != "base"]
    checked = 0
    for _ in range(60):
        overrides = {}
        for k in rng.sample(keys, 4):
            overrides.update(VARIANTS[k])
        try:
            cfg = variant("base").with_overrides(overrides)
        except ConfigError:  # an impossible combination (e.g. parallel + post-norm)
            continue
        assert accounting.param_count(cfg) == TransformerLM(cfg).num_params(), overrides
        checked += 1
    assert checked >= 30


def test_breakdown_parts():
    cfg = presets.get("gpt2")
    parts = accounting.param_breakdown(cfg)
    assert parts["position"] == 1024 * 768 and parts["head"] == 0   # tied: counted once
    assert parts["norms"] == (2 * 12 + 1) * 2 * 768                  # LayerNorm weight + bias
    assert sum(parts.values()) == accounting.param_count(cfg)
    assert accounting.param_breakdown(presets.get("olmo-7b"))["norms"] == 0   # non-parametric
    t5 = presets.get("t5-11b")
    assert accounting.param_breakdown(t5)["position"] == 2 * 32 * 128   # one bias table per stack, shared by its layers


def test_mixtral_active_params_match_published_12_9b():
    active = accounting.active_param_count(presets.get("mixtral-8x7b"))
    assert 12.8e9 < active < 13.0e9


# ---- FLOPs ----------------------------------------------------------------------------------------
def _hand_config(**kw) -> ModelConfig:
    return ModelConfig(
        vocab_size=10, d_model=8, n_layers=2, max_seq_len=16,
        attention=AttentionConfig(n_heads=2, n_kv_heads=1, window=3, layer_pattern="LG"),
        mlp=MLPConfig(activation="swiglu", d_ff=16), **kw)


def test_flops_per_token_by_hand():
    cfg = _hand_config()
    # per layer: q 8*8 + k 8*4 + v 8*4 + o 8*8 = 192, SwiGLU 3*8*16 = 384; head 8*10
    matmul = 2 * (2 * (192 + 384) + 80)
    # seq_len 5: the local layer (window 3) sees 1,2,3,3,3 keys (mean 2.4), the global 1..5 (mean 3)
    attention = 4 * 2.4 * 2 * 4 + 4 * 3.0 * 2 * 4
    assert accounting.flops_per_token(cfg, 5) == pytest.approx(matmul + attention)
    assert accounting.training_flops_per_token(cfg, 5) == pytest.approx(3 * (matmul + attention))
    assert accounting.average_context(5, 3) == pytest.approx(2.4)
    assert accounting.average_context(5) == pytest.approx(3.0)


@pytest.mark.parametrize("name", ["llama3-8b", "mixtral-8x7b", "gemma2-9b", "falcon-7b", "palm-540b",
                                  "lamda-137b", "gpt2", "olmo2-7b", "command-a", "gpt-j-6b"])
def test_flops_for_one_token_equal_torch_flop_counter(name):
    """At seq_len 1 the convention is exact: torch counts the same matmuls (eager attention path)."""
    cfg = presets.tiny(name)
    model = TransformerLM(cfg).eval()
    for module in model.modules():
        if isinstance(module, Attention):
            module.record_probs = True  # eager path: QK^T and PV are plain matmuls the counter sees
    ids = torch.randint(0, cfg.vocab_size, (1, 1))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(ids)
    assert counter.get_total_flops() == accounting.flops_per_token(cfg, 1)


# ---- KV cache -------------------------------------------------------------------------------------
def test_kv_cache_mqa_by_hand():
    cfg = presets.get("falcon-7b")   # 32 layers, 1 kv head of 64
    assert accounting.kv_bytes_per_token(cfg) == 32 * 2 * 1 * 64 * 2
    assert accounting.kv_cache_bytes(cfg, 2048, batch=3) == 3 * 2048 * 32 * 2 * 64 * 2
    assert accounting.kv_cache_bytes(cfg, 2048, dtype="float32") == 2048 * 32 * 2 * 64 * 4


def test_kv_cache_windowed_by_hand():
    mistral = presets.get("mistral-7b")   # every layer local, window 4096, 8 kv heads of 128
    per_layer_token = 2 * 8 * 128 * 2
    assert accounting.kv_cache_bytes(mistral, 1000) == 32 * 1000 * per_layer_token
    assert accounting.kv_cache_bytes(mistral, 32_768) == 32 * 4096 * per_layer_token
    gemma = presets.get("gemma2-9b")      # 21 local (4096) + 21 global layers, 8 kv heads of 256
    assert accounting.kv_cache_bytes(gemma, 8192) == (21 * 4096 + 21 * 8192) * 2 * 8 * 256 * 2
    cmd = presets.tiny("command-a")       # LLLG, window 8
    e, k = cmd.head_dim, cmd.n_kv_heads
    assert accounting.kv_cache_bytes(cmd, 20, dtype="bf16") == (3 * 8 + 20) * 2 * k * e * 2


def test_kv_cache_matches_a_real_cache_without_windows():
    from archlab.nn.kv_cache import KVCache
    cfg = presets.tiny("llama3-8b")
    cache = KVCache()
    TransformerLM(cfg)(torch.randint(0, cfg.vocab_size, (2, 12)), cache=cache)
    stored = sum(t.numel() * t.element_size() for d in (cache.keys, cache.values) for t in d.values())
    assert accounting.kv_cache_bytes(cfg, 12, batch=2, dtype=torch.float32) == stored


def test_bad_dtype_is_a_clear_error():
    with pytest.raises(ConfigError, match="float13"):
        accounting.kv_cache_bytes(presets.get("gpt2"), 10, dtype="float13")


# ---- training memory ------------------------------------------------------------------------------
def test_training_memory_formula():
    cfg = presets.get("llama2-7b")
    p = accounting.param_count(cfg)
    mem = accounting.training_memory(cfg, batch=1, seq_len=1024)
    assert mem["weights"] == mem["grads"] == 2 * p
    assert mem["optimizer"] == 12 * p           # two fp32 moments + fp32 master weights
    fp32 = accounting.training_memory(cfg, batch=1, seq_len=1024, dtype="float32")
    assert fp32["optimizer"] == 8 * p
    double = accounting.training_memory(cfg, batch=2, seq_len=1024)
    assert double["activations"] == 2 * mem["activations"]
    assert accounting.training_memory_bytes(cfg, 1, 1024) == sum(mem.values())
    with pytest.raises(ConfigError, match="optimizer"):
        accounting.training_memory(cfg, 1, 1024, optimizer="adagrad")


# ---- CLI ------------------------------------------------------------------------------------------
def test_inspect_cli_prints_counts_flops_and_cache(capsys):
    assert main(["inspect", "llama2-7b", "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "6.74B" in out                        # params
    assert "2.0 GiB" in out                      # 32 layers x 4096 x 2 x 4096 x 2 bytes
    assert "512.0 KiB" in out                    # KV per token
    flops = accounting.flops_per_token(presets.get("llama2-7b"), 4096)
    assert f"{flops / 1e9:.1f}GFLOP" in out


def test_inspect_cli_vs_and_set(capsys):
    assert main(["inspect", "llama2-7b", "--vs", "llama3-8b", "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "llama3-8b" in out and "4x" in out   # MHA vs GQA-8: 4x the KV cache
    assert main(["inspect", "llama2-7b", "--vs", "llama2-7b", "--set", "attention.n_kv_heads=1"]) == 0
    out = capsys.readouterr().out
    assert "0.0312x" in out                     # MQA: 1/32 of the cache
    assert main(["inspect", "llama2-7b", "--set", "attention.n_kv_heads=3"]) == 2
    assert "must divide" in capsys.readouterr().err     # errors go to stderr, one line
    assert main(["inspect", "gemma3-27b", "--tiny"]) == 0


@pytest.mark.parametrize("preset", ["gpt2", "llama2-7b", "t5-11b"])
def test_non_embedding_count_is_the_built_model_without_its_vocabulary_and_position_matrices(preset):
    """Kaplan et al. 2020's N: every parameter but token embeddings, position tables and an untied head."""
    from archlab.models import build_model

    cfg = presets.tiny(preset)
    vocabulary_or_position = ("embed.weight", "lm_head.weight", "abs_position.embedding.weight", "t5_bias")
    model = build_model(cfg)
    kept = sum(p.numel() for name, p in model.named_parameters() if not any(k in name for k in vocabulary_or_position))
    assert accounting.non_embedding_param_count(cfg) == kept
    assert 0 < kept < accounting.param_count(cfg)
