"""Hugging Face model families, one module per family (or group of near-identical families).

`FAMILIES.get(model_type)` returns the `Family` registered for an HF `model_type`. Importing this
package imports every family module listed in `FAMILY_MODULES`: a family is added by writing
`families/<name>.py` (see `families/base.py` for the contract) and appending its module name here.
"""
from __future__ import annotations

import importlib

from archlab.config import ConfigError, ModelConfig
from archlab.interop.families.base import FAMILIES, Family, HFConfig, config_diff, register_family  # noqa: F401
from archlab.interop.families.rope import read_rope, write_rope  # noqa: F401  (re-exported)
from archlab.interop.families.tables import Rule, WeightsError, fused, rename, renames, transposed  # noqa: F401

FAMILY_MODULES = [
    # decoders
    "gpt2", "llama", "gemma", "olmo",
    "gpt_neox", "gptj", "falcon", "bloom", "opt", "phi", "phi3", "cohere", "nemotron",
    # encoders
    "bert",
    # encoder-decoders
    "t5", "bart",
]

for _name in FAMILY_MODULES:
    importlib.import_module(f"{__name__}.{_name}")


def infer_family(cfg: ModelConfig) -> Family:
    """The HF family whose switches express `cfg` exactly (round trip equal on every architectural
    field) among the families of `cfg.arch`; on failure the error names the mismatching switches
    of the closest families."""
    matches, near = [], []
    for name in FAMILIES.names():
        fam = FAMILIES.get(name)
        if fam.arch != cfg.arch:
            continue
        try:
            back = fam.to_config(fam.to_hf(cfg))
        except NotImplementedError:
            continue
        except ConfigError as exc:
            near.append((1.5, name, str(exc)))  # after configs one switch away
            continue
        diff = config_diff(cfg, back)
        if diff:
            near.append((len(diff), name, "differs in " + ", ".join(diff[:6])))
        else:
            matches.append(fam)
    if matches:
        return min(matches, key=lambda f: f.save_priority)
    near.sort(key=lambda item: item[0])  # stable: registry order among equals
    detail = "".join(f"\n  {n}: {why}" for _, n, why in near)
    raise ConfigError(f"no Hugging Face family expresses this config exactly:{detail}")
