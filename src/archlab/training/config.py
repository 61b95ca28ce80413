"""TrainConfig: every knob of a training run, validated on construction, with dotted overrides and YAML
like ModelConfig; nested by concern: `train.lora` (the typed LoRA config itself, nn.lora.LoRAConfig, or null),
`train.dpo`, `train.sft`. Earlier flat keys (lora_r, dpo_beta, packing, objective=dpo, ...) read through the one
rename table, runs/train_section.py. Kept apart from the loop so the CLI and the lab can build and check configs
without importing it."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any, Literal, get_origin, get_type_hints

import yaml

from archlab.config import ConfigError, _build, _check_literals, _parse_value, check_seed
from archlab.nn.lora import LoRAConfig
from archlab.runs.train_section import current_key, upgrade_train_section

__all__ = ["TrainConfig", "DPOConfig", "SFTConfig", "RewardConfig", "GRPOConfig", "PPOConfig", "ScheduleConfig",
           "OptimizerConfig", "EvalConfig", "SampleConfig", "CheckpointConfig", "MLMConfig", "NoisingConfig",
           "StreamConfig",
           "NO_DECAY_CATEGORIES", "METHOD_NAMES"]

NO_DECAY_CATEGORIES = ("norms", "biases", "embeddings")
METHOD_NAMES = ("pretrain", "sft", "dpo", "reward", "grpo", "ppo")   # training/methods registers a Method under each


@dataclass(frozen=True, kw_only=True)
class DPOConfig:
    """train.dpo: preference tuning (training/dpo.py holds the losses)."""

    beta: float = 0.1                      # the strength of the pull toward the reference
    loss: Literal["sigmoid", "ipo", "simpo", "orpo", "kto"] = "sigmoid"   # DPO, IPO, SimPO, ORPO (the last two
                                           # reference-free; training/dpo.py LOSSES) or KTO (training/kto.py: on
                                           # labelled completions, a pair's sides or TRL's unpaired lines)
    simpo_gamma: float = 0.5               # simpo: the target reward margin
    desirable_weight: float = 1.0          # kto: the weight of a desirable completion's loss (TRL's)
    undesirable_weight: float = 1.0        # kto: the weight of an undesirable completion's loss (TRL's)
    truncation: Literal["refuse", "keep_start", "keep_end", "skip"] = "refuse"   # a side past seq_len
    val_fraction: float = 0.05             # share of the lines held out for validation (val_loss, val_rewards/...)

    def __post_init__(self):
        _check_literals(self, "train.dpo")
        if not 0 < self.beta < math.inf:
            raise ConfigError(f"train.dpo.beta={self.beta} must be a positive number")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"train.dpo.val_fraction={self.val_fraction} must be in [0, 1)")
        if not 0 <= self.simpo_gamma < math.inf:
            raise ConfigError(f"train.dpo.simpo_gamma={self.simpo_gamma} must be >= 0")
        for name in ("desirable_weight", "undesirable_weight"):
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"train.dpo.{name}={getattr(self, name)} must be a positive number")


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """train.sft: chat examples (archlab finetune --method sft)."""

    packing: bool = True                   # whole examples packed into rows of seq_len with document ids; false: one
                                           # example per row, padded per batch
    loss_mask: str = "assistant"           # the tokens the loss scores (data/chat.LOSS_MASKS)
    truncation: str = "refuse"             # an example past seq_len (data/chat.TRUNCATIONS)


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """train.reward: a reward model (training/methods/reward.py), with TRL RewardConfig's centring term."""

    center_rewards_coefficient: float | None = None   # c * mean((r_chosen + r_rejected)^2) added to the loss; None: off
    truncation: Literal["refuse", "keep_start", "keep_end", "skip"] = "refuse"   # a side past seq_len
    val_fraction: float = 0.05             # share of the lines held out (val_loss, val_accuracy, ...)

    def __post_init__(self):
        _check_literals(self, "train.reward")
        if self.center_rewards_coefficient is not None and not 0 <= self.center_rewards_coefficient < math.inf:
            raise ConfigError(f"train.reward.center_rewards_coefficient={self.center_rewards_coefficient} must be "
                              ">= 0 (or None)")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"train.reward.val_fraction={self.val_fraction} must be in [0, 1)")


def _names(value: Any) -> tuple:
    """A comma list given on the command line (`--set train.grpo.rewards=exact_match,format`) as a tuple."""
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    return (value,) if isinstance(value, (int, float)) else tuple(value)


@dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    """train.grpo: group relative policy optimization (training/grpo.py, training/methods/grpo.py), with TRL
    GRPOConfig's defaults. train.batch_size counts completions per micro-batch (TRL's per-device batch size); each
    step samples batch_size * grad_accum / num_generations prompts, num_generations completions of each."""

    num_generations: int = 8               # completions per prompt: the group its advantages are relative to
    max_completion_length: int = 512       # new tokens per completion at most
    temperature: float = 1.0               # sampling temperature (the log-probs are the scaled distribution's)
    top_p: float = 1.0
    top_k: int = 0                         # 0: off
    beta: float = 0.0                      # KL(policy || reference) coefficient, k3 estimator; 0: no reference
    use_bias_correction_kl: bool = True    # the KL term times the ratio (TRL's default; DeepSeek-V3.2)
    epsilon: float = 0.2                   # ratio clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float | None = None      # None: epsilon (DAPO recommends 0.28)
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"   # how per-token losses are averaged
    scale_rewards: Literal["group", "batch", "none"] = "group"       # advantages divided by the group's std
    mask_truncated_completions: bool = False   # completions without an EOS take no part in the loss
    rewards: tuple[str, ...] = ("exact_match",)  # built-ins (exact_match, format), a reward run folder, or
                                           # FILE.py:FUNC given with archlab finetune --reward (not a config file)
    reward_weights: tuple[float, ...] | None = None   # one per reward (default 1 each); the reward is their sum
    format_regex: str = r"<think>.*?</think>\s*<answer>.*?</answer>"   # the format reward: 1 when it matches
                                           # the whole completion (re.fullmatch, DOTALL), else 0
    equal_rewards_warn_steps: int = 10     # warn when every group's rewards are equal this many steps in a row
    val_fraction: float = 0.0              # share of the prompt lines held out (val_reward, ... at each evaluation)

    def __post_init__(self):
        _check_literals(self, "train.grpo")
        object.__setattr__(self, "rewards", _names(self.rewards))
        if self.reward_weights is not None:
            try:
                weights = tuple(float(w) for w in _names(self.reward_weights))
            except ValueError:
                raise ConfigError(f"train.grpo.reward_weights={self.reward_weights!r} must be numbers") from None
            object.__setattr__(self, "reward_weights", weights)
            if len(weights) != len(self.rewards):
                raise ConfigError(f"train.grpo.reward_weights has {len(weights)} weights for {len(self.rewards)} "
                                  f"rewards ({', '.join(self.rewards)})")
        if not self.rewards:
            raise ConfigError("train.grpo.rewards is empty: name at least one reward (exact_match, format, a reward "
                              "run, or --reward FILE.py:FUNC)")
        if self.num_generations < 2:
            raise ConfigError(f"train.grpo.num_generations={self.num_generations} must be at least 2: advantages "
                              "are relative to the other completions of the same prompt")
        if not 0 <= self.beta < math.inf:
            raise ConfigError(f"train.grpo.beta={self.beta} must be >= 0 (0: no KL term, no reference model)")
        if self.max_completion_length < 1 or self.equal_rewards_warn_steps < 1:
            raise ConfigError("train.grpo.max_completion_length and equal_rewards_warn_steps must be at least 1")
        if not 0 < self.temperature < math.inf or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ConfigError(f"train.grpo: temperature={self.temperature} must be > 0, top_p={self.top_p} in "
                              f"(0, 1], top_k={self.top_k} >= 0")
        for name in ("epsilon", "epsilon_high"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < math.inf:
                raise ConfigError(f"train.grpo.{name}={value} must be >= 0")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"train.grpo.val_fraction={self.val_fraction} must be in [0, 1)")


@dataclass(frozen=True, kw_only=True)
class PPOConfig:
    """train.ppo: proximal policy optimization against a reward (training/ppo.py, training/methods/ppo.py), with TRL
    PPOConfig's names and defaults. A rollout is train.batch_size * grad_accum * num_mini_batches prompts; each
    optimizer step trains on one mini-batch (batch_size * grad_accum of them), num_ppo_epochs passes per rollout."""

    reward: str | None = None              # a reward run folder (archlab finetune --method reward), or FILE.py:FUNC
                                           # given with archlab finetune --reward (never from a config file)
    num_ppo_epochs: int = 4                # passes over each rollout
    num_mini_batches: int = 1              # optimizer steps per pass
    response_length: int = 53              # new tokens per completion at most
    temperature: float = 0.7               # sampling temperature (the log-probs are the scaled distribution's)
    kl_coef: float = 0.05                  # the per-token KL penalty's weight in the reward
    kl_estimator: Literal["k1", "k3"] = "k1"   # Schulman's estimators of KL(policy || reference)
    cliprange: float = 0.2                 # the policy ratio clipped to [1 - c, 1 + c]
    vf_coef: float = 0.1                   # the value loss's weight
    cliprange_value: float = 0.2           # values clipped to the rollout's +- c
    gamma: float = 1.0                     # discount
    lam: float = 0.95                      # GAE's lambda
    whiten_rewards: bool = False           # whiten the per-token rewards (the mean kept) before GAE
    missing_eos_penalty: float | None = None   # subtracted from the score of a completion with no end of text

    def __post_init__(self):
        _check_literals(self, "train.ppo")
        for name in ("gamma", "lam"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"train.ppo.{name}={value} must be in [0, 1]")
        for name in ("num_ppo_epochs", "num_mini_batches", "response_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.ppo.{name}={getattr(self, name)} must be at least 1")
        for name in ("kl_coef", "cliprange", "vf_coef", "cliprange_value"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ConfigError(f"train.ppo.{name}={getattr(self, name)} must be >= 0")
        if not 0 < self.temperature < math.inf:
            raise ConfigError(f"train.ppo.temperature={self.temperature} must be > 0")
        if self.missing_eos_penalty is not None and not 0 <= self.missing_eos_penalty < math.inf:
            raise ConfigError(f"train.ppo.missing_eos_penalty={self.missing_eos_penalty} must be >= 0 (or None)")


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """train.schedule: the learning-rate schedule (training/optim.py)."""

    kind: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1              # final LR = lr * min_lr_ratio (cosine, wsd)
    decay_fraction: float = 0.2            # wsd: the cooldown's share of the budget

    def __post_init__(self):
        _check_literals(self, "train.schedule")
        if self.warmup_steps < 0:
            raise ConfigError(f"train.schedule.warmup_steps={self.warmup_steps!r} must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.schedule.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if not 0.0 <= self.decay_fraction <= 1.0:
            raise ConfigError(f"train.schedule.decay_fraction={self.decay_fraction} must be in [0, 1]")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """train.optimizer: AdamW's settings, gradient clipping and what a non-finite step does (training/optim.py)."""

    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float | None = 1.0          # None / 0: no clipping
    no_decay: str = "norms,biases,embeddings"   # comma list of norms, biases, embeddings; or "none"
    nan_policy: Literal["stop", "skip"] = "stop"   # a NaN/Inf loss or gradient norm: stop (Diverged), or skip the
                                           # update (10 in a row still stop)

    def __post_init__(self):
        _check_literals(self, "train.optimizer")
        betas: Any = self.betas
        if isinstance(betas, str):
            try:
                betas = [float(v) for v in betas.strip().strip("[]()").split(",")]
            except ValueError as exc:
                raise ConfigError(f"train.optimizer.betas={self.betas!r} must be two comma-separated numbers") from exc
        object.__setattr__(self, "betas", tuple(betas))
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"train.optimizer.betas={self.betas!r} must be two numbers in [0, 1)")
        if not 0 < self.eps < math.inf:
            raise ConfigError(f"train.optimizer.eps={self.eps!r} must be a positive (finite) number")
        if self.weight_decay < 0:
            raise ConfigError(f"train.optimizer.weight_decay={self.weight_decay!r} must be >= 0")
        if self.grad_clip is not None and self.grad_clip < 0:
            raise ConfigError(f"train.optimizer.grad_clip={self.grad_clip} must be >= 0 (or None)")
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
            raise ConfigError(f"train.optimizer.no_decay has unknown categories {sorted(unknown)}; "
                              f"use a comma list of {', '.join(NO_DECAY_CATEGORIES)} or 'none'")
        return parts


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """train.eval: validation during training."""

    every: int = 200                       # optimizer steps; 0: only at the end
    batches: int = 20

    def __post_init__(self):
        if self.every < 0:
            raise ConfigError(f"train.eval.every={self.every!r} must be >= 0")
        if not 0 < self.batches < math.inf:
            raise ConfigError(f"train.eval.batches={self.batches!r} must be a positive (finite) number")


@dataclass(frozen=True, kw_only=True)
class SampleConfig:
    """train.sample: the progress samples in samples.txt."""

    every: int = 0                         # 0: only at the end; -1: never
    tokens: int = 64
    prompt: str = ""                       # "" : start from the end-of-text token
    temperature: float = 0.8

    def __post_init__(self):
        if self.tokens < 0:
            raise ConfigError(f"train.sample.tokens={self.tokens!r} must be >= 0")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """train.checkpoint: when checkpoints are written and how many stay."""

    every: int = 500                       # 0: only at the end
    keep_last: int = 3

    def __post_init__(self):
        if self.every < 0:
            raise ConfigError(f"train.checkpoint.every={self.every!r} must be >= 0")


@dataclass(frozen=True, kw_only=True)
class MLMConfig:
    """train.mlm: an encoder's masked-LM objective (BERT)."""

    probability: float = 0.15              # share of tokens chosen for the masked-LM loss
    whole_word_mask: bool = False          # choose whole words (all of a word's pieces) instead
    mask_token_id: int | None = None       # the [MASK] id; None: the tokenizer's [MASK] / <mask>. An id past the
                                           # tokenizer (a padded vocabulary) gives a byte-level run one

    def __post_init__(self):
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ConfigError(f"train.mlm.mask_token_id={self.mask_token_id} must be >= 0")
        if not 0.0 < self.probability < 1.0:
            raise ConfigError(f"train.mlm.probability={self.probability} must be in (0, 1)")


@dataclass(frozen=True, kw_only=True)
class NoisingConfig:
    """train.noising: span_corruption (T5) and text_infilling (BART) (data/noising.py)."""

    density: float | None = None           # share of tokens noised (None: T5's 0.15, BART's 0.3)
    mean_span: float | None = None         # their mean span length (None: T5's 3, BART's Poisson lambda 3.5)
    permute_sentences: bool = True         # text_infilling: BART's sentence permutation too

    def __post_init__(self):
        if self.density is not None and not 0.0 < self.density < 1.0:
            raise ConfigError(f"train.noising.density={self.density} must be in (0, 1)")
        if self.mean_span is not None and not self.mean_span > 0:
            raise ConfigError(f"train.noising.mean_span={self.mean_span} must be positive")


@dataclass(frozen=True, kw_only=True)
class StreamConfig:
    """train.stream: how the windows of a token stream are read (pretraining objectives), and from how much of it."""

    document_masks: bool = False           # next_token: end-of-text ends a document; no token attends across,
                                           # positions restart, the label across a boundary is ignored
    prefix_fraction: float = 0.5           # continuation: the window's share given as context, the rest scored
    unique_tokens: int | None = None       # the training split cut to N tokens, which the sampler repeats
                                           # epoch after epoch as the budget needs (repeated data, Muennighoff et al.
                                           # 2023: budget / N epochs); None: the whole split
    unique_spread: bool = True             # those N tokens as chunks evenly strided over the whole split
                                           # (TokenDataset.spread), so every part of the corpus is represented;
                                           # false: the split's first N tokens (its first works only)
    unique_chunk_windows: int = 32         # spread: each chunk holds at least this many seq_len windows; windows
                                           # never cross a chunk seam

    def __post_init__(self):
        if not 0.0 < self.prefix_fraction < 1.0:
            raise ConfigError(f"train.stream.prefix_fraction={self.prefix_fraction} must be in (0, 1)")
        n = self.unique_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ConfigError(f"train.stream.unique_tokens={n!r} must be a whole number >= 1 (or none)")
        w = self.unique_chunk_windows
        if isinstance(w, bool) or not isinstance(w, int) or w < 8:
            raise ConfigError(f"train.stream.unique_chunk_windows={w!r} must be a whole number >= 8 (a chunk loses "
                              "up to one window to the epoch's offset)")


SECTIONS: dict[str, type] = {"schedule": ScheduleConfig, "optimizer": OptimizerConfig, "eval": EvalConfig,
                             "sample": SampleConfig, "checkpoint": CheckpointConfig, "mlm": MLMConfig,
                             "noising": NoisingConfig, "lora": LoRAConfig, "dpo": DPOConfig, "sft": SFTConfig,
                             "reward": RewardConfig, "stream": StreamConfig, "grpo": GRPOConfig,
                             "ppo": PPOConfig}


@dataclass(frozen=True, kw_only=True, init=False)
class TrainConfig:
    """Every knob of a training run; dotted overrides and YAML as ModelConfig; the methods' sections nested."""

    lr: float = 3e-4
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    batch_size: int = 32                   # global sequences per micro-step (all ranks together)
    seq_len: int = 256
    grad_accum: int = 1
    budget: float = 1000.0
    budget_unit: Literal["steps", "tokens", "minutes"] = "steps"
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    sample: SampleConfig = dataclasses.field(default_factory=SampleConfig)
    log_every: int = 10
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"   # auto: bf16 where the hardware has it (precision.py)
    compile: bool = False
    activation_checkpointing: bool = False # recompute each block's activations in backward (recompute.py)
    seed: int = 0                          # data order and dropout (init: ModelConfig.seed)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dist_strategy: Literal["ddp", "fsdp"] = "ddp"
    memory_check: bool = True              # refuse before building when the estimate exceeds free memory
    objective: Literal["auto", "next_token", "mlm", "next_sentence", "span_corruption", "text_infilling",
                       "continuation"] = "auto"
                                           # auto: the kind's own (decoder next_token, encoder mlm, encoder-decoder
                                           # span_corruption; paired data: source -> target); data/objectives.py
    mlm: MLMConfig = dataclasses.field(default_factory=MLMConfig)
    noising: NoisingConfig = dataclasses.field(default_factory=NoisingConfig)
    stream: StreamConfig = dataclasses.field(default_factory=StreamConfig)   # how a token stream's windows are read
    method: Literal["pretrain", "sft", "dpo", "reward", "grpo", "ppo"] = "pretrain"   # how it trains (training/methods)
    lora: LoRAConfig | None = None         # LoRA adapters (nn.lora.LoRAConfig: r, alpha, dropout, targets (names, HF
                                           # names, a full-match regex as PEFT, all-linear), use_rslora,
                                           # trainable_tokens, modules_to_save); None: every parameter trains
    dpo: DPOConfig = dataclasses.field(default_factory=DPOConfig)
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)
    ppo: PPOConfig = dataclasses.field(default_factory=PPOConfig)

    def __init__(self, **settings: Any):
        """Fields by name, a section as its config or a mapping; the earlier flat names (warmup_steps=...,
        lora_r=...) read through the rename table (runs/train_section.py). Example: TrainConfig(lr=1e-3,
        schedule=ScheduleConfig(warmup_steps=10), eval={"every": 50})"""
        given = {k: _as_mapping(v) if k in SECTIONS else v for k, v in settings.items()}
        data = upgrade_train_section(given)
        names = {f.name: f for f in fields(TrainConfig)}
        unknown = set(data) - set(names)
        if unknown:
            raise TypeError(f"TrainConfig got unexpected keyword argument(s) {', '.join(sorted(unknown))}")
        for name, f in names.items():
            if name in data:
                value = data[name]
            else:
                value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            object.__setattr__(self, name, value)
        self.__post_init__()

    def __post_init__(self):
        _check_literals(self, "train")
        for name in ("lr", "batch_size", "seq_len", "grad_accum", "budget", "log_every"):
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"train.{name}={getattr(self, name)!r} must be a positive (finite) number")
        for name, section in SECTIONS.items():
            value = getattr(self, name)
            if isinstance(value, dict):            # TrainConfig(lora={"r": 8}) as from YAML
                object.__setattr__(self, name, _build(section, value, f"train.{name}"))
            elif (value is not None or name != "lora") and not isinstance(value, section):
                raise ConfigError(f"train.{name} must be a {section.__name__}, got {type(value).__name__}")
        check_seed("train.seed", self.seed)

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
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in SECTIONS:
            d[name] = _as_mapping(d[name])
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        """The config of a mapping: today's nested keys, or a run folder's earlier flat ones (runs/train_section)."""
        if not isinstance(data, dict):
            raise ConfigError(f"train config must be a mapping, got {type(data).__name__}")
        data = upgrade_train_section(data)
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
        """New config from {"lr": "1e-3", "betas": "0.9,0.99", "lora.r": "8", "dpo.beta": "0.2"}; a leading
        "train." is accepted, and the earlier flat keys (lora_r, dpo_beta, objective=dpo, dist.strategy) through
        the rename table. LoRA is off until train.lora.r is given (train.lora=none turns it off)."""
        data = self.to_dict()
        hints = get_type_hints(TrainConfig)
        lora_started = False
        for given, value in overrides.items():
            key = _as_typed(given)
            name, value = current_key(given, value)
            head, _, rest = name.partition(".")
            if head not in hints:
                raise ConfigError(f"unknown train config key {key!r}")
            if rest:
                data[head], started = _override_section(head, data[head], rest, value, key)
                lora_started |= started
                continue
            if head in SECTIONS:
                if not (head == "lora" and isinstance(value, str) and value.strip().lower() in ("none", "off", "null")):
                    raise ConfigError(f"{key} is a group: set its fields ({key}.FIELD=...)")
                data[head] = None
            else:
                data[name] = _parse_value(hints[name], value, key)
        if lora_started and isinstance(data["lora"], dict) and "r" not in data["lora"]:
            raise ConfigError(f"train.lora.{next(iter(data['lora']))} needs train.lora.r (LoRA is off)")
        return TrainConfig.from_dict(data)


METHOD_SECTIONS = ("sft", "dpo", "reward", "grpo", "ppo")   # each read only by the method of its name,
ALSO_READ = {"pretrain": ("sft.packing",)}   # but these: pretrain packs a prepared chat folder's rows (data/batches.py)


def _unread(name: str, method: str) -> str | None:
    """The method section `name` (a current dotted key) belongs to when `method` never reads it, else None."""
    head = name.partition(".")[0]
    if head in METHOD_SECTIONS and head != method and name not in ALSO_READ.get(method, ()):
        return head
    return None


def refuse_other_methods_sections(overrides: dict[str, Any], method: str, *, option: str = "--method {}") -> None:
    """A setting typed for another method's section (train.dpo.beta under --method sft) would be accepted and do
    nothing: refused naming the section and the method that reads it. The defaults of every section stay in
    config.yaml; only what the user set (`overrides`, as --set gives them) is checked. `option`: how the command
    spells a method (archlab train: "train.method={}").
    Example: refuse_other_methods_sections({"dpo.beta": "0.2"}, "sft") raises ConfigError"""
    for key, value in overrides.items():
        name, _ = current_key(key, value)
        head = _unread(name, method)
        if head is not None:
            raise ConfigError(f"--set {_as_typed(key)}={value}: train.{head} is read by {option.format(head)}, "
                              f"not {option.format(method)}: drop it or pass {option.format(head)}")


def refuse_other_methods_settings(cfg: TrainConfig, method: str) -> None:
    """refuse_other_methods_sections for a TrainConfig built in Python (finetune(train_cfg=...)): once built, what
    its caller set cannot be told from a default, so a field of another method's section that differs from its
    default is what is refused. Example: refuse_other_methods_settings(TrainConfig(dpo={"beta": 0.2}), "sft")
    raises ConfigError"""
    for head in METHOD_SECTIONS:
        section, default = getattr(cfg, head), SECTIONS[head]()
        for f in fields(section):
            value = getattr(section, f.name)
            if value != getattr(default, f.name) and _unread(f"{head}.{f.name}", method) is not None:
                raise ConfigError(f"train_cfg.{head}.{f.name}={value!r}: train.{head} is read by method={head!r}, "
                                  f"not method={method!r}: leave it at its default or pass method={head!r}")


def _as_typed(key: str) -> str:
    """The key as the user typed it on the command line, for errors: `--set train.dpo.loss=...` reaches here as
    "dpo.loss" (cli/sets drops the prefix), and `dist.strategy` is its own spelling.
    Example: _as_typed("dpo.loss") -> "train.dpo.loss\""""
    return key if key.startswith(("train.", "dist.")) else f"train.{key}"


def _override_section(head: str, current: Any, field: str, value: Any, key: str) -> tuple[Any, bool]:
    """(the section's mapping with `field` set, whether this started the LoRA section)."""
    section = SECTIONS.get(head)
    if section is None:
        raise ConfigError(f"train config key {key!r}: train.{head} is not a group")
    hints = get_type_hints(section)
    if field not in hints:
        raise ConfigError(f"unknown train config key {key!r} (train.{head} has {', '.join(hints)})")
    if head == "lora" and field == "r" and isinstance(value, str) and value.strip().lower() in ("none", "off", "null"):
        return None, False
    started = current is None
    node = dict(current) if isinstance(current, dict) else {}
    if get_origin(hints[field]) is tuple and isinstance(value, str):
        node[field] = value                 # a comma list, parsed by the section
    elif head == "optimizer" and field == "grad_clip" and isinstance(value, str) and \
            value.strip().lower() in ("none", "off", "0"):
        node[field] = None
    else:
        node[field] = _parse_value(hints[field], value, key)
    return node, started


def _as_mapping(section: Any) -> Any:
    """A section config as the mapping config.yaml holds (lists for tuples); anything else as it is (a mapping, None,
    or an earlier flat value such as schedule="wsd", which the rename table reads)."""
    if not dataclasses.is_dataclass(section) or isinstance(section, type):   # a mapping, None, or a flat value
        return section
    if isinstance(section, LoRAConfig):
        return section.to_dict()
    out = dataclasses.asdict(section)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}
