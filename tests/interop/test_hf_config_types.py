"""config.json fields of the wrong JSON type are one ConfigError naming the field, for every family; the configs
transformers itself writes (its defaults per model_type, the reference) all still read."""
from __future__ import annotations

import re

import pytest

from archlab.config import ConfigError
from archlab.interop.families import FAMILIES

transformers = pytest.importorskip("transformers")

HEADS = ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads")


def _default(model_type: str) -> dict:
    return transformers.AutoConfig.for_model(model_type).to_dict()


@pytest.mark.parametrize("model_type", FAMILIES.names())
def test_transformers_default_config_reads(model_type):
    cfg = FAMILIES.get(model_type).to_config(_default(model_type))
    assert cfg.n_layers >= 1 and cfg.attention.n_heads >= 1


@pytest.mark.parametrize("value", ["four", "4", 4.0, True, [4]])
@pytest.mark.parametrize("model_type", FAMILIES.names())
def test_a_head_count_that_is_not_an_integer_is_named(model_type, value):
    hf = _default(model_type)
    key = next(k for k in HEADS if k in hf)
    with pytest.raises(ConfigError, match=re.escape(f"field {key}={value!r} must be a whole number")):
        FAMILIES.get(model_type).to_config({**hf, key: value})
