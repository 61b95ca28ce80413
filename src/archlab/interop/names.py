"""Our parameter names in a family's weight rules, as the model holds them today: a family may name them by an
earlier module layout (a stack's final norm as `final_norm.weight`), read through the same rename table as run
folders of that layout (models/legacy_keys)."""
from __future__ import annotations

import dataclasses

from archlab.config import ModelConfig
from archlab.interop.families.base import Family, Rule
from archlab.models.legacy_keys import current_key

__all__ = ["model_rules"]


def model_rules(fam: Family, cfg: ModelConfig) -> list[Rule]:
    """`fam.weight_rules(cfg)` with every one of our names under today's name.
    Example: [r.ours for r in model_rules(FAMILIES.get("llama"), cfg)]   # ..., ("blocks.final_norm.weight",)"""
    return [dataclasses.replace(rule, ours=tuple(current_key(name, cfg.arch) for name in rule.ours))
            for rule in fam.weight_rules(cfg)]
