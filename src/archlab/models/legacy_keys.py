"""Parameter names of the models' earlier module layouts -> today's, per arch: a run folder saved before the
stacks held their final norm and T5 table and the heads were modules of their own still loads (tests/fixtures/
run_v1). Applied to a checkpoint's weights and optimizer state when a run folder is read, and to the names HF
family rules give (interop/hf.py), so one table serves both.

    old prefix (or whole name)      new
    final_norm.                     blocks.final_norm.          (decoder, encoder)
    t5_bias.                        blocks.t5_bias.
    head_bias                       lm_head.bias                (decoder, encoder-decoder)
    lm_head.weight, head_bias       mlm_head.decoder.*          (encoder)
    pooler., nsp_classifier.        nsp_head.pooler., nsp_head.classifier.
    encoder_norm., final_norm.      encoder.final_norm., decoder.final_norm.   (encoder-decoder)
    encoder_t5_bias., decoder_t5_bias.   encoder.t5_bias., decoder.t5_bias.
"""
from __future__ import annotations

from typing import Mapping, TypeVar

__all__ = ["RENAMES", "current_key", "upgrade_keys", "upgrade_optimizer_state"]

V = TypeVar("V")

_STACK = (("final_norm.", "blocks.final_norm."), ("t5_bias.", "blocks.t5_bias."))
RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "decoder": (*_STACK, ("head_bias", "lm_head.bias")),
    "encoder": (*_STACK, ("lm_head.weight", "mlm_head.decoder.weight"), ("head_bias", "mlm_head.decoder.bias"),
                ("pooler.", "nsp_head.pooler."), ("nsp_classifier.", "nsp_head.classifier.")),
    "encoder_decoder": (("encoder_norm.", "encoder.final_norm."), ("final_norm.", "decoder.final_norm."),
                        ("encoder_t5_bias.", "encoder.t5_bias."), ("decoder_t5_bias.", "decoder.t5_bias."),
                        ("head_bias", "lm_head.bias")),
}


def current_key(name: str, arch: str) -> str:
    """Today's name of a parameter saved as `name` by a model of this arch (a prefix ending in "." renames what
    starts with it, any other entry the whole name); today's names come back unchanged.
    Example: current_key("final_norm.weight", "decoder") -> "blocks.final_norm.weight\""""
    for old, new in RENAMES.get(arch, ()):
        if name == old or (old.endswith(".") and name.startswith(old)):
            return new + name[len(old):]
    return name


def upgrade_keys(state: Mapping[str, V], arch: str) -> dict[str, V]:
    """`state` with every key under today's name (a checkpoint's weights, or its optimizer state by name)."""
    return {current_key(name, arch): value for name, value in state.items()}


def upgrade_optimizer_state(state: dict, arch: str) -> dict:
    """An optimizer state keyed by parameter name (training/distributed.full_optimizer_state: "state" by name,
    each of "param_groups" listing its names) under today's names."""
    groups = [{**group, "params": [current_key(name, arch) for name in group["params"]]}
              for group in state.get("param_groups", [])]
    return {**state, "state": upgrade_keys(state.get("state", {}), arch), "param_groups": groups}
