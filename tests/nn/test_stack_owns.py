"""What a stack owns (nn/stack.py): each forward's positions and attention inputs, the bounds of a position table,
its T5 table and final norm; and the rename table that reads parameters saved under the models' earlier layout
(models/legacy_keys.py) when a run folder is loaded."""
from __future__ import annotations

import pytest
import torch

from archlab import presets
from archlab.config import ModelConfig
from archlab.models import build_model
from archlab.models.legacy_keys import RENAMES, current_key, upgrade_keys, upgrade_optimizer_state
from archlab.nn.kv_cache import KVCache
from archlab.nn.stack import TransformerStack
from archlab.runs.model_folder import model_with_weights

TINY = {"d_model": 32, "n_layers": 2, "attention.n_heads": 4, "mlp.d_ff": 64, "vocab_size": 50, "max_seq_len": 8}


def _stack(role="decoder", **overrides) -> TransformerStack:
    return TransformerStack(ModelConfig().with_overrides({**TINY, **overrides}), role)


def test_inputs_count_positions_from_the_mask_the_documents_or_the_cache():
    stack, ids = _stack("encoder"), torch.zeros(2, 5, dtype=torch.long)
    plain = stack.inputs(ids)
    assert plain.plain and not plain.continued and plain.positions.tolist() == [[0, 1, 2, 3, 4]]   # one shared row
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1]])
    padded = stack.inputs(ids, attention_mask=mask)
    assert not padded.plain and padded.positions.tolist() == [[0, 1, 2, -1, -1], [-1, -1, 0, 1, 2]]
    assert torch.equal(padded.spec.key_padding, mask.bool()) and not padded.spec.causal
    docs = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, -1, -1]])
    packed = stack.inputs(ids, document_ids=docs)
    assert packed.positions.tolist() == [[0, 1, 0, 1, 2], [0, 0, 1, -1, -1]]
    assert torch.equal(packed.spec.segment_ids, docs)


def test_inputs_continue_a_cache_and_say_whether_it_was_empty():
    cfg = ModelConfig().with_overrides(TINY)
    stack = TransformerStack(cfg, "decoder")
    cache = KVCache()
    first = stack.inputs(torch.zeros(2, 3, dtype=torch.long), cache=cache)
    assert first.continued and first.fresh and not first.plain and first.positions.tolist() == [[0, 1, 2]] * 2
    with torch.no_grad():
        build_model(cfg)(torch.zeros(2, 3, dtype=torch.long), cache=cache)      # the cache now holds 3 tokens
    step = stack.inputs(torch.zeros(2, 1, dtype=torch.long), cache=cache)
    assert step.continued and not step.fresh and step.positions.tolist() == [[3], [3]]
    with pytest.raises(ValueError, match="not with a KV cache"):
        stack.inputs(torch.zeros(2, 1, dtype=torch.long), cache=cache, document_ids=torch.zeros(2, 1))
    with pytest.raises(ValueError, match="unpadded rows"):
        stack.inputs(torch.zeros(2, 1, dtype=torch.long), cache=cache, attention_mask=torch.ones(2, 1))


@pytest.mark.parametrize("position", [{"position.kind": "learned"},
                                      {"position.kind": "sinusoidal", "position.sinusoid_table": True}])
def test_a_position_past_the_table_is_refused_by_every_kind_of_stack(position):
    for role in ("decoder", "encoder", "cross_decoder"):
        stack = _stack(role, **position)
        stack.inputs(torch.zeros(1, 8, dtype=torch.long))                        # 0..7: every row exists
        with pytest.raises(ValueError, match="position 8 is past max_seq_len=8"):
            stack.inputs(torch.zeros(1, 9, dtype=torch.long))
    _stack("decoder", **{"position.kind": "rope"}).inputs(torch.zeros(1, 9, dtype=torch.long))   # no table


def test_the_stack_returns_its_final_norm_of_the_last_block():
    stack = _stack().eval()
    x = torch.randn(2, 4, 32)
    inputs = stack.inputs(torch.zeros(2, 4, dtype=torch.long))
    with torch.no_grad():
        h = x
        for block in stack:
            h = block(h, inputs)
        torch.testing.assert_close(stack(x, inputs), stack.final_norm(h))
    assert len(stack) == 2 and stack[1] is stack.layers[1]
    assert _stack(**{"norm.final_norm": False}).final_norm is None


def _old_layout(state: dict, arch: str) -> dict:
    """A state dict under the names the earlier layout gave (the inverse of RENAMES)."""
    back = {}
    for name, value in state.items():
        old = next((o + name[len(n):] for o, n in RENAMES[arch] if name == n or (n.endswith(".")
                                                                                and name.startswith(n))), name)
        back[old] = value
    return back


@pytest.mark.parametrize("preset", ["t5-11b", "bert-base", "bart-large"])
def test_a_state_saved_under_the_old_names_loads_with_the_same_logits(preset, tmp_path):
    cfg = presets.tiny(preset)
    if cfg.arch == "encoder":
        cfg = cfg.with_overrides({"nsp_head": True, "bias.head": True})
    model = build_model(cfg).eval()
    old = _old_layout(model.state_dict(), cfg.arch)
    assert set(old) != set(model.state_dict())                                  # some names did change
    assert upgrade_keys(old, cfg.arch).keys() == model.state_dict().keys()
    loaded = model_with_weights(cfg, old, tmp_path / "model.safetensors").eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, ids) if cfg.arch == "encoder_decoder" else loaded(ids),
                                   model(ids, ids) if cfg.arch == "encoder_decoder" else model(ids))


def test_the_table_maps_each_old_name_once_and_leaves_todays_names_alone():
    assert current_key("final_norm.weight", "decoder") == "blocks.final_norm.weight"
    assert current_key("final_norm.weight", "encoder_decoder") == "decoder.final_norm.weight"
    assert current_key("head_bias", "encoder") == "mlm_head.decoder.bias"
    assert current_key("nsp_classifier.bias", "encoder") == "nsp_head.classifier.bias"
    for arch, renames in RENAMES.items():
        for _, new in renames:
            name = new + ("weight" if new.endswith(".") else "")
            assert current_key(name, arch) == name                                # applying it twice is harmless
    old = {"state": {"final_norm.weight": {"step": 1}, "blocks.0.attn.q_proj.weight": {"step": 1}},
           "param_groups": [{"params": ["blocks.0.attn.q_proj.weight"], "lr": 1.0},
                            {"params": ["final_norm.weight"], "lr": 1.0}]}
    new = upgrade_optimizer_state(old, "decoder")
    assert set(new["state"]) == {"blocks.final_norm.weight", "blocks.0.attn.q_proj.weight"}
    assert new["param_groups"][1] == {"params": ["blocks.final_norm.weight"], "lr": 1.0}
