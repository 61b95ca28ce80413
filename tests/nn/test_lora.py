"""LoRA adapters (archlab.nn.lora): the math against a hand computation, merging, decode paths, bad input."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import archlab
from archlab.config import ConfigError
from archlab.models import build_model
from archlab.nn.lora import LoRAConfig, LoRALinear, apply_lora, lora_modules, lora_state, merge_lora


def _model(preset: str = "llama3-8b", seed: int = 0):
    torch.manual_seed(seed)
    return build_model(archlab.presets.tiny(preset)).eval()


def _randomize_adapters(model, seed: int = 1) -> None:
    """B is zero at init; give it values so the adapter changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.1)


def test_lora_linear_equals_hand_computed_update():
    torch.manual_seed(0)
    base = nn.Linear(6, 5)
    w, b = base.weight.detach().clone(), base.bias.detach().clone()
    lin = LoRALinear(base, r=2, scaling=4.0 / 2)
    with torch.no_grad():
        lin.lora_B.normal_()
    x = torch.randn(3, 6)
    expected = x @ w.T + b + 2.0 * (x @ lin.lora_A.detach().T @ lin.lora_B.detach().T)
    torch.testing.assert_close(lin(x), expected)
    assert lin.weight is base.weight and lin.bias is base.bias


def test_fresh_adapter_changes_nothing_and_a_is_kaiming_uniform():
    model = _model()
    x = torch.randint(0, 256, (2, 12))
    before = model(x)
    apply_lora(model, LoRAConfig(r=4, targets=("q", "v")))
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)
    a = next(iter(lora_modules(model).values())).lora_A
    bound = 1 / math.sqrt(a.shape[1])               # kaiming_uniform(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))
    assert a.abs().max() <= bound and a.abs().max() > bound / 2


def test_base_keys_unchanged_and_only_adapters_trainable():
    model = _model()
    base_keys = set(model.state_dict())
    apply_lora(model, LoRAConfig(r=4, targets=("q", "v", "down")))
    keys = set(model.state_dict())
    assert base_keys <= keys
    added = keys - base_keys
    assert "blocks.0.attn.q_proj.lora_A" in added and "blocks.1.mlp.down_proj.lora_B" in added
    assert all(k.endswith(("lora_A", "lora_B")) for k in added)
    assert len(added) == 2 * 3 * model.config.n_layers
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == added
    assert set(lora_state(model)) == added


def test_scaling_alpha_over_r_and_rslora():
    assert LoRAConfig(r=4, alpha=8).scaling == 2.0
    assert LoRAConfig(r=4, alpha=8, use_rslora=True).scaling == 4.0


@pytest.mark.parametrize("targets, expected", [
    (("q",), {"q_proj"}),
    (("o", "up"), {"o_proj", "up_proj"}),
    (("attn.k_proj",), {"k_proj"}),
    (("all-linear",), {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
])
def test_targets_by_archlab_names(targets, expected):
    model = apply_lora(_model(), LoRAConfig(targets=targets))
    assert {p.rsplit(".", 1)[-1] for p in lora_modules(model)} == expected
    assert "lm_head" not in " ".join(lora_modules(model))


@pytest.mark.parametrize("preset", ["llama3-8b", "gpt2"])
def test_merge_gives_the_adapted_logits(preset):
    model = _model(preset)
    apply_lora(model, LoRAConfig(r=4, alpha=8, targets=("all-linear",)))
    _randomize_adapters(model)
    x = torch.randint(0, 256, (2, 10))
    adapted = model(x)
    merged = merge_lora(model)
    assert not lora_modules(merged) and all(type(m) is not LoRALinear for m in merged.modules())
    torch.testing.assert_close(merged(x), adapted, rtol=1e-5, atol=1e-5)
    assert set(merged.state_dict()) == set(_model(preset).state_dict())


@pytest.mark.parametrize("preset", ["llama3-8b", "gpt2", "t5-v1.1-xxl"])
def test_generate_with_adapter_equals_merged_generate(preset):
    """The decode path packs each module's Linears (nn/fused); an adapted Linear is packed as W + s B A."""
    model = _model(preset)
    apply_lora(model, LoRAConfig(r=4, alpha=16, targets=("all-linear",)))
    _randomize_adapters(model)
    prompt = torch.randint(3, 256, (1, 6))
    adapted = archlab.generate(model, prompt, max_new_tokens=12, temperature=0.0)
    merged = archlab.generate(merge_lora(model), prompt, max_new_tokens=12, temperature=0.0)
    assert torch.equal(adapted, merged)


def test_decode_sees_adapter_changes_between_calls():
    """A packed copy built from W, A, B is rebuilt when an adapter tensor changes in place."""
    model = apply_lora(_model(), LoRAConfig(r=4, targets=("all-linear",)))
    prompt = torch.randint(3, 256, (1, 6))
    plain = archlab.generate(model, prompt, max_new_tokens=10, temperature=0.0)
    _randomize_adapters(model, seed=3)
    adapted = archlab.generate(model, prompt, max_new_tokens=10, temperature=0.0)
    reference = archlab.generate(merge_lora(model), prompt, max_new_tokens=10, temperature=0.0)
    assert torch.equal(adapted, reference) and not torch.equal(adapted, plain)


def test_gradients_reach_adapters_only():
    model = apply_lora(_model().train(), LoRAConfig(r=2, dropout=0.1, targets=("q", "v")))
    _randomize_adapters(model)
    x = torch.randint(0, 256, (2, 8))
    model(x, targets=x).total.backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(n.endswith(("lora_A", "lora_B")) for n in grads)


@pytest.mark.parametrize("kwargs, message", [
    ({"r": 0}, "lora.r=0 must be an integer >= 1"),
    ({"dropout": 1.0}, "lora.dropout"),
    ({"targets": ()}, "lora.targets is empty"),
])
def test_bad_lora_settings(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LoRAConfig(**kwargs)


def test_target_matching_nothing_names_it():
    with pytest.raises(ConfigError, match=r"lora target 'qkv' matches no Linear of this model") as info:
        apply_lora(_model(), LoRAConfig(targets=("q", "qkv")))
    assert "\n" not in str(info.value)


# ---- trainable token rows (nn/trainable_tokens.py) ----------------------------------------------------------------
TOKENS = (3, 7, 200)


def _train_steps(model, steps: int = 3, seed: int = 0) -> None:
    """A few AdamW steps on batches that hold the listed tokens (so their rows get gradients)."""
    g = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 12), generator=g)
        x[:, :3] = torch.tensor(TOKENS)
        model(x, targets=x).total.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_trainable_tokens_train_the_listed_rows_and_no_other(tied):
    torch.manual_seed(0)
    model = build_model(archlab.presets.tiny("llama3-8b").with_overrides({"tie_embeddings": tied})).eval()
    base = model.embed.weight.detach().clone()
    head = None if tied else model.lm_head.weight.detach().clone()
    x = torch.randint(0, 256, (2, 12))
    before = model(x)
    apply_lora(model, LoRAConfig(r=2, targets=("q", "v"), trainable_tokens=TOKENS))
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)          # a fresh delta is zero
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        *(f"blocks.{i}.attn.{x}_proj.lora_{ab}" for i in range(2) for x in "qv" for ab in "AB"),
        "embed.trainable_tokens_delta"}
    assert model.embed.trainable_tokens_delta.shape == (len(TOKENS), model.config.d_model)
    _train_steps(model)
    rows = model.embed.effective_weight().detach()
    listed = torch.zeros(len(rows), dtype=torch.bool)
    listed[list(TOKENS)] = True
    assert torch.equal(rows[~listed], base[~listed])                        # bitwise: every other row frozen
    assert (rows[listed] - base[listed]).abs().amin(dim=1).gt(0).all()       # each listed row moved
    assert torch.equal(model.embed.weight, base)                            # the base Parameter itself never moves
    if tied:                                                                # the tied head reads the same rows
        assert torch.equal(model.lm_head.matrix.detach(), rows)
    else:                                                                   # PEFT's list form: the head untouched
        assert torch.equal(model.lm_head.matrix, head)


@pytest.mark.parametrize("preset, tied", [("llama3-8b", False), ("llama3-8b", True), ("gpt2", True)])
def test_merge_writes_the_trained_rows_into_the_embedding(preset, tied):
    torch.manual_seed(0)
    model = build_model(archlab.presets.tiny(preset).with_overrides({"tie_embeddings": tied})).eval()
    apply_lora(model, LoRAConfig(r=2, targets=("all-linear",), trainable_tokens=TOKENS))
    _train_steps(model)
    x = torch.tensor([[3, 7, 200, 1, 5, 3, 9, 200]])
    adapted = model(x)
    effective = model.embed.effective_weight().detach().clone()
    prompt = torch.tensor([[3, 7, 200, 4]])
    generated = archlab.generate(model, prompt, max_new_tokens=8, temperature=0.0)   # the decode path, unmerged
    merge_lora(model)
    assert type(model.embed) is nn.Embedding and torch.equal(model.embed.weight, effective)
    assert not tied or model.lm_head.tied[0] is model.embed
    torch.testing.assert_close(model(x), adapted, rtol=1e-5, atol=1e-5)
    assert set(model.state_dict()) == set(build_model(model.config).state_dict())
    assert torch.equal(archlab.generate(model, prompt, max_new_tokens=8, temperature=0.0), generated)


def test_trainable_tokens_state_is_proportional_to_the_rows():
    model = apply_lora(_model(), LoRAConfig(r=2, targets=("q",), trainable_tokens=TOKENS))
    assert set(lora_state(model)) >= {"embed.token_indices", "embed.trainable_tokens_delta"}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.tensor([list(TOKENS) * 3])
    model(x, targets=x).total.backward()
    optimizer.step()
    shapes = {tuple(s["exp_avg"].shape) for s in optimizer.state.values()}
    assert (len(TOKENS), model.config.d_model) in shapes
    assert tuple(model.embed.weight.shape) not in shapes


@pytest.mark.parametrize("tokens, message", [
    ((300,), "trainable token id 300 is outside the embedding's 256 rows"),
    ((-1,), "must be token ids >= 0"),
])
def test_bad_trainable_tokens_are_named(tokens, message):
    with pytest.raises(ConfigError, match=message) as info:
        apply_lora(_model(), LoRAConfig(r=2, trainable_tokens=tokens))
    assert "\n" not in str(info.value)


def test_modules_to_save_train_whole_and_no_other_base_tensor():
    model = _model("gpt2")
    apply_lora(model, LoRAConfig(r=2, targets=("q",), modules_to_save=("abs_position",)))
    assert model.lora_config.modules_to_save == ("abs_position.embedding",)       # resolved to its owner's path
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"abs_position.embedding.weight"} | {n for n in trainable if ".lora_" in n}
    assert "abs_position.embedding.weight" in lora_state(model)                    # saved with the adapters
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _train_steps(model)
    moved = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    assert "abs_position.embedding.weight" in moved
    assert all(".lora_" in n or n == "abs_position.embedding.weight" for n in moved)
    logits = model(torch.tensor([[1, 2, 3]]))
    merge_lora(model)
    torch.testing.assert_close(model(torch.tensor([[1, 2, 3]])), logits)


@pytest.mark.parametrize("kwargs, message", [
    ({"modules_to_save": ("nope",)}, r"lora modules_to_save 'nope' matches no module of this model \(its modules: "),
    ({"targets": ("q",), "modules_to_save": ("blocks.0.attn",)},
     r"lora modules_to_save 'blocks.0.attn.q_proj' holds the LoRA target blocks.0.attn.q_proj"),
    ({"trainable_tokens": (3,), "modules_to_save": ("embed",)}, r"'embed' is the input embedding whose trainable"),
])
def test_bad_modules_to_save_are_named(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        apply_lora(_model("gpt2"), LoRAConfig(r=2, **kwargs))
