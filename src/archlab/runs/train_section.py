"""A run folder's train section as written before it was nested by concern, read as today's: the ONE rename table
for train-config keys (as models/legacy_keys.py is for weight names), used by TrainConfig.from_dict and
with_overrides (so `--set train.lora_r=8` and `train.objective=dpo` keep working) and by what reads a run folder
below the trainer (the LoRA settings of a run, typed: `lora_section`).

    old (flat) key            today's
    lora_r, lora_alpha, ...   lora.r, lora.alpha, lora.dropout, lora.targets, lora.use_rslora,
                              lora.trainable_tokens, lora.modules_to_save    (lora: null without lora_r)
    dpo_beta, dpo_loss, ...   dpo.beta, dpo.loss, dpo.simpo_gamma, dpo.truncation, dpo.val_fraction
    packing, loss_mask,       sft.packing, sft.loss_mask, sft.truncation
      truncation
    schedule, warmup_steps,   schedule.kind, schedule.warmup_steps, schedule.min_lr_ratio, schedule.decay_fraction
      min_lr_ratio, ...
    betas, eps, weight_decay, optimizer.betas, optimizer.eps, optimizer.weight_decay, optimizer.grad_clip,
      grad_clip, no_decay,      optimizer.no_decay, optimizer.nan_policy
      nan_policy
    eval_*, sample_*          eval.every, eval.batches; sample.every, sample.tokens, sample.prompt, sample.temperature
    checkpoint_every,         checkpoint.every, checkpoint.keep_last
      keep_last
    mlm_probability, ...      mlm.probability, mlm.whole_word_mask, mlm.mask_token_id
    noise_density, ...        noising.density, noising.mean_span, noising.permute_sentences
    document_masks,           stream.document_masks, stream.prefix_fraction
      prefix_fraction
    objective: dpo            method: dpo
    dist.strategy             dist_strategy   (as torchrun users write it)
"""
from __future__ import annotations

from typing import Any

from archlab.config import ConfigError

__all__ = ["RENAMES", "VALUE_RENAMES", "current_key", "merge_train", "upgrade_train_section", "lora_section"]

RENAMES: dict[str, str] = {
    "dist.strategy": "dist_strategy",
    "lora_r": "lora.r", "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout", "lora_targets": "lora.targets",
    "lora_rslora": "lora.use_rslora", "lora.rslora": "lora.use_rslora",
    "lora_trainable_tokens": "lora.trainable_tokens", "lora_modules_to_save": "lora.modules_to_save",
    "dpo_beta": "dpo.beta", "dpo_loss": "dpo.loss", "dpo_simpo_gamma": "dpo.simpo_gamma",
    "dpo_truncation": "dpo.truncation", "dpo_val_fraction": "dpo.val_fraction",
    "packing": "sft.packing", "loss_mask": "sft.loss_mask", "truncation": "sft.truncation",
    "schedule": "schedule.kind", "warmup_steps": "schedule.warmup_steps", "min_lr_ratio": "schedule.min_lr_ratio",
    "decay_fraction": "schedule.decay_fraction",
    "betas": "optimizer.betas", "eps": "optimizer.eps", "weight_decay": "optimizer.weight_decay",
    "grad_clip": "optimizer.grad_clip", "no_decay": "optimizer.no_decay", "nan_policy": "optimizer.nan_policy",
    "eval_every": "eval.every", "eval_batches": "eval.batches",
    "sample_every": "sample.every", "sample_tokens": "sample.tokens", "sample_prompt": "sample.prompt",
    "sample_temperature": "sample.temperature",
    "checkpoint_every": "checkpoint.every", "keep_last": "checkpoint.keep_last",
    "mlm_probability": "mlm.probability", "whole_word_mask": "mlm.whole_word_mask",
    "mask_token_id": "mlm.mask_token_id",
    "noise_density": "noising.density", "mean_span": "noising.mean_span",
    "permute_sentences": "noising.permute_sentences",
    "document_masks": "stream.document_masks", "prefix_fraction": "stream.prefix_fraction",
}
# (key, value) -> (key, value): a setting that became another key's value
VALUE_RENAMES: dict[tuple[str, str], tuple[str, str]] = {("objective", "dpo"): ("method", "dpo")}


def current_key(key: str, value: Any = None) -> tuple[str, Any]:
    """(today's dotted key, value) of an old or current one (a leading `train.` dropped).
    Example: current_key("train.lora_r", 8) -> ("lora.r", 8); current_key("objective", "dpo") -> ("method", "dpo")"""
    name = key[len("train."):] if key.startswith("train.") else key
    if isinstance(value, dict):                   # a section's mapping is today's shape
        return name, value
    if isinstance(value, str) and (name, value.strip()) in VALUE_RENAMES:
        return VALUE_RENAMES[(name, value.strip())]
    return RENAMES.get(name, name), value


def merge_train(*layers: dict[str, Any]) -> dict[str, Any]:
    """Train settings layered left to right (defaults first), each key read through the rename table, so a later
    `train.eval.every` replaces an earlier `eval_every` (and the other way round) instead of both surviving, where the
    mapping's order, not the layer, would decide which one TrainConfig.from_dict reads.
    Example: merge_train({"eval_every": 100, "lr": 0.1}, {"train.eval.every": 50}) -> {"lr": 0.1, "eval.every": 50}"""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            name, value = current_key(key, value)
            out.pop(name, None)                   # to the end too: the latest layer is also read last
            out[name] = value
    return out


def upgrade_train_section(data: dict[str, Any]) -> dict[str, Any]:
    """A stored train section (flat, nested, or a mix) as today's nested mapping. Flat LoRA keys without lora_r
    (LoRA off: they did nothing) are dropped. Example: upgrade_train_section({"lora_r": 4}) -> {"lora": {"r": 4}}"""
    out: dict[str, Any] = {}
    legacy_lora = "lora_r" in data
    for key, value in data.items():
        name, value = current_key(key, value)
        if legacy_lora and name.startswith("lora.") and data["lora_r"] is None:
            continue
        head, _, rest = name.partition(".")
        if not rest:
            if isinstance(value, dict) and isinstance(out.get(head), dict):
                out[head] = {**value, **out[head]}
            else:
                out[head] = value
            continue
        section = out.get(head)
        if section is None:
            section = out[head] = {}
        if not isinstance(section, dict):
            raise ConfigError(f"train.{head} is given both as {section!r} and as train.{name}")
        section[rest] = value
    return out


def lora_section(train: dict[str, Any] | None) -> Any:
    """The LoRA config (nn.lora.LoRAConfig) a run folder's train section records, or None (no adapters), typed.
    Example: lora_section(read_run_config(run_dir).get("train")) -> LoRAConfig(r=8, ...)"""
    from archlab.nn.lora import LoRAConfig

    section = upgrade_train_section(train or {}).get("lora")
    if section is None:
        return None
    return LoRAConfig.from_dict(section)
