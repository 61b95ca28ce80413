"""KTO (Ethayarajh et al. 2024) as a DPO-family loss: `train.dpo.loss=kto`, on completions judged one at a time.

    archlab finetune runs/sft --method dpo --data prefs.jsonl --out runs/kto --set train.dpo.loss=kto

The data: TRL's unpaired lines {"prompt", "completion", "label": true|false}, or preference pairs unpaired as TRL
unpairs them (each chosen side desirable, each rejected side undesirable; data/preference.labelled_completions).
The reference is the starting model, scored once before the first step as DPO's is (dpo.REFERENCE_FILE, refused on a
resume unless it is the run's own). Per completion y of prompt x, with r = log pi(y|x) - log pi_ref(y|x) (summed over
the completion's tokens), beta = train.dpo.beta, and the weights train.dpo.desirable_weight / undesirable_weight:

    desirable     desirable_weight   * (1 - sigmoid(beta * (r - z)))       Eq. (7) of the paper, as TRL's
    undesirable   undesirable_weight * (1 - sigmoid(beta * (z - r)))       KTOTrainer computes it (loss_type="kto")
    loss          the mean over the batch's completions

z, the reference point, estimates KL(pi || pi_ref) from mismatched prompt/completion pairs: every completion i has a
KL row, its prompt with completion i - 1's completion (the file's order, wrapping round; TRL rotates each batch's
completions by one), scored by the policy and by the reference (stored with the reference log-probs); z is the mean
over the batch of their difference, detached and clamped at 0 (under DDP the mean over ranks, as TRL gathers it).
TRL draws its batches in order so that a batch's KL rows reuse the batch's own completions; archlab draws shuffled
batches, so they are completions of other lines of the same file: the same estimate of the same KL.

Logged as TRL's KTOTrainer names them: rewards/chosen and rewards/rejected (beta * r, means over the batch's desirable
and undesirable completions; a batch without one logs none of it), rewards/margins (their difference, when both),
logps/chosen, logps/rejected, kl (z). Held out (train.dpo.val_fraction of the lines): val_loss and the same names with
a `val_` prefix, with one z over all the held-out KL rows.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from archlab.data.batches import SamplerState
from archlab.data.objectives import IGNORE
from archlab.data.preference import (
    LabelledCompletion,
    PreferenceBatches,
    PreferenceData,
    labelled_completions,
    pad_rows,
)
from archlab.data.prepare import held_out_indices
from archlab.errors import UserError
from archlab.eval.evaluate import autocast
from archlab.models.decoder import LossOutput
from archlab.runs.provenance import tensors_sha256
from archlab.training import dpo

__all__ = ["METRICS", "kl_rows", "kto_kl", "kto_losses", "KTOBatches", "open_kto_data", "prepare_reference",
           "read_reference"]

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")

Row = tuple[list[int], list[int]]


def kl_rows(examples: list[LabelledCompletion], max_tokens: int | None = None) -> list[Row]:
    """(ids, labels) of each completion's KL row: its prompt followed by the completion of the example before it
    (the last one's for the first), scored on that completion only; cut to `max_tokens` (its end dropped).
    Example: kl_rows([a, b, c]) -> [a's prompt + c's completion, b's prompt + a's, c's prompt + b's]"""
    out = []
    for i, example in enumerate(examples):
        other = examples[i - 1]
        p, q = example.prompt_len, other.prompt_len
        ids = example.ids[:p] + other.ids[q:]
        labels = [IGNORE] * (p - 1) + other.labels[q - 1:]              # slot j scores ids[j + 1]
        if max_tokens is not None and len(ids) > max_tokens:
            ids, labels = ids[:max_tokens], labels[:max_tokens - 1] + [IGNORE]
        out.append((ids, labels))
    return out


def kto_kl(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """KTO's reference point z: the mean of the KL rows' log-ratios (n,), detached, clamped at 0 (a 0-d tensor)."""
    return (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)


def kto_losses(logps: torch.Tensor, ref: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor, *, beta: float,
               desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> torch.Tensor:
    """Each completion's weighted KTO loss (n,) from its summed log-probs under the policy and the reference (n,),
    whether it is desirable (n,) bool, and z (0-d). Example: kto_losses(lp, ref, flags, kto_kl(kp, kr), beta=0.1)"""
    logratio = logps - ref                                                               # (n,)
    return torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (logratio - kl))),
                       undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratio))))


def _figures(logps: torch.Tensor, ref: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor, beta: float
             ) -> dict[str, torch.Tensor]:
    """METRICS of a batch of completions (detached), as TRL's KTOTrainer computes them per batch; a class the batch
    lacks leaves its names (and rewards/margins) out."""
    rewards = beta * (logps - ref).detach()
    out: dict[str, torch.Tensor] = {"kl": kl}
    for side, mask in (("chosen", desirable), ("rejected", ~desirable)):
        if bool(mask.any()):
            out[f"rewards/{side}"] = rewards[mask].mean()
            out[f"logps/{side}"] = logps.detach()[mask].mean()
    if "rewards/chosen" in out and "rewards/rejected" in out:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out


class _RowBatches(PreferenceBatches):
    """PreferenceBatches' shuffled draws over labelled completions: each batch is b completions, then their b KL rows
    (2b rows, right-padded); inputs {"input_ids": (2b, t), "attention_mask": (2b, t), "example_index": (b,)}."""

    def __init__(self, data: PreferenceData, rows: list[Row], kl: list[Row], batch_size: int, *, seed: int, rank: int,
                 world_size: int, pool: list[int]):
        super().__init__(data, batch_size, seed=seed, rank=rank, world_size=world_size, pool=pool)
        self.rows, self.kl = rows, kl

    def next(self, step: int, micro: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        index = self.indices(self.draws)
        self.draws += 1
        rows = [self.rows[i] for i in index] + [self.kl[i] for i in index]
        ids, labels = pad_rows(rows, self.data.eot_id or 0)                               # (2b, t) each
        lengths = torch.tensor([len(r[0]) for r in rows])                                  # (2b,)
        real = (torch.arange(ids.shape[1]) < lengths[:, None]).long()                      # (2b, t)
        return {"input_ids": ids, "attention_mask": real, "example_index": torch.tensor(index)}, labels


class KTOBatches(SamplerState):
    """The trainer's batches for train.dpo.loss=kto: labelled completions and their KL rows, the KTO loss against the
    reference log-probs (`reference`: (completions, KL rows), (n,) each, set by prepare_reference), TRL's figures."""

    def __init__(self, data: PreferenceData, cfg: Any, *, rank: int = 0, world_size: int = 1):
        self.data, self.cfg, self.world_size = data, cfg, world_size
        self.examples = labelled_completions(data)
        self.rows: list[Row] = [(e.ids, e.labels) for e in self.examples]
        self.kl = kl_rows(self.examples, cfg.seq_len)
        self.desirable = torch.tensor([e.desirable for e in self.examples])             # (n,) bool
        # train.dpo.val_fraction of the lines, as DPO holds out pairs: a pair's two sides share a line, and go together
        self.val = held_out_indices(data.path, self.examples, cfg.seed, cfg.dpo.val_fraction)
        held = set(self.val)
        pool = [i for i in range(len(self.examples)) if i not in held]
        where = f"{data.path}: the lines that train (train.dpo.val_fraction={cfg.dpo.val_fraction} holds the rest out)"
        dpo.check_classes([self.examples[i] for i in pool], where)
        self.sampler = _RowBatches(data, self.rows, self.kl, cfg.batch_size, seed=cfg.seed, rank=rank,
                                   world_size=world_size, pool=pool)
        self.reference: tuple[torch.Tensor, torch.Tensor] | None = None
        self.reference_model: tuple[str, str] | None = None     # (--init-from, sha256 of its weights)
        self.staged_tokenizer: Any = None
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}

    def next(self, step: int, micro: int):
        return self.sampler.next(step, micro)

    def _scored(self, model: Any, input_ids: torch.Tensor, labels: torch.Tensor, index: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(policy log-probs (b,), the KL rows' log-ratios (b,) detached, reference log-probs (b,), desirable (b,))
        of 2b rows (b completions, then their KL rows)."""
        assert self.reference is not None, "prepare_reference sets the reference log-probs before training"
        logps, _ = dpo.sequence_logps(model(input_ids=input_ids), labels)                  # (2b,)
        logps, kl_logps = logps.chunk(2)
        where = index.cpu()
        ref, ref_kl = (r[where].to(logps.device) for r in self.reference)
        return logps, kl_logps.detach() - ref_kl, ref, self.desirable[where].to(logps.device)

    def loss(self, model: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> LossOutput:
        """The mean KTO loss of one batch under `model`; z from this batch's KL rows (all ranks' under DDP)."""
        cfg = self.cfg.dpo
        logps, kl_ratio, ref, desirable = self._scored(model, inputs["input_ids"], labels, inputs["example_index"])
        kl = kl_ratio.mean()
        if self.world_size > 1 and torch.distributed.is_initialized():      # TRL: gather_for_metrics(kl).mean()
            torch.distributed.all_reduce(kl)
            kl = kl / self.world_size
        kl = kl.clamp(min=0)
        losses = kto_losses(logps, ref, desirable, kl, beta=cfg.beta, desirable_weight=cfg.desirable_weight,
                            undesirable_weight=cfg.undesirable_weight)
        for name, value in _figures(logps, ref, desirable, kl, cfg.beta).items():
            self._sums[name] = value + self._sums[name] if name in self._sums else value   # on device: no sync
            self._counts[name] = self._counts.get(name, 0) + 1
        total = losses.mean()
        zero = total.new_zeros(())
        return LossOutput(total=total, ce=total.detach(), z_loss=zero, aux_loss=zero)

    def metrics(self) -> dict[str, float]:
        """The means of the logged figures over the micro-batches since the last call that had them (TRL's lists)."""
        out = {name: float(self._sums[name]) / self._counts[name] for name in METRICS if name in self._sums}
        self._sums, self._counts = {}, {}
        return out

    @torch.no_grad()
    def evaluate(self, model: Any, *, device: torch.device, dtype: str = "float32") -> dict[str, float]:
        """val_loss and METRICS prefixed `val_` over every held-out completion, z from all their KL rows; {} without
        held-out lines. Example: batches.evaluate(model, device=torch.device("cpu"))["val_kl"] -> 0.0"""
        if not self.val:
            return {}

        def score(index: torch.Tensor) -> torch.Tensor:
            rows = [self.rows[i] for i in index] + [self.kl[i] for i in index]
            ids, labels = pad_rows(rows, self.data.eot_id or 0)                                      # (2b, t)
            with autocast(device, dtype):
                scored = self._scored(model, ids.to(device), labels.to(device), index)
            return torch.stack([s.float() for s in scored], dim=1)                                   # (b, 4)

        parts = dpo.held_out_rows(model, self.val, self.cfg.batch_size, score)                       # (val, 4)
        logps, kl_ratio, ref, desirable = parts.unbind(1)                               # (val,) each
        cfg = self.cfg.dpo
        kl = kl_ratio.mean().clamp(min=0)
        desirable = desirable.bool()
        losses = kto_losses(logps, ref, desirable, kl, beta=cfg.beta, desirable_weight=cfg.desirable_weight,
                            undesirable_weight=cfg.undesirable_weight)
        figures = _figures(logps, ref, desirable, kl, cfg.beta)
        return {"val_loss": float(losses.mean()), **{f"val_{k}": float(figures[k]) for k in METRICS if k in figures}}


def warn_imbalance(examples: list[LabelledCompletion], cfg: Any) -> None:
    """TRL's warning when the classes' sizes differ and neither weight is in the range Eq. (8) of the paper
    suggests (desirable_weight * n_desirable / (undesirable_weight * n_undesirable) in [1, 4/3])."""
    n_d = max(sum(e.desirable for e in examples), 1)
    n_u = max(len(examples) - n_d, 1)
    d, u = cfg.dpo.desirable_weight, cfg.dpo.undesirable_weight
    if n_d == n_u:
        return
    d_low, d_high = round(n_u * u / n_d, 2), round(n_u * u / n_d * 1.33, 2)
    u_low, u_high = round(n_d * d / n_u / 1.33, 2), round(n_d * d / n_u, 2)
    if not (d_low <= d <= d_high or u_low <= u <= u_high):
        warnings.warn(f"{n_d} desirable and {n_u} undesirable completions: set EITHER train.dpo.desirable_weight in "
                      f"[{d_low}, {d_high}] or train.dpo.undesirable_weight in [{u_low}, {u_high}] (TRL's advice, "
                      "from Eq. (8) of the KTO paper)", stacklevel=3)


def open_kto_data(model_cfg: Any, cfg: Any, data_path: Path, init_from: Any, info: Any, *,
                  progress: bool = True) -> KTOBatches:
    """The KTO batches of `data_path` (a prepared preference folder, or a .jsonl encoded with --init-from's tokenizer,
    as DPO reads it); a UserError for data KTO cannot train, before anything is written."""
    data, staged = dpo.read_preference_data(model_cfg, cfg, data_path, init_from, info, progress=progress)
    dpo.check_form(data, cfg)
    batches = KTOBatches(data, cfg, rank=info.rank, world_size=info.world_size)
    if info.is_main:
        warn_imbalance(batches.examples, cfg)
    batches.staged_tokenizer = staged
    batches.reference_model = (init_from.spec, tensors_sha256(init_from.state))
    return batches


def reference_logps(model: torch.nn.Module, batches: KTOBatches, *, device: torch.device, dtype: str = "float32",
                    progress: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(completions, KL rows) summed log-probabilities under `model` (eval mode), (n,) each, float32."""
    both = dpo.score_rows(model, batches.rows + batches.kl, batch_size=batches.cfg.batch_size,
                          pad_id=batches.data.eot_id or 0, device=device, dtype=dtype, progress=progress)   # (2n,)
    logps, kl_logps = both.chunk(2)
    return logps.contiguous(), kl_logps.contiguous()


def _identity(batches: KTOBatches) -> dict[str, list]:
    return {"line": [e.line for e in batches.examples], "desirable": [int(e.desirable) for e in batches.examples]}


def read_reference(run_dir: Path, batches: KTOBatches) -> tuple[torch.Tensor, torch.Tensor]:
    """The run folder's stored reference log-probs (completions, KL rows), refused unless they are this run's
    (dpo.read_reference_tensors says why)."""
    tensors = dpo.read_reference_tensors(run_dir, batches.data, batches.reference_model, _identity(batches))
    return tensors["logps"], tensors["kl_logps"]


def prepare_reference(batches: KTOBatches, model: torch.nn.Module, run_dir: Path, *, device: torch.device,
                      dtype: str, info: Any, resuming: bool, progress: bool = True) -> None:
    """Set batches.reference: scored now from `model` (the starting weights) and written to the run folder by rank
    0, or, resuming, read back from it."""
    if resuming:
        batches.reference = read_reference(run_dir, batches)
        return
    logps, kl_logps = reference_logps(model, batches, device=device, dtype=dtype, progress=progress and info.is_main)
    if not (torch.isfinite(logps).all() and torch.isfinite(kl_logps).all()):
        raise UserError("the starting model gives a non-finite log-probability to a completion: no reference")
    if info.is_main:
        identity = {k: torch.tensor(v, dtype=torch.long) for k, v in _identity(batches).items()}
        dpo.write_reference(run_dir / dpo.REFERENCE_FILE, batches.data, batches.reference_model,
                            {**identity, "logps": logps, "kl_logps": kl_logps})
    if info.enabled:
        torch.distributed.barrier()
    batches.reference = (logps, kl_logps)
