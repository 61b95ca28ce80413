"""`reward`: a reward model on preference pairs (Ouyang et al. 2022, §3.5): a ScoreHead (nn/heads.py, zeros at the
start) reads each side's normed hidden state at its last real token, and the Bradley-Terry loss of TRL's
RewardTrainer trains it with the decoder under it:

    loss = -log sigmoid(r_chosen - r_rejected - margin)  +  c * mean((r_chosen + r_rejected)^2)

`margin`: an optional per-line "margin" field of the data (TRL's margin column; 0 without); c:
train.reward.center_rewards_coefficient (None: no centring term; Eisenstein et al. 2023). Logged as TRL names them:
accuracy (share of pairs whose chosen reward is the larger), margin (mean r_chosen - r_rejected), min_reward,
mean_reward, max_reward; the held-out pairs (train.reward.val_fraction) as val_loss, val_accuracy, ...

    archlab finetune runs/sft --method reward --data prefs.jsonl --out runs/rm
    archlab score runs/rm --data prefs.jsonl          # each line's rewards, and the accuracy

A reward model reads hidden states, never logits: the LM head's own parameters are frozen (they would get no gradient),
so no optimizer holds them and DDP waits for no gradient of them. Under torchrun (dist.strategy=ddp) each rank trains
on its share of every batch's pairs (the loss a mean over pairs, so DDP's mean gradient is one process's), the logged
figures are reduced over the ranks and every rank scores the held-out pairs.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from archlab.data.corpora import jsonl_records
from archlab.data.formats import require
from archlab.data.preference import PreferenceBatches, PreferenceData, load_preference_data, pad_pairs
from archlab.data.preference_folder import open_preference_folder
from archlab.data.prepare import held_out_indices
from archlab.errors import UserError
from archlab.eval.evaluate import autocast
from archlab.models.decoder import LossOutput
from archlab.nn.heads import SCORE_HEAD, attach_score_head
from archlab.training import distributed as dist_util
from archlab.training.dpo import _tokenizer_only, check_form, check_pair_settings, held_out_rows
from archlab.training.methods.base import METHODS, Method
from archlab.training.methods.dpo import preference_settings, prepare_preferences

__all__ = ["METRICS", "reward_loss", "sequence_rewards", "RewardRun", "open_reward", "held_out_pairs",
           "held_out_rewards", "HeldOutAccuracy", "held_out_accuracy"]

METRICS = ("accuracy", "margin", "min_reward", "mean_reward", "max_reward")     # TRL's RewardTrainer's names


def reward_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                center_coefficient: float | None = None) -> torch.Tensor:
    """TRL's RewardTrainer loss of rewards (b,) each: Bradley-Terry with an optional margin (b,), plus the centring
    term. Example: reward_loss(torch.zeros(4), torch.zeros(4)) -> ln 2"""
    diff = chosen - rejected if margin is None else chosen - rejected - margin
    loss = -F.logsigmoid(diff).mean()
    if center_coefficient is not None:
        loss = loss + center_coefficient * torch.mean((chosen + rejected) ** 2)
    return loss


def _unwrapped(model: Any) -> Any:
    """The model under DDP (`module`) and torch.compile (`_orig_mod`) wrappers: where the score head is."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or model._orig_mod
    return model


def sequence_rewards(model: Any, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The reward of each row (b,), float32: the score head on the hidden state at the row's last real token
    (rows right-padded; `lengths` (b,) their real tokens)."""
    hidden = model(input_ids=input_ids, return_hidden=True)                           # (b, t, d)
    return getattr(_unwrapped(model), SCORE_HEAD)(hidden, lengths)


def _margins(data: PreferenceData) -> torch.Tensor | None:
    """Each pair's "margin" field (pairs,), or None when no line has one; some lines without one, or a margin that
    is no finite number, is a UserError naming the line."""
    found: dict[int, Any] = {line: value.get("margin") for line, value in jsonl_records(data.path)
                             if isinstance(value, dict)}
    values = [found.get(pair.line) for pair in data.pairs]
    if all(v is None for v in values):
        return None
    for pair, value in zip(data.pairs, values):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"{data.path}:{pair.line}: margin must be a finite number when any line has one "
                            f"(TRL's margin column), got {value!r}")
    return torch.tensor(values, dtype=torch.float32)


class RewardRun:
    """Preference pairs, their batches, the reward loss and its logged figures; `extend` puts the score head on."""

    def __init__(self, data: PreferenceData, cfg: Any, info: Any, margins: torch.Tensor | None):
        self.cfg, self.data, self.margins, self.info = cfg, data, margins, info
        self.train_data, self.val_data = data, data.without_pairs()
        self.tokenizer_dir: Path | None = Path(data.tokenizer_dir)
        self.val = held_out_pairs(data, cfg)
        held = set(self.val)
        pool = [i for i in range(len(data.pairs)) if i not in held]
        self.batches = PreferenceBatches(data, cfg.batch_size, seed=cfg.seed, rank=info.rank,
                                         world_size=info.world_size, pool=pool if held else None)
        self._figures: list[torch.Tensor] = []         # each micro-batch's METRICS since the last log line

    def extend(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The score head (zeros) on the model, the LM head's own parameters frozen (a tied embedding is the trunk's
        and trains); the score head's fresh state, which starting weights do not hold."""
        head = attach_score_head(model)
        for p in model.lm_head.parameters():          # a tied head's matrix is the embedding's: not among these
            p.requires_grad_(False)
        return {f"{SCORE_HEAD}.{name}": t for name, t in head.state_dict().items()}

    def _per_pair(self, model: Any, input_ids: torch.Tensor, lengths: torch.Tensor, index: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, chosen rewards (b,), rejected rewards (b,)) of 2b rows (b chosen, then b rejected)."""
        chosen, rejected = sequence_rewards(model, input_ids, lengths).chunk(2)
        margin = self.margins[index.cpu()].to(chosen.device) if self.margins is not None else None
        return reward_loss(chosen, rejected, margin, self.cfg.reward.center_rewards_coefficient), chosen, rejected

    def loss(self, model: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> LossOutput:
        lengths = inputs["attention_mask"].sum(-1)                                         # (2b,)
        loss, chosen, rejected = self._per_pair(model, inputs["input_ids"], lengths, inputs["pair_index"])
        self._figures.append(_figures(chosen.detach(), rejected.detach()))    # (METRICS,) on device: no host sync
        zero = loss.new_zeros(())
        return LossOutput(total=loss, ce=loss.detach(), z_loss=zero, aux_loss=zero)

    def log_fields(self) -> dict[str, float]:
        """METRICS averaged over the micro-batches since the last call, each micro-batch's over all ranks' pairs."""
        if not self._figures:
            return {}
        rows = torch.stack(self._figures).double().cpu()                                  # (micro-batches, METRICS)
        self._figures = []
        if self.info.world_size > 1:
            rows = _over_ranks(rows, self.info)
        return dict(zip(METRICS, rows.mean(0).tolist()))

    @torch.no_grad()
    def evaluate(self, model: Any, *, device: torch.device, dtype: str, info: Any) -> dict[str, float]:
        """val_loss and val_<METRICS> over every held-out pair (every rank scores them all)."""
        if not self.val:
            return {}
        chosen, rejected = held_out_rewards(model, self.data, self.val, self.cfg.batch_size, device, dtype)
        margin = self.margins[torch.tensor(self.val)] if self.margins is not None else None
        loss = reward_loss(chosen, rejected, margin, self.cfg.reward.center_rewards_coefficient)
        figures = _figures(chosen, rejected).tolist()
        return {"val_loss": float(loss), **{f"val_{k}": v for k, v in zip(METRICS, figures)}}

    def start(self, model: torch.nn.Module, run_dir: Path, **_: Any) -> None:
        return None

    def check_resume(self, run_dir: Path) -> None:
        return None


_PEAKS = {METRICS.index("min_reward"): -1.0, METRICS.index("max_reward"): 1.0}    # min as the max of the negated


def _over_ranks(rows: torch.Tensor, info: Any) -> torch.Tensor:
    """Each micro-batch's METRICS (n, METRICS) over the ranks' equal shares of its pairs: the means averaged,
    min_reward the ranks' least, max_reward their greatest."""
    sign = torch.tensor([_PEAKS.get(j, 1.0) for j in range(len(METRICS))], dtype=rows.dtype)
    mean = torch.tensor(dist_util.all_reduce_mean(rows.flatten().tolist(), info), dtype=rows.dtype).view_as(rows)
    peak = torch.tensor(dist_util.all_reduce_max((rows * sign).flatten().tolist(), info),
                        dtype=rows.dtype).view_as(rows) * sign
    columns = list(_PEAKS)
    mean[:, columns] = peak[:, columns]
    return mean


def held_out_rewards(model: Any, data: PreferenceData, val: list[int], batch_size: int, device: torch.device,
                     dtype: str = "float32") -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen rewards (n,), rejected rewards (n,)) of the pairs `val` (indices into data.pairs), float32 on the CPU,
    scored in batches of `batch_size` with the model in eval mode (dpo.held_out_rows).
    Example: chosen, rejected = held_out_rewards(model, data, [0, 3], 8, torch.device("cpu"))"""
    def score(index: torch.Tensor) -> torch.Tensor:
        pairs = [data.pairs[i] for i in index]
        ids, _ = pad_pairs(pairs, data.eot_id or 0)                                                # (2b, t)
        lengths = torch.tensor([len(p.chosen[0]) for p in pairs] + [len(p.rejected[0]) for p in pairs])
        with autocast(device, dtype):
            rewards = sequence_rewards(model, ids.to(device), lengths.to(device)).float()          # (2b,)
        return torch.stack(rewards.chunk(2), dim=1)                                                # (b, 2)

    chosen, rejected = held_out_rows(model, val, batch_size, score).unbind(1)
    return chosen, rejected


def held_out_pairs(data: PreferenceData, cfg: Any) -> list[int]:
    """The indices (into data.pairs) a reward run holds out: train.reward.val_fraction of the lines by a seeded hash
    of each line's text (train.seed). Example: held_out_pairs(data, TrainConfig(reward={"val_fraction": 0.25}))"""
    return held_out_indices(data.path, data.pairs, cfg.seed, cfg.reward.val_fraction)


@dataclass(frozen=True)
class HeldOutAccuracy:
    """A reward run's held-out accuracy (None: it holds no pairs out) and where the figure comes from, in words."""
    accuracy: float | None
    source: str


def _checkpoint_step(folder: Path) -> int | None:
    import json

    from archlab.runs.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(folder)
    return None if ckpt is None else int(json.loads((ckpt / "meta.json").read_text())["step"])


def held_out_accuracy(folder: str | Path, model: Any) -> HeldOutAccuracy:
    """The held-out accuracy (share of held-out pairs whose chosen reward is the larger) of the reward run `folder`,
    whose weights `model` holds: the val_accuracy its metrics.jsonl recorded at the step of its latest checkpoint, or,
    when it recorded none there, computed now on its held-out pairs (its prepared OUT/data and config.yaml's
    train.reward.val_fraction and seed give the same split the run held out).
    Example: held_out_accuracy("runs/rm", model).accuracy -> 0.875"""
    from archlab.runs.model_folder import read_run_config
    from archlab.training.config import TrainConfig
    from archlab.training.metrics import read_metrics

    folder = Path(folder)
    step = _checkpoint_step(folder)
    metrics = folder / "metrics.jsonl"
    recorded = [r for r in read_metrics(metrics) if "val_accuracy" in r] if metrics.is_file() else []
    if recorded and recorded[-1].get("step") == step:
        return HeldOutAccuracy(float(recorded[-1]["val_accuracy"]), f"recorded by the reward run at step {step}")
    cfg = TrainConfig.from_dict(read_run_config(folder).get("train") or {})
    data_dir = folder / "data"
    if not (data_dir / "meta.json").is_file():
        return HeldOutAccuracy(None, f"not recorded at step {step}, and {folder} holds no prepared preference data "
                               "to compute it on")
    data = open_preference_folder(data_dir, max_tokens=cfg.seq_len, truncation=cfg.reward.truncation,
                                  progress=False)
    val = held_out_pairs(data, cfg)
    if not val:
        return HeldOutAccuracy(None, f"{folder} held no pairs out (train.reward.val_fraction="
                               f"{cfg.reward.val_fraction})")
    chosen, rejected = held_out_rewards(model, data, val, cfg.batch_size, next(model.parameters()).device)
    right = int((chosen > rejected).sum())
    return HeldOutAccuracy(right / len(val), f"computed now on its {len(val)} held-out pairs (its metrics.jsonl "
                           f"records no val_accuracy at step {step})")


def _figures(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """METRICS of rewards (b,) each, as TRL's RewardTrainer computes them per batch."""
    both = torch.cat([chosen, rejected])
    return torch.stack([(chosen > rejected).float().mean(), (chosen - rejected).mean(), both.min(), both.mean(),
                        both.max()])


def open_reward(model_cfg: Any, cfg: Any, data_dir: Path, init_from: Any, info: Any, *,
                progress: bool = True) -> RewardRun:
    """The RewardRun of a prepared preference folder (archlab finetune --method reward) or a preference .jsonl
    (archlab train --init-from BASE --set train.method=reward, encoded with BASE's tokenizer); UserError before any
    write for what a reward model cannot train."""
    if info.world_size > 1 and info.strategy != "ddp":   # the score head reads hidden states outside the forward
        raise UserError(f"train.method=reward runs data-parallel with dist.strategy=ddp, not {info.strategy}")
    folder = require(data_dir, ("preference_pairs",), who="train.method=reward").folder
    if model_cfg.arch != "decoder":
        raise UserError(f"train.method=reward puts its score head on decoder models, not arch={model_cfg.arch}")
    check_pair_settings(model_cfg, cfg, info)
    reading = dict(max_tokens=cfg.seq_len, truncation=cfg.reward.truncation, progress=progress and info.is_main,
                   setting="train.reward.truncation")
    if folder:
        data = open_preference_folder(data_dir, **reading)
    else:
        if init_from is None or init_from.tokenizer_dir is None:
            raise UserError(f"train.method=reward on {data_dir} encodes it with --init-from's tokenizer: pass "
                            "--init-from RUN_OR_HF_FOLDER (or use archlab finetune BASE --method reward)")
        staged = _tokenizer_only(init_from.tokenizer_dir)      # an HF folder's tokenizer files alone
        data = load_preference_data(data_dir, staged.name if staged else init_from.tokenizer_dir, **reading)
        data.staged_tokenizer = staged                         # type: ignore[attr-defined]  # kept while it trains
    check_form(data, cfg)                                      # pairs: a prepared folder may hold KTO's lines
    if model_cfg.vocab_size < data.vocab_size:
        raise UserError(f"model vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's {data.vocab_size} "
                        f"({data.tokenizer_dir})")
    if init_from is None and info.is_main:
        warnings.warn("train.method=reward from a fresh model: a reward model is usually an SFT model with a score "
                      "head (--init-from)", stacklevel=3)
    return RewardRun(data, cfg, info, _margins(data))


METHODS.register("reward")(Method("reward", "a reward model: a scalar head, the Bradley-Terry loss on preference pairs",
                                  open_reward, prepare=prepare_preferences, fit_settings=preference_settings,
                                  data_help="preference data is a .jsonl file of prompt / chosen / rejected lines",
                                  data_formats=("preference_pairs",)))
