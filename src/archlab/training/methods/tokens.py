"""The methods that train on a prepared folder with the model's own loss: `pretrain` (a token stream through
train.objective's objective, or source/target pairs) and `sft` (chat examples from archlab finetune). Their batches
are data.batches.TrainBatches; their evaluation the validation split's loss (eval.evaluate)."""
from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import torch

from archlab.config import ConfigError
from archlab.data.batches import TrainBatches, open_splits
from archlab.data.seq2seq import Seq2SeqDataset
from archlab.data.sft import SFTDataset
from archlab.eval.evaluate import evaluate
from archlab.training.methods.base import METHODS, Method

__all__ = ["TokenRun", "open_tokens"]


class TokenRun:
    """A prepared folder's splits, their batches and the model's own loss (LossOutput of forward(targets=...))."""

    def __init__(self, model_cfg: Any, cfg: Any, data_dir: Path, info: Any, init_from: Any = None):
        self.cfg, self.info = cfg, info
        self.train_data, self.val_data = open_splits(data_dir)      # a token stream, pairs, or SFT examples
        if init_from is not None and model_cfg.vocab_size < self.train_data.vocab_size:
            # another tokenizer's data: say so (and which), not that the model's vocabulary is too small
            init_from.check_tokenizer(data_dir / self.train_data.meta.get("tokenizer", "tokenizer"), data_dir)
        self.can_eval = _check_data(model_cfg, cfg, data_dir, self.train_data, self.val_data, info)
        # the objective and the sampler, built before the run folder is touched: a setting this data cannot train
        # (no sentinels, no sentence index, pairs too long) is an error that leaves nothing behind
        self.batches = TrainBatches(model_cfg, cfg, self.train_data, rank=info.rank, world_size=info.world_size)
        self.eval_objective = self.batches.objective_on(self.val_data) if self.can_eval else None
        self.tokenizer_dir: Path | None = data_dir / getattr(self.train_data, "meta", {}).get("tokenizer", "tokenizer")

    def loss(self, model: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> Any:
        return model(**inputs, targets=labels)

    def log_fields(self) -> dict[str, float]:
        return {}

    def evaluate(self, model: Any, *, device: torch.device, dtype: str, info: Any) -> dict[str, float]:
        """val_loss, val_ppl (and val_bpb, val_mlm_accuracy, val_nsp_* where they mean something)."""
        if not self.can_eval:
            return {}
        cfg = self.cfg
        result = evaluate(model, self.val_data, batch_size=cfg.batch_size,  # whole batches split over ranks
                          seq_len=cfg.seq_len, max_batches=cfg.eval.batches, device=device, dtype=dtype,
                          dist_info=info, objective=self.eval_objective)
        record = {"val_loss": result.loss, "val_ppl": result.ppl}
        if math.isfinite(result.bpb):                # the loss is a code length of the text
            record["val_bpb"] = result.bpb
        if result.accuracy is not None:
            record["val_mlm_accuracy"] = result.accuracy
        if result.nsp_accuracy is not None and result.nsp_loss is not None:
            record.update(val_nsp_loss=result.nsp_loss, val_nsp_accuracy=result.nsp_accuracy)
        return record

    def extend(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {}

    def start(self, model: torch.nn.Module, run_dir: Path, **_: Any) -> None:
        return None

    def check_resume(self, run_dir: Path) -> None:
        return None


def _check_data(model_cfg, cfg, data_dir, train_data, val_data, info) -> bool:
    """Raises ConfigError for settings this data cannot train. Returns whether the val split is long
    enough to evaluate (warning when it is not)."""
    if model_cfg.vocab_size < train_data.vocab_size:
        raise ConfigError(f"model vocab_size={model_cfg.vocab_size} is smaller than the data's "
                          f"vocab_size={train_data.vocab_size} ({data_dir}, prepared with a tokenizer of "
                          f"{train_data.vocab_size} tokens): --set vocab_size={train_data.vocab_size} (in Python "
                          f"archlab.training.trainer.fit_vocab), or prepare the data with the model's tokenizer")
    if model_cfg.position.kind == "learned" and cfg.seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"train.seq_len={cfg.seq_len} exceeds max_seq_len={model_cfg.max_seq_len}")
    if cfg.batch_size % info.world_size:
        raise ConfigError(f"train.batch_size={cfg.batch_size} (global) must be divisible by the "
                          f"world size {info.world_size}")
    if isinstance(val_data, (Seq2SeqDataset, SFTDataset)):
        if cfg.budget_unit == "tokens":
            raise ConfigError("train.budget_unit=tokens counts fixed windows; paired data and chat examples have "
                              "rows of every length: give the budget in steps or minutes")
        can_eval, why = len(val_data) > 0, "validation split has no examples"
    else:                                              # a token stream
        can_eval = val_data.n_tokens >= cfg.seq_len + 1
        why = f"validation split has {val_data.n_tokens} tokens < seq_len + 1"
    if not can_eval and info.is_main:
        warnings.warn(f"{why}: no evaluation", stacklevel=4)
    return can_eval


def open_tokens(model_cfg: Any, cfg: Any, data_dir: Path, init_from: Any, info: Any, *,
                progress: bool = True) -> TokenRun:
    """The TokenRun of a prepared folder (archlab data prepare, or archlab finetune's OUT/data)."""
    return TokenRun(model_cfg, cfg, data_dir, info, init_from)


METHODS.register("pretrain")(Method("pretrain", "next-token (or the objective's) loss on a token stream", open_tokens,
                                    data_formats=("token_stream", "seq2seq_pairs", "chat_examples")))
