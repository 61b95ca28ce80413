"""Families' weights as tables (interop/families/base.py): a pattern with `{i}` expands over the layers, a
config keeps the entries its model has parameters for, a parameter without an HF name is an error naming it,
and every family's rules fill every parameter of the configs it expresses exactly once."""
import pytest

import archlab
from archlab.interop.families import FAMILIES, infer_family
from archlab.interop.families.base import Family
from archlab.interop.families.tables import (
    Rule,
    WeightsError,
    attention,
    expand,
    fused,
    layers,
    parameter_names,
    rename,
    renames,
    table_rules,
)


def test_expand_writes_one_rule_per_layer_and_expert_and_keeps_plain_names():
    rules = [rename("embed.weight", "wte.weight"),
             rename("blocks.{i}.attn.q_proj.weight", "h.{i}.q.weight"),
             rename("blocks.{i}.mlp.experts.{e}.up_proj.weight", "h.{i}.moe.{e}.w3.weight")]
    out = [(r.ours, r.hf) for r in expand(rules, {"i": 2, "e": 3})]
    assert out[0] == (("embed.weight",), ("wte.weight",))
    assert out[1:3] == [(("blocks.0.attn.q_proj.weight",), ("h.0.q.weight",)),
                        (("blocks.1.attn.q_proj.weight",), ("h.1.q.weight",))]
    experts = out[3:]
    assert len(experts) == 6
    assert (("blocks.1.mlp.experts.2.up_proj.weight",), ("h.1.moe.2.w3.weight",)) in experts


def test_table_helpers_spell_modules_and_parameters():
    table = layers(attention("attn.", "q_proj k_proj v_proj out_proj"), "h.{i}.")
    assert table == {"h.{i}.attn.q_proj": "blocks.{i}.attn.q_proj", "h.{i}.attn.k_proj": "blocks.{i}.attn.k_proj",
                     "h.{i}.attn.v_proj": "blocks.{i}.attn.v_proj", "h.{i}.attn.out_proj": "blocks.{i}.attn.o_proj"}
    rules = renames({"h.{i}.ln_1": "blocks.{i}.attn_norm"}, "weight", "bias")
    assert [(r.ours, r.hf) for r in rules] == [(("blocks.{i}.attn_norm.weight",), ("h.{i}.ln_1.weight",)),
                                               (("blocks.{i}.attn_norm.bias",), ("h.{i}.ln_1.bias",))]


def test_a_config_keeps_the_entries_its_model_has():
    llama = FAMILIES.get("llama")
    plain = archlab.presets.tiny("llama2-7b")
    biased = plain.with_overrides({"bias.qkv": True, "bias.attn_out": True})
    names = lambda cfg: {n for r in llama.weight_rules(cfg) for n in r.hf}  # noqa: E731
    assert "model.layers.0.self_attn.q_proj.bias" not in names(plain)
    assert {"model.layers.1.self_attn.q_proj.bias", "model.layers.1.self_attn.o_proj.bias"} <= names(biased)
    assert ("lm_head.weight" in names(plain)) == (not plain.tie_embeddings)


def test_a_fused_rule_whose_parameters_exist_only_in_part_is_refused():
    cfg = archlab.presets.tiny("gpt2")
    d = cfg.d_model
    rule = fused(["blocks.{i}.attn.q_proj.weight", "blocks.{i}.attn.q_norm.weight"], "h.{i}.qk.weight", [d, d])
    with pytest.raises(ValueError, match="only some"):
        table_rules([rule], cfg)


def test_a_parameter_the_table_does_not_name_is_an_error_naming_it():
    class Partial(Family):
        model_type = "partial"

        def weight_table(self, cfg) -> list[Rule]:
            return FAMILIES.get("gpt2").weight_table(cfg)[:-2]   # leaves out the last entries: ln_2 weight, bias

    with pytest.raises(WeightsError, match=r"partial: no HF name for parameter\(s\) blocks\.0\.mlp_norm\.bias"):
        Partial().weight_rules(archlab.presets.tiny("gpt2"))


@pytest.mark.parametrize("preset", archlab.presets.names())
def test_the_rules_of_a_preset_s_family_fill_every_parameter_once(preset):
    cfg = archlab.presets.tiny(preset)
    try:
        fam = infer_family(cfg)
    except archlab.ConfigError:
        pytest.skip("no HF family expresses this preset")
    ours = [n for rule in fam.weight_rules(cfg) for n in rule.ours]
    hf = [n for rule in fam.weight_rules(cfg) for n in rule.hf]
    assert sorted(ours) == sorted(parameter_names(cfg))
    assert len(set(hf)) == len(hf)
