"""Presets: every family builds at tiny size and trains; tiny() keeps every switch; counts match."""
import dataclasses

import pytest
import torch

import archlab
from archlab.cli import main
from archlab.config import ConfigError, ModelConfig
from archlab.models import accounting, build_model, presets
from archlab.models.decoder import TransformerLM

NAMES = presets.names()


def test_every_lecture_family_has_a_preset():
    required = {
        "transformer-2017", "transformer-2017-big", "gpt", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt3-175b",
        "t5-11b", "t5-v1.1-xxl", "gpt-j-6b", "lamda-137b", "gopher-280b", "chinchilla-70b",
        "gpt-neox-20b", "bloom-176b", "opt-175b", "palm-540b", "llama-65b", "llama2-7b", "llama2-70b",
        "llama3-8b", "llama3-70b", "mistral-7b", "mixtral-8x7b", "qwen-14b", "qwen2-72b",
        "qwen2.5-0.5b", "qwen3-8b", "olmo-7b", "olmo2-7b", "gemma2-2b", "gemma2-9b", "gemma2-27b",
        "gemma3-27b", "nemotron4-340b", "falcon-7b", "falcon2-11b", "phi3-mini", "command-r-plus",
        "command-a", "deepseek-67b", "yi-34b", "smollm2-1.7b", "bert-base", "bert-large", "roberta-base",
    }
    assert required <= set(NAMES)
    assert archlab.presets.get("llama2-7b") == presets.get("llama2-7b")


def test_unknown_preset_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match="llama9"):
        presets.get("llama9")


def _flatten(cfg: ModelConfig) -> dict:
    out = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = value
    walk("", cfg.to_dict())
    return out


@pytest.mark.parametrize("name", NAMES)
def test_tiny_keeps_every_switch_but_sizes(name):
    full, small = _flatten(presets.get(name)), _flatten(presets.tiny(name))
    assert full.keys() == small.keys()
    changed = {k for k in full if full[k] != small[k]}
    assert changed <= set(presets.SIZE_FIELDS), changed - set(presets.SIZE_FIELDS)
    # the kinds of attention survive shrinking: MHA/GQA/MQA, explicit head_dim, local layers
    f, s = presets.get(name), presets.tiny(name)
    kind = lambda c: "mha" if c.n_kv_heads == c.attention.n_heads else "mqa" if c.n_kv_heads == 1 else "gqa"  # noqa: E731
    assert kind(f) == kind(s)
    assert (f.attention.head_dim is None) == (s.attention.head_dim is None)
    assert (f.attention.n_heads * f.head_dim == f.d_model) == (s.attention.n_heads * s.head_dim == s.d_model)
    pattern = f.attention.layer_pattern
    if pattern:
        assert s.n_layers % len(pattern) == 0
        assert [s.is_local(i) for i in range(len(pattern))] == [c == "L" for c in pattern]
    assert s.n_layers >= 2 and s.d_model <= 64 and s.vocab_size <= 256
    if s.attention.window is not None:
        assert s.attention.window <= 8


@pytest.mark.parametrize("name", NAMES)
def test_tiny_preset_trains_on_cpu_and_every_parameter_gets_a_gradient(name):
    cfg = presets.tiny(name)
    torch.manual_seed(0)
    model = build_model(cfg)                          # TransformerLM, or EncoderLM for an encoder
    ids = torch.randint(0, cfg.vocab_size, (2, 24))   # longer than every tiny window (8)
    out = model.loss(ids[:, :-1], ids[:, 1:])         # next-token targets; an MLM predicts every slot
    assert torch.isfinite(out.total)
    out.total.backward()
    missing = [n for n, p in model.named_parameters()   # frozen: Marian's sinusoid tables (counted, not trained)
               if p.requires_grad and (p.grad is None or not p.grad.abs().sum() > 0)]
    assert not missing, f"no gradient reaches {missing}"
    assert model.num_params() == accounting.param_count(cfg)


def test_tiny_local_global_patterns_are_complete():
    assert presets.tiny("gemma3-27b").n_layers == 6
    assert presets.tiny("command-a").n_layers == 4
    assert presets.tiny("gemma2-9b").n_layers == 2
    cmd = presets.tiny("command-a")
    assert [cmd.position_kind(i) for i in range(4)] == ["rope", "rope", "rope", "none"]


def test_no_behaviour_hangs_on_the_name():
    """Renaming a preset changes nothing in the built model (behaviour lives in the config)."""
    cfg = presets.tiny("gemma2-2b")
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    a = TransformerLM(cfg)(ids)
    b = TransformerLM(dataclasses.replace(cfg, name="something-else"))(ids)
    torch.testing.assert_close(a, b)


def test_released_model_details_differ_from_the_lecture_table_slips():
    assert presets.get("gpt2").norm.position == "pre"         # table says post: GPT-2 is pre-norm
    assert presets.get("opt-175b").norm.position == "pre"     # only OPT-350m is post-norm
    assert not presets.get("bloom-176b").block.parallel       # BloomBlock is serial
    assert presets.get("gpt").norm.position == "post"
    assert presets.get("transformer-2017").norm.position == "post"


def test_presets_cli_lists_every_preset_with_counts(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in NAMES:
        assert name in out
    assert "=6.74B" in out and "=124.4M" in out     # exact published matches are marked
    assert "softcap 50.0/30.0" in out and "rope local, none global" in out
    assert main(["presets", "--filter", "nothing-like-this"]) == 1
