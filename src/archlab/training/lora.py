"""LoRA fine-tuning on the trainer: `train.lora` (nn.lora.LoRAConfig: r, alpha, dropout, targets, use_rslora) puts
adapters on the built model's Linears (nn/lora.py) before the optimizer is made, so only the adapters train and
only they have optimizer state; checkpoints hold the base and the adapters (a resume restores both).
`train.lora.modules_to_save` trains whole modules beside the adapters (PEFT's modules_to_save: learned position
embeddings, a norm, the head). `train.lora.trainable_tokens` trains some input-embedding rows too
(nn/trainable_tokens.py): token ids, token texts and `template` (the chat template's special tokens) are resolved
to ids with the run's tokenizer (`resolve_tokens`) before anything is written, and config.yaml records the ids.

After the first optimizer step the AdamW state is measured (its tensors' bytes) and printed beside what full
fine-tuning would keep at the same bytes per parameter; it is logged once to metrics.jsonl (`optimizer_bytes`).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from archlab.config import ConfigError, ModelConfig
from archlab.interop.peft import hf_module_names
from archlab.nn.lora import LoRAConfig, apply_lora
from archlab.training.config import TrainConfig

__all__ = ["lora_config", "resolve_tokens", "attach", "check", "check_resume", "scale_memory", "optimizer_bytes",
           "LoRAStep"]


def lora_config(cfg: TrainConfig) -> LoRAConfig | None:
    """The adapters the train config asks for, token texts resolved (None: full training)."""
    if cfg.lora is None:
        return None
    cfg.lora.token_ids  # noqa: B018  (token texts left unresolved: a ConfigError naming them)
    return cfg.lora


TEMPLATE = "template"      # lora.trainable_tokens: the special tokens of the tokenizer's chat template


def resolve_tokens(cfg: TrainConfig, tokenizer_dir: str | Path | None, *, shown_as: str | None = None) -> TrainConfig:
    """cfg with train.lora.trainable_tokens as sorted token ids: ids stay, `template` is the special tokens the
    tokenizer folder's chat template writes, any other text a token's exact text in that tokenizer. A text that is
    no token, or texts with no tokenizer to read them, is a ConfigError naming it (and the tokenizer as `shown_as`,
    where `tokenizer_dir` is a staging folder the user never named).
    Example: resolve_tokens(TrainConfig(lora={"r": 8, "trainable_tokens": "template"}), "runs/sft/data/tokenizer")"""
    if cfg.lora is None or all(isinstance(t, int) for t in cfg.lora.trainable_tokens):
        return cfg
    ids = _token_ids([str(t) for t in cfg.lora.trainable_tokens], tokenizer_dir, shown_as or str(tokenizer_dir))
    return dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, trainable_tokens=tuple(sorted(ids))))


def _token_ids(items: list[str], tokenizer_dir: str | Path | None, shown_as: str) -> set[int]:
    from archlab.data.tokenizer_adapter import load_tokenizer

    key = "train.lora.trainable_tokens"
    texts = [item for item in items if not item.isdecimal()]
    if tokenizer_dir is None or not Path(tokenizer_dir).is_dir():
        raise ConfigError(f"{key}: {texts[0]!r} is a token text and this run has no tokenizer to look it up in: "
                          "give token ids")
    ids = {int(item) for item in items if item.isdecimal()}
    if TEMPLATE in texts:
        from archlab.tokenizer.chat import ChatTemplateError, ChatTokenizer

        try:
            found = ChatTokenizer.of(tokenizer_dir).template_token_ids()
        except ChatTemplateError as exc:
            raise ConfigError(f"{key}={TEMPLATE}: {exc}") from None
        if not found:
            raise ConfigError(f"{key}={TEMPLATE}: the chat template of {shown_as} writes no special token")
        ids.update(found)
    tokenizer = load_tokenizer(tokenizer_dir)
    for text in texts:
        if text == TEMPLATE:
            continue
        token_id = tokenizer.token_to_id(text)
        if token_id is None:
            raise ConfigError(f"{key}: {text!r} is not a token of the tokenizer in {shown_as} (give a token's "
                              f"exact text, an id, or {TEMPLATE})")
        ids.add(int(token_id))
    return ids


def attach(model: nn.Module, cfg: TrainConfig) -> LoRAStep | None:
    """Adapters on `model` as `cfg` asks (targets may use the model's HF family names), the base frozen; None
    when train.lora is unset."""
    settings = lora_config(cfg)
    if settings is None:
        return None
    # A from the run's seed alone: every data-parallel rank draws the same adapters, the global RNG untouched
    apply_lora(model, settings, module_names=hf_module_names(model), generator=torch.Generator().manual_seed(cfg.seed))
    return LoRAStep(model)


def check(model_cfg: ModelConfig, cfg: TrainConfig, tokenizer_dir: str | Path | None = None, *,
          shown_as: str | None = None) -> None:
    """Raise ConfigError, before anything is written, for what `attach` would refuse: train.lora.targets or
    modules_to_save that name nothing of this model or overlap, and trainable tokens that are no token of
    `tokenizer_dir` or lie past the embedding. The adapters go on a model built on the meta device (no memory, no
    init) through the same apply_lora the run uses. `shown_as`: the tokenizer's name in messages (resolve_tokens)."""
    if cfg.lora is None:
        return
    settings = lora_config(resolve_tokens(cfg, tokenizer_dir, shown_as=shown_as))
    assert settings is not None
    ids = settings.token_ids
    if ids and ids[-1] >= model_cfg.vocab_size:
        raise ConfigError(f"train.lora.trainable_tokens: token id {ids[-1]} is past the "
                          f"model's vocab_size={model_cfg.vocab_size}")
    adapted_on_meta(model_cfg, settings)


def adapted_on_meta(model_cfg: ModelConfig, settings: LoRAConfig) -> nn.Module:
    """The model `model_cfg` builds, on the meta device (no memory, no init), with `settings`' adapters applied as a
    run applies them (targets by the family's HF names too): what the checks and the memory estimate look at.
    Example: LoRAStep(adapted_on_meta(model_cfg, LoRAConfig(r=8))).trainable -> the adapters' parameter count"""
    from archlab.models import build_model

    with torch.device("meta"):
        model = build_model(model_cfg)
        return apply_lora(model, settings, hf_module_names(model))


def check_resume(run_dir: Path, cfg: TrainConfig) -> None:
    """A resumed run keeps the adapters it began with: a LoRA setting that differs from the run's config.yaml is
    a ConfigError naming it (the checkpoint's tensors would not fit)."""
    from archlab.runs.model_folder import read_run_config
    from archlab.runs.train_section import lora_section

    before, now = lora_section(read_run_config(run_dir).get("train")), cfg.lora
    if before == now:
        return
    if before is None or now is None:
        was, is_ = (before.r if before else None), (now.r if now else None)
        raise ConfigError(f"train.lora.r={is_!r} differs from the run's {was!r} ({run_dir}/config.yaml): "
                          "a run resumes with the adapters it began with")
    for name in (f.name for f in dataclasses.fields(LoRAConfig)):
        if getattr(before, name) != getattr(now, name):
            raise ConfigError(f"train.lora.{name}={getattr(now, name)!r} differs from the run's "
                              f"{getattr(before, name)!r} ({run_dir}/config.yaml): a run resumes with the adapters it "
                              "began with")


def scale_memory(parts: dict[str, int], model_cfg: ModelConfig, cfg: TrainConfig) -> dict[str, int]:
    """accounting.training_memory's parts for a LoRA run: grads and optimizer state scaled to the adapters'
    share of the parameters (counted on a meta model); the parts as they are without train.lora."""
    settings = lora_config(cfg)
    if settings is None or not {"grads", "optimizer"} <= set(parts):
        return parts
    step = LoRAStep(adapted_on_meta(model_cfg, settings))
    share = step.trainable / max(step.total, 1)
    return {k: int(v * share) if k in ("grads", "optimizer") else v for k, v in parts.items()}


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors (AdamW: exp_avg, exp_avg_sq, step), as allocated now."""
    return sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor))


class LoRAStep:
    """The trainer's LoRA stage: counts, and the optimizer's memory reported once after the first step."""

    def __init__(self, model: nn.Module):
        params = {id(p): p for p in model.parameters()}.values()
        self.trainable = sum(p.numel() for p in params if p.requires_grad)
        self.total = sum(p.numel() for p in params)
        self.reported = False

    def after_step(self, run: Any) -> None:
        """Once per process, after its first optimizer step: measure the optimizer state, print it (rank 0, when
        reporting) and log it at step 1."""
        if self.reported:
            return
        self.reported = True
        from archlab.units import human_bytes, human_count

        measured = optimizer_bytes(run.optimizer)
        per_param = measured / max(self.trainable, 1)
        full = per_param * self.total
        if run.step == 1:
            run.log({"step": run.step, "optimizer_bytes": measured, "optimizer_bytes_full": int(full),
                     "trainable_params": self.trainable, "params": self.total})
        if run.info.is_main and (run.bar is not None or run.lines is not None):
            line = (f"LoRA: {human_count(self.trainable)} trainable of {human_count(self.total)} parameters "
                    f"({self.trainable / self.total:.2%}); optimizer state {human_bytes(measured)} measured "
                    f"(full fine-tuning: {human_bytes(full)})")
            if run.bar is not None:
                run.bar.write(line, file=sys.stderr)
            else:
                print(line, file=sys.stderr)
