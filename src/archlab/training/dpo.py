"""Preference tuning on the trainer: `train.method=dpo` over a `.jsonl` of prompt / chosen / rejected lines.

    archlab train --init-from BASE --data prefs.jsonl --out runs/dpo --set train.method=dpo

The policy starts from BASE's weights. The reference is that same starting model, scored ONCE before the first
step: the summed log-probability of every line's chosen and rejected completion is written to the run folder
(REFERENCE_FILE, safetensors keyed by line, with the data file's sha256, the sha256 of the starting weights that
scored it and of its own values) and read back on --resume, so no second model is held in memory. A resume whose
--init-from holds other weights, a file scored by another model or on other data, or values edited since, is
refused: the reference must be the run's own. With LoRA (train.lora) the adapters start at zero, so the reference
is the frozen base.

Per pair, with logp the policy's summed completion log-probability, ref the reference's, n the completion tokens
and beta = train.dpo.beta, the losses of LOSSES (train.dpo.loss):

    sigmoid   -log sigmoid(beta * ((logp_c - ref_c) - (logp_r - ref_r)))           DPO, Rafailov et al. 2023
    ipo       ((logp_c - ref_c) / n_c - (logp_r - ref_r) / n_r - 1 / (2 beta))^2      IPO, Azar et al. 2023
              (per-token log-ratios, as TRL's DPOTrainer computes loss_type="ipo")
    simpo     -log sigmoid(beta * (logp_c / n_c - logp_r / n_r) - gamma)             SimPO, Meng et al. 2024,
              reference-free; gamma = train.dpo.simpo_gamma
    orpo      NLL of the chosen tokens - beta * log sigmoid(log odds(p_c) - log odds(p_r)),   ORPO, Hong et al. 2024,
              p = exp(logp / n), odds(p) = p / (1 - p); reference-free; the NLL a mean over the batch's chosen
              tokens, as TRL's ORPOTrainer computes it (each pair carries its share: -logp_c * pairs / sum n_c)

    kto       on completions judged one at a time (TRL's unpaired lines, or a pair's two sides): training/kto.py

Logged as TRL names them: rewards/chosen and rewards/rejected (the implicit reward beta * (logp - ref), batch
means), rewards/margins, rewards/accuracies (share of pairs whose chosen reward is the larger), logps/chosen,
logps/rejected. The model's z-loss and MoE auxiliary losses are not added to a preference loss.

Validation: train.dpo.val_fraction of the lines (a seeded hash of each line's text, as `archlab finetune` holds
out SFT lines) never train; at each evaluation their preference loss is `val_loss` and their rewards and log-probs
are logged with a `val_` prefix (TRL's eval_rewards/accuracies ...), over all of them on every rank. The reference
file scores every pair, held out or not.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from archlab.data.batches import SamplerState
from archlab.data.formats import require
from archlab.data.objectives import IGNORE
from archlab.data.preference import (
    LabelledCompletion,
    NoTemplateForMessages,
    PreferenceBatches,
    PreferenceData,
    labelled_completions,
    load_preference_data,
    pad_pairs,
    pad_rows,
)
from archlab.data.preference_folder import open_preference_folder
from archlab.data.prepare import held_out_indices
from archlab.errors import UserError
from archlab.eval.evaluate import autocast
from archlab.models.decoder import LossOutput
from archlab.progress import progress_bar
from archlab.runs.provenance import tensors_sha256

__all__ = ["LOSSES", "METRICS", "REFERENCE_FILE", "sequence_logps", "preference_loss", "implicit_rewards", "DPOBatches",
           "open_preference_data", "score_rows", "reference_logps", "prepare_reference", "read_reference",
           "write_reference", "read_reference_tensors", "read_preference_data", "check_form", "check_classes"]

REFERENCE_FILE = "reference_logps.safetensors"
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")     # logged as TRL's DPOTrainer names them

Loss = Callable[..., torch.Tensor]


def _sigmoid(logp_c, logp_r, ref_c, ref_r, n_c, n_r, beta, gamma) -> torch.Tensor:
    return -F.logsigmoid(beta * ((logp_c - ref_c) - (logp_r - ref_r)))


def _ipo(logp_c, logp_r, ref_c, ref_r, n_c, n_r, beta, gamma) -> torch.Tensor:
    return ((logp_c - ref_c) / n_c - (logp_r - ref_r) / n_r - 1 / (2 * beta)) ** 2


def _simpo(logp_c, logp_r, ref_c, ref_r, n_c, n_r, beta, gamma) -> torch.Tensor:
    return -F.logsigmoid(beta * (logp_c / n_c - logp_r / n_r) - gamma)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends (Maechler 2012: log1p(-exp(x)) below -ln 2, else
    log(-expm1(x)))."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _orpo(logp_c, logp_r, ref_c, ref_r, n_c, n_r, beta, gamma) -> torch.Tensor:
    mean_c, mean_r = logp_c / n_c, logp_r / n_r                          # per-token log-probs (b,)
    log_odds = (mean_c - mean_r) - (log1mexp(mean_c) - log1mexp(mean_r))
    nll = -logp_c * (n_c.numel() / n_c.sum())                             # mean over pairs = mean over chosen tokens
    return nll - beta * F.logsigmoid(log_odds)


# train.dpo.loss -> per-pair loss from (policy logps, reference logps, completion lengths, beta, gamma), all (b,)
LOSSES: dict[str, Loss] = {"sigmoid": _sigmoid, "ipo": _ipo, "simpo": _simpo, "orpo": _orpo}


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of the scored labels, number of scored labels), each (rows,), from logits (rows, t, v)
    and labels (rows, t) (slot j holds the target of position j, or IGNORE). In float32."""
    scored = labels != IGNORE                                                           # (rows, t)
    logprobs = torch.log_softmax(logits.float(), dim=-1)                                # (rows, t, v)
    picked = logprobs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)         # (rows, t)
    return (picked * scored).sum(-1), scored.sum(-1)


def preference_loss(kind: str, logp_c: torch.Tensor, logp_r: torch.Tensor, ref_c: torch.Tensor, ref_r: torch.Tensor,
                    n_c: torch.Tensor, n_r: torch.Tensor, *, beta: float, gamma: float = 0.0) -> torch.Tensor:
    """The mean over pairs of LOSSES[kind]. Example: preference_loss("sigmoid", lc, lr, rc, rr, nc, nr, beta=0.1)"""
    return LOSSES[kind](logp_c, logp_r, ref_c, ref_r, n_c, n_r, beta, gamma).mean()


def implicit_rewards(logp: torch.Tensor, ref: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO's implicit reward beta * log(pi / pi_ref) of each completion."""
    return beta * (logp - ref)


class DPOBatches(SamplerState):
    """The trainer's batches for train.method=dpo: PreferenceBatches' pairs, and the loss the trainer calls instead
    of the model's own (`loss(model, inputs, labels)` -> LossOutput) with the reference log-probs (`reference`, set
    by prepare_reference). Metrics gather between `metrics()` calls."""

    def __init__(self, data: PreferenceData, cfg: Any, *, rank: int = 0, world_size: int = 1,
                 val: list[int] | None = None):
        self.data, self.cfg = data, cfg
        self.val = sorted(val or [])                      # indices into data.pairs that never train
        held = set(self.val)
        self.sampler = PreferenceBatches(data, cfg.batch_size, seed=cfg.seed, rank=rank, world_size=world_size,
                                         pool=[i for i in range(len(data.pairs)) if i not in held] if held else None)
        self.reference: tuple[torch.Tensor, torch.Tensor] | None = None     # (chosen, rejected), (pairs,) each
        self._sums: torch.Tensor | None = None
        self._count = 0
        self.staged_tokenizer: tempfile.TemporaryDirectory | None = None
        self.reference_model: tuple[str, str] | None = None     # (--init-from, sha256 of its weights)

    def next(self, step: int, micro: int):
        return self.sampler.next(step, micro)

    def loss(self, model: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> LossOutput:
        """The preference loss of one batch (2b rows: b chosen, then b rejected) under `model`."""
        loss, metrics = self._per_pair(model, inputs["input_ids"], labels, inputs["pair_index"])
        values = metrics.mean(0)                                                         # (METRICS,)
        self._sums = values if self._sums is None else self._sums + values     # on device: no host sync per batch
        self._count += 1
        total = loss.mean()
        zero = total.new_zeros(())
        return LossOutput(total=total, ce=total.detach(), z_loss=zero, aux_loss=zero)

    def _per_pair(self, model: Any, input_ids: torch.Tensor, labels: torch.Tensor, index: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """(each pair's loss (b,), each pair's METRICS (b, 6), detached) of 2b rows (b chosen, then b rejected) under
        `model`; `index` (b,): the pairs' places in data.pairs, where the reference log-probs are."""
        assert self.reference is not None, "prepare_reference sets the reference log-probs before training"
        cfg = self.cfg
        logits = model(input_ids=input_ids)                                             # (2b, t, v)
        logps, counts = sequence_logps(logits, labels)                                  # (2b,) each
        logp_c, logp_r = logps.chunk(2)
        n_c, n_r = counts.chunk(2)
        ref_c, ref_r = (r[index.cpu()].to(logps.device) for r in self.reference)
        loss = LOSSES[cfg.dpo.loss](logp_c, logp_r, ref_c, ref_r, n_c, n_r, cfg.dpo.beta, cfg.dpo.simpo_gamma)
        logp_c, logp_r = logp_c.detach(), logp_r.detach()
        chosen, rejected = implicit_rewards(logp_c, ref_c, cfg.dpo.beta), implicit_rewards(logp_r, ref_r, cfg.dpo.beta)
        return loss, torch.stack([chosen, rejected, chosen - rejected, (chosen > rejected).float(), logp_c, logp_r],
                                 dim=1)

    def metrics(self) -> dict[str, float]:
        """The means of the logged quantities over the micro-batches since the last call."""
        out = dict(zip(METRICS, (self._sums / self._count).tolist())) if self._sums is not None else {}
        self._sums, self._count = None, 0
        return out

    @torch.no_grad()
    def evaluate(self, model: Any, *, device: torch.device, dtype: str = "float32") -> dict[str, float]:
        """The held-out pairs' preference loss (`val_loss`) and METRICS prefixed `val_`, means over every held-out
        pair (in batches of train.batch_size pairs); {} without held-out pairs.
        Example: batches.evaluate(model, device=torch.device("cpu"))["val_rewards/accuracies"] -> 0.75"""
        if not self.val:
            return {}

        def score(index: torch.Tensor) -> torch.Tensor:
            ids, labels = pad_pairs([self.data.pairs[i] for i in index], self.data.eot_id or 0)   # (2b, t)
            with autocast(device, dtype):
                loss, metrics = self._per_pair(model, ids.to(device), labels.to(device), index)
            return torch.cat([loss[:, None], metrics], dim=1)                                  # (b, 7)

        means = held_out_rows(model, self.val, self.cfg.batch_size, score).mean(0).tolist()      # (7,)
        return {"val_loss": means[0], **{f"val_{name}": value for name, value in zip(METRICS, means[1:])}}


def held_out_rows(model: torch.nn.Module, val: list[int], batch_size: int,
                  score: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`score(index)` ((b,) held-out indices -> (b, k) figures) over `val` in batches of `batch_size`, with `model`
    in eval mode (its mode restored after): (len(val), k) on the CPU."""
    was_training = model.training
    model.eval()
    parts: list[torch.Tensor] = []
    try:
        for start in range(0, len(val), batch_size):
            parts.append(score(torch.tensor(val[start:start + batch_size])).cpu())
    finally:
        model.train(was_training)
    return torch.cat(parts)


def read_preference_data(model_cfg: Any, cfg: Any, data_path: Path, init_from: Any, info: Any, *,
                         progress: bool = True) -> tuple[PreferenceData, tempfile.TemporaryDirectory | None]:
    """The preference data of `data_path` for the DPO family: a prepared preference folder (archlab finetune --method
    dpo: its own tokenizer), or a .jsonl encoded with the --init-from source's tokenizer (then also the temporary
    folder of that tokenizer alone, kept while the run trains); a UserError for data or settings the family cannot
    train, before anything is written."""
    folder = require(data_path, ("preference_pairs", "unpaired_preferences"), who=f"train.method={cfg.method}").folder
    if model_cfg.arch != "decoder":
        raise UserError(f"train.method=dpo trains decoder models, not arch={model_cfg.arch}")
    if init_from is None:
        raise UserError("train.method=dpo starts from a trained model: pass --init-from RUN_OR_HF_FOLDER (its "
                        "weights begin the policy and score the reference)")
    if init_from.tokenizer_dir is None and not folder:
        raise UserError(f"--init-from {init_from.spec} holds no tokenizer to encode {data_path} with")
    check_pair_settings(model_cfg, cfg, info)
    if (model_cfg.attention.dropout or model_cfg.block.residual_dropout or model_cfg.embedding_dropout) \
            and info.is_main:
        warnings.warn("dropout is on: the policy's log-probs are noisy against the reference's (scored without "
                      "dropout), so the first loss is not ln 2; TRL's DPOTrainer turns dropout off",
                      stacklevel=3)
    staged = None
    reading = dict(max_tokens=cfg.seq_len, truncation=cfg.dpo.truncation, progress=progress and info.is_main,
                   setting="train.dpo.truncation")
    if folder:                                  # its own tokenizer, template inside
        data = open_preference_folder(data_path, **reading)
    else:
        staged = _tokenizer_only(init_from.tokenizer_dir)
        try:
            data = load_preference_data(data_path, staged.name if staged else init_from.tokenizer_dir, **reading)
        except NoTemplateForMessages as exc:
            raise UserError(f"{exc.where}: these lines are chat messages and --init-from {init_from.spec} has no "
                            f"chat template: fine-tune it first with one (archlab finetune {init_from.spec} --data "
                            "SFT.jsonl --chat-template chatml --out SFT_RUN), then --init-from SFT_RUN; or write "
                            "prompt, chosen and rejected as plain text") from None
    if model_cfg.vocab_size < data.vocab_size:
        raise UserError(f"model vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's "
                        f"{data.vocab_size} ({data.tokenizer_dir})")
    return data, staged


def open_preference_data(model_cfg: Any, cfg: Any, data_path: Path, init_from: Any, info: Any, *,
                         progress: bool = True) -> DPOBatches:
    """The DPO batches of `data_path` (read_preference_data reads and checks it); pairs only: unpaired lines are
    KTO's (training/kto.py)."""
    data, staged = read_preference_data(model_cfg, cfg, data_path, init_from, info, progress=progress)
    check_form(data, cfg)
    batches = DPOBatches(data, cfg, rank=info.rank, world_size=info.world_size, val=held_out(data, cfg))
    batches.staged_tokenizer = staged           # removed with the batches, after the run folder has its copy
    batches.reference_model = (init_from.spec, tensors_sha256(init_from.state))     # what scores the reference
    return batches


def check_form(data: PreferenceData, cfg: Any) -> None:
    """Preference data the run's method and loss can train on: unpaired lines only with train.dpo.loss=kto, and KTO
    with desirable and undesirable completions; a UserError naming the file otherwise."""
    kto = cfg.method == "dpo" and cfg.dpo.loss == "kto"
    if data.unpaired and not kto:
        who = "train.method=reward" if cfg.method == "reward" else f"train.dpo.loss={cfg.dpo.loss}"
        raise UserError(f"{data.path} holds unpaired preferences (prompt, completion, label): {who} needs pairs "
                        "(prompt, chosen, rejected); KTO trains on unpaired lines (--set train.dpo.loss=kto)")
    if kto:
        check_classes(labelled_completions(data), f"{data.path}'s lines")


def check_classes(examples: list[LabelledCompletion], where: str) -> None:
    """KTO learns from both kinds of completion: a UserError naming `where` when all are desirable or none is."""
    kinds = {e.desirable for e in examples}
    if len(kinds) < 2:
        only = "desirable (label true)" if kinds == {True} else "undesirable (label false)"
        raise UserError(f"{where} hold only {only} completions: KTO (train.dpo.loss=kto) needs both")


def check_pair_settings(model_cfg: Any, cfg: Any, info: Any) -> None:
    """The settings every method on preference pairs needs (a UserError naming the one that fails): seq_len within a
    learned position table, a global batch the ranks divide, a budget in steps or minutes."""
    if model_cfg.position.kind == "learned" and cfg.seq_len > model_cfg.max_seq_len:
        raise UserError(f"train.seq_len={cfg.seq_len} exceeds max_seq_len={model_cfg.max_seq_len}")
    if cfg.batch_size % info.world_size:
        raise UserError(f"train.batch_size={cfg.batch_size} (global) must be divisible by the world size "
                        f"{info.world_size}")
    if cfg.budget_unit == "tokens":
        raise UserError("train.budget_unit=tokens counts fixed windows; preference pairs have every length: give "
                        "the budget in steps or minutes")


def held_out(data: PreferenceData, cfg: Any) -> list[int]:
    """The indices of the pairs held out for validation: train.dpo.val_fraction of the lines by a seeded hash of each
    line's text (train.seed), as archlab finetune holds out SFT lines; with two or more pairs neither side is empty.
    Example: held_out(data, TrainConfig(dpo={"val_fraction": 0.25})) -> [3, 9, 17] (indices into data.pairs)"""
    return held_out_indices(data.path, data.pairs, cfg.seed, cfg.dpo.val_fraction)


def _tokenizer_only(folder: Path) -> tempfile.TemporaryDirectory | None:
    """For an HF model folder, a temporary folder of its tokenizer files alone (the run folder copies the data's
    tokenizer folder whole, and must not copy the weights); None for a tokenizer folder (a run's tokenizer/)."""
    from archlab.runs.hub import MODEL_FILES

    if not (folder / "config.json").is_file():
        return None
    staged = tempfile.TemporaryDirectory(prefix="archlab-tokenizer-")
    for pattern in (p for p in MODEL_FILES if "safetensors" not in p and p != "config.json"):
        for path in folder.glob(pattern):
            target = Path(staged.name) / path.relative_to(folder)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
    return staged


@torch.no_grad()
def score_rows(model: torch.nn.Module, rows: list[tuple[list[int], list[int]]], *, batch_size: int, pad_id: int,
               device: torch.device, dtype: str = "float32", progress: bool = True) -> torch.Tensor:
    """The summed scored log-probability (n,) of each (ids, labels) row under `model` in eval mode (its mode restored
    after), float32 on the CPU, in batches of `batch_size` rows right-padded with `pad_id`: how the DPO family scores
    its reference. Example: score_rows(model, [(ids, labels)], batch_size=8, pad_id=0, device=torch.device("cpu"))"""
    was_training = model.training
    model.eval()
    out: list[torch.Tensor] = []
    bar = progress_bar(total=len(rows), desc="reference log-probs", unit=" rows", disable=not progress)
    try:
        for start in range(0, len(rows), batch_size):
            ids, labels = pad_rows(rows[start:start + batch_size], pad_id)                      # (b, t) each
            with autocast(device, dtype):
                logits = model(input_ids=ids.to(device))                                      # (b, t, v)
            out.append(sequence_logps(logits, labels.to(device))[0].float().cpu())            # (b,)
            bar.update(ids.shape[0])
    finally:
        bar.close()
        model.train(was_training)
    return torch.cat(out)


def reference_logps(model: torch.nn.Module, data: PreferenceData, *, batch_size: int, device: torch.device,
                    dtype: str = "float32", progress: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed completion log-probabilities of every pair under `model` (eval mode), (pairs,)
    each, in float32, in the order of data.pairs; `batch_size` pairs (2 * batch_size rows) a forward."""
    rows = [p.chosen for p in data.pairs] + [p.rejected for p in data.pairs]        # chosen, then rejected
    both = score_rows(model, rows, batch_size=2 * batch_size, pad_id=data.eot_id or 0, device=device, dtype=dtype,
                      progress=progress)                                              # (2 * pairs,)
    chosen, rejected = both.chunk(2)
    return chosen.contiguous(), rejected.contiguous()


def write_reference(path: Path, data: Any, reference_model: tuple[str, str] | None,
                    tensors: dict[str, torch.Tensor]) -> None:
    """The reference log-probs `tensors` (a "line" tensor naming each row's line among them) to `path`, atomically,
    with the data file's sha256, the source and sha256 of the starting weights that scored them, and their own
    sha256 (read_reference_tensors checks all three)."""
    from safetensors.torch import save_file

    source, weights = reference_model or ("", "")
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"data_sha256": data.fingerprint, "data": str(data.path),
                                           "model": source, "model_sha256": weights,
                                           "values_sha256": tensors_sha256(tensors)})
    os.replace(tmp, path)


def read_reference_tensors(run_dir: Path, data: Any, reference_model: tuple[str, str] | None,
                           expected: dict[str, list]) -> dict[str, torch.Tensor]:
    """The run folder's stored reference tensors, refused (a UserError naming why) unless they are this run's: scored
    on this data (the data's sha256, and the identity tensors `expected`, e.g. {"line": [...]}, as stored), by the
    weights --init-from holds now (reference_model: its source and sha256), with the values they were written with."""
    from safetensors import safe_open

    path = run_dir / REFERENCE_FILE
    if not path.is_file():
        raise UserError(f"cannot resume {path.parent}: {path.name} (the reference log-probs, written before the "
                        "first step) is missing, and the starting weights are gone: start a new run")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {name: f.get_tensor(name) for name in f.keys()}      # noqa: SIM118  (safe_open has no iterator)
    if meta.get("data_sha256") != data.fingerprint or any(
            name not in tensors or tensors[name].tolist() != values for name, values in expected.items()):
        raise UserError(f"cannot resume {path.parent}: its reference log-probs score {meta.get('data')}, and "
                        f"--data {data.path} holds other lines")
    if meta.get("values_sha256") != tensors_sha256(tensors):
        raise UserError(f"cannot resume {path.parent}: {path} does not hold the values it was written with (edited, "
                        "damaged, or from an earlier archlab without a checksum): start a new run")
    source, weights = reference_model or ("", "")
    if meta.get("model_sha256") != weights:
        raise UserError(f"cannot resume {path.parent}: its reference log-probs were scored by the weights of "
                        f"{meta.get('model') or 'another model'}, and --init-from {source} holds other weights: "
                        "resume with the --init-from the run started from")
    return tensors


def read_reference(run_dir: Path, batches: DPOBatches) -> tuple[torch.Tensor, torch.Tensor]:
    """The run folder's stored reference log-probs (chosen, rejected), refused (a UserError naming why) unless they
    are this run's: scored on this data, by the weights --init-from holds now, with the values they were written
    with. Example: read_reference(Path("runs/dpo"), batches) -> ((pairs,), (pairs,))"""
    tensors = read_reference_tensors(run_dir, batches.data, batches.reference_model,
                                     {"line": [p.line for p in batches.data.pairs]})
    return tensors["chosen"], tensors["rejected"]


def prepare_reference(batches: DPOBatches, model: torch.nn.Module, run_dir: Path, *, device: torch.device,
                      dtype: str, info: Any, resuming: bool, progress: bool = True) -> None:
    """Set batches.reference: scored now from `model` (the starting weights) and written to the run folder by rank
    0, or, resuming, read back from it."""
    path = run_dir / REFERENCE_FILE
    if not resuming:
        chosen, rejected = reference_logps(model, batches.data, batch_size=batches.cfg.batch_size, device=device,
                                           dtype=dtype, progress=progress and info.is_main)
        if not (torch.isfinite(chosen).all() and torch.isfinite(rejected).all()):
            raise UserError("the starting model gives a non-finite log-probability to a completion: no reference")
        if info.is_main:
            lines = torch.tensor([p.line for p in batches.data.pairs], dtype=torch.long)
            write_reference(path, batches.data, batches.reference_model,
                            {"line": lines, "chosen": chosen, "rejected": rejected})
        if info.enabled:
            torch.distributed.barrier()
    else:
        chosen, rejected = read_reference(run_dir, batches)
    batches.reference = (chosen, rejected)

