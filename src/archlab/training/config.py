"""TrainConfig: every knob of a training run, validated on construction, with dotted overrides and YAML
like ModelConfig. Kept apart from the loop so the CLI and the lab can build and check configs without
importing it."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any, Literal, get_type_hints

import yaml

from archlab.config import ConfigError, _check_literals, _parse_value, check_seed

__all__ = ["TrainConfig", "NO_DECAY_CATEGORIES"]

NO_DECAY_CATEGORIES = ("norms", "biases", "embeddings")
ALIASES = {"dist.strategy": "dist_strategy",   # --set dist.strategy=fsdp, as torchrun users write it
           "lora.r": "lora_r", "lora.alpha": "lora_alpha", "lora.dropout": "lora_dropout",
           "lora.targets": "lora_targets", "lora.rslora": "lora_rslora", "lora.use_rslora": "lora_rslora",
           "lora.trainable_tokens": "lora_trainable_tokens", "lora.modules_to_save": "lora_modules_to_save"}


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Every knob of a training run; dotted overrides and YAML as ModelConfig (no nesting here)."""

    lr: float = 3e-4
    min_lr_ratio: float = 0.1              # final LR = lr * min_lr_ratio (cosine, wsd)
    warmup_steps: int = 100
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    decay_fraction: float = 0.2            # wsd: the cooldown's share of the budget
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float | None = 1.0          # None / 0: no clipping
    batch_size: int = 32                   # global sequences per micro-step (all ranks together)
    seq_len: int = 256
    grad_accum: int = 1
    budget: float = 1000.0
    budget_unit: Literal["steps", "tokens", "minutes"] = "steps"
    eval_every: int = 200                  # optimizer steps; 0: only at the end
    eval_batches: int = 20
    sample_every: int = 0                  # 0: only at the end; -1: never
    sample_tokens: int = 64
    sample_prompt: str = ""                # "" : start from the end-of-text token
    sample_temperature: float = 0.8
    log_every: int = 10
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"   # auto: bf16 where the hardware has it (precision.py)
    compile: bool = False
    activation_checkpointing: bool = False # recompute each block's activations in backward (recompute.py)
    seed: int = 0                          # data order and dropout (init: ModelConfig.seed)
    checkpoint_every: int = 500            # 0: only at the end
    keep_last: int = 3
    nan_policy: Literal["stop", "skip"] = "stop"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    no_decay: str = "norms,biases,embeddings"   # comma list of norms, biases, embeddings; or "none"
    dist_strategy: Literal["ddp", "fsdp"] = "ddp"
    memory_check: bool = True              # refuse before building when the estimate exceeds free memory
    mlm_probability: float = 0.15          # encoders: share of tokens chosen for the masked-LM loss (BERT)
    whole_word_mask: bool = False          # encoders: choose whole words (all of a word's pieces) instead
    mask_token_id: int | None = None       # encoders: the [MASK] id; None: the tokenizer's [MASK] / <mask>. An id
                                           # past the tokenizer (a padded vocabulary) gives a byte-level run one
    objective: Literal["auto", "next_token", "mlm", "next_sentence", "span_corruption", "text_infilling",
                       "continuation", "dpo"] = "auto"
                                           # auto: the kind's own (decoder next_token, encoder mlm, encoder-decoder
                                           # span_corruption; paired data: source -> target); objectives.py
    noise_density: float | None = None     # span_corruption / text_infilling: share of tokens noised (None: T5's
                                           # 0.15, BART's 0.3)
    mean_span: float | None = None         # their mean span length (None: T5's 3, BART's Poisson lambda 3.5)
    permute_sentences: bool = True         # text_infilling: BART's sentence permutation too
    prefix_fraction: float = 0.5           # continuation: the window's share given as context, the rest scored
    document_masks: bool = False           # next_token: end-of-text ends a document; no token attends across,
                                           # positions restart, the label across a boundary is ignored
    lora_r: int | None = None              # LoRA adapters of this rank (None: every parameter trains); the base frozen
    lora_alpha: float = 16.0               # the adapter's scale is alpha / r (alpha / sqrt(r) with lora_rslora)
    lora_dropout: float = 0.0              # dropout on the adapters' input
    lora_targets: str = "q,v"              # comma list: q, k, v, o, gate, up, down, module names, HF names, a
    #                                        full-match regex (.*(q|v)_proj, as PEFT), all-linear
    lora_rslora: bool = False              # rank-stabilised scaling (Kalajdzievski 2023)
    lora_trainable_tokens: str = ""        # comma list of token ids, token texts, or `template` (the chat template's
                                           # special tokens): their input-embedding rows train too (PEFT's
                                           # trainable_token_indices); config.yaml records the ids
    lora_modules_to_save: str = ""         # comma list of modules that train whole beside the adapters (PEFT's
                                           # modules_to_save), e.g. abs_position: learned positions LoRA cannot move
    packing: bool = True                   # chat examples (archlab finetune): whole examples packed into rows of
                                           # seq_len with document ids; false: one example per row, padded per batch
    loss_mask: str = "assistant"           # archlab finetune: the tokens the loss scores (data/chat.LOSS_MASKS)
    truncation: str = "refuse"             # archlab finetune: an example past seq_len (data/chat.TRUNCATIONS)
    dpo_beta: float = 0.1                  # dpo: the strength of the pull toward the reference (training/dpo.py)
    dpo_loss: Literal["sigmoid", "ipo", "simpo"] = "sigmoid"   # DPO, IPO, or SimPO (reference-free)
    dpo_simpo_gamma: float = 0.5           # simpo: the target reward margin
    dpo_truncation: Literal["refuse", "keep_start", "keep_end", "skip"] = "refuse"   # a side past seq_len
    dpo_val_fraction: float = 0.05         # dpo: share of the lines held out for validation (val_loss, val_rewards/...)

    def __post_init__(self):
        if isinstance(self.betas, list):
            object.__setattr__(self, "betas", tuple(self.betas))
        _check_literals(self, "train")
        for name in ("lr", "eps", "batch_size", "seq_len", "grad_accum", "budget", "eval_batches",
                     "log_every"):
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"train.{name}={getattr(self, name)!r} must be a positive (finite) number")
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "sample_tokens", "weight_decay"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name}={getattr(self, name)!r} must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ConfigError(f"train.mask_token_id={self.mask_token_id} must be >= 0")
        if not 0.0 < self.mlm_probability < 1.0:
            raise ConfigError(f"train.mlm_probability={self.mlm_probability} must be in (0, 1)")
        if self.noise_density is not None and not 0.0 < self.noise_density < 1.0:
            raise ConfigError(f"train.noise_density={self.noise_density} must be in (0, 1)")
        if self.mean_span is not None and not self.mean_span > 0:
            raise ConfigError(f"train.mean_span={self.mean_span} must be positive")
        if not 0.0 < self.prefix_fraction < 1.0:
            raise ConfigError(f"train.prefix_fraction={self.prefix_fraction} must be in (0, 1)")
        if not 0.0 <= self.decay_fraction <= 1.0:
            raise ConfigError(f"train.decay_fraction={self.decay_fraction} must be in [0, 1]")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"train.betas={self.betas!r} must be two numbers in [0, 1)")
        if self.grad_clip is not None and self.grad_clip < 0:
            raise ConfigError(f"train.grad_clip={self.grad_clip} must be >= 0 (or None)")
        if self.lora_r is not None:
            if self.lora_r < 1:
                raise ConfigError(f"train.lora_r={self.lora_r} must be >= 1 (or None: no adapters)")
            if not 0.0 <= self.lora_dropout < 1.0:
                raise ConfigError(f"train.lora_dropout={self.lora_dropout} must be in [0, 1)")
            if not 0 < self.lora_alpha < math.inf:
                raise ConfigError(f"train.lora_alpha={self.lora_alpha} must be a positive number")
            if not self.lora_targets.strip(" ,"):
                raise ConfigError("train.lora_targets is empty: name Linears (q,v ...) or all-linear")
        elif self.lora_trainable_tokens.strip(" ,"):
            raise ConfigError(f"train.lora_trainable_tokens={self.lora_trainable_tokens!r} needs train.lora_r (without "
                              "LoRA every embedding row trains)")
        elif self.lora_modules_to_save.strip(" ,"):
            raise ConfigError(f"train.lora_modules_to_save={self.lora_modules_to_save!r} needs train.lora_r (without "
                              "LoRA every module trains)")
        if not 0 < self.dpo_beta < math.inf:
            raise ConfigError(f"train.dpo_beta={self.dpo_beta} must be a positive number")
        if not 0.0 <= self.dpo_val_fraction < 1.0:
            raise ConfigError(f"train.dpo_val_fraction={self.dpo_val_fraction} must be in [0, 1)")
        if not 0 <= self.dpo_simpo_gamma < math.inf:
            raise ConfigError(f"train.dpo_simpo_gamma={self.dpo_simpo_gamma} must be >= 0")
        check_seed("train.seed", self.seed)
        parts = self.no_decay_set  # validates
        del parts

    @property
    def no_decay_set(self) -> frozenset[str]:
        text = self.no_decay.strip().lower()
        if text in ("", "none"):
            return frozenset()
        parts = frozenset(p.strip() for p in text.split(",") if p.strip())
        unknown = parts - set(NO_DECAY_CATEGORIES)
        if unknown:
            raise ConfigError(f"train.no_decay has unknown categories {sorted(unknown)}; "
                              f"use a comma list of {', '.join(NO_DECAY_CATEGORIES)} or 'none'")
        return parts

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum * self.seq_len

    def total_steps(self) -> int | None:
        """Optimizer steps in the budget (None for a minutes budget)."""
        if self.budget_unit == "steps":
            return max(1, int(round(self.budget)))
        if self.budget_unit == "tokens":
            return max(1, math.ceil(self.budget / self.tokens_per_step))
        return None

    # serialization, as ModelConfig
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        if not isinstance(data, dict):
            raise ConfigError(f"train config must be a mapping, got {type(data).__name__}")
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown field(s) in train: {', '.join(sorted(unknown))}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(f"train: {exc}") from exc

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> "TrainConfig":
        data = yaml.safe_load(text)
        if not isinstance(data, dict):
            raise ConfigError("a train config YAML must be a mapping")
        return cls.from_dict(data.get("train", data))

    def with_overrides(self, overrides: dict[str, Any]) -> "TrainConfig":
        """New config from {"lr": "1e-3", "betas": "0.9,0.99"}; a leading "train." is accepted, and
        "dist.strategy" for dist_strategy."""
        data = self.to_dict()
        hints = get_type_hints(TrainConfig)
        for key, value in overrides.items():
            name = key[len("train."):] if key.startswith("train.") else key
            name = ALIASES.get(name, name)
            if name not in hints:
                raise ConfigError(f"unknown train config key {key!r}")
            if name == "betas" and isinstance(value, str):
                text = value.strip().strip("[]()")
                try:
                    value = [float(v) for v in text.split(",")]
                except ValueError as exc:
                    raise ConfigError(f"{key}={value!r} must be two comma-separated numbers") from exc
            elif name == "grad_clip" and isinstance(value, str) and value.strip().lower() in ("none", "off", "0"):
                value = None
            else:
                value = _parse_value(hints[name], value, key)
            data[name] = value
        return TrainConfig.from_dict(data)
