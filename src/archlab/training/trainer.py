"""The training loop: `train()` runs one model config on one prepared data folder into a run folder.

    result = train(model_cfg, train_cfg, data_dir, out_dir, resume=False)

The pieces it wires together live beside it: TrainConfig (config.py), AdamW groups and LR schedules
(optim.py), metrics.jsonl and the loss curve (metrics.py), FLOPs and peak memory for MFU (throughput.py), RNG
states (rng.py), DDP/FSDP (distributed.py), the device, precision and memory check (placement.py), what a step
trains on and scores (methods/); and below it: checkpoints and the run folder (archlab.runs.checkpoint,
archlab.runs.model_folder), validation (archlab.eval.evaluate).

- Gradient clipping by global norm, gradient accumulation, bf16 autocast, torch.compile opt-in.
- Loss = LossOutput.total of the model (cross-entropy + z-loss + MoE auxiliary losses).
- Budget in optimizer steps, tokens or minutes of wall time. With a minutes budget the schedule
  follows elapsed time (so LR, and hence losses, are not bit-reproducible across runs).
- `batch_size` is GLOBAL (sequences per micro-step summed over data-parallel ranks): the same config
  trains the same model on 1 or N processes; tokens per optimizer step = batch_size*grad_accum*seq_len.
- Checkpoints (archlab.runs.checkpoint) hold weights, optimizer, counters, RNG states and the sampler
  position: `resume=True` continues step for step as if never interrupted (tested on CPU with kill -9).
- A NaN/Inf loss or gradient norm raises `Diverged` (optimizer.nan_policy="stop") naming the step and the last
  good checkpoint, or skips that step's update (optimizer.nan_policy="skip"; 10 in a row still raise).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from archlab.config import ModelConfig
from archlab.data.batches import tokens_processed
from archlab.errors import SignalStop
from archlab.eval.evaluate import autocast, sample_ids
from archlab.generation.stepper import vocab_limit
from archlab.models.accounting import MemoryCheckError
from archlab.models.decoder import moe_balance_step, moe_load_fields
from archlab.models.legacy_keys import upgrade_keys, upgrade_optimizer_state
from archlab.runs import checkpoint as ckpt_io
from archlab.runs import model_folder
from archlab.runs.lock import RunLock
from archlab.runs.provenance import check_resume_matches, data_fingerprint, provenance, write_provenance
from archlab.training import distributed as dist_util
from archlab.training import lora as lora_stage
from archlab.training.config import TrainConfig
from archlab.training.init_from import InitSource
from archlab.training.loglines import LogLines
from archlab.training.methods import MethodRun, open_run
from archlab.training.metrics import (
    TensorBoardLogger,
    append_jsonl,
    plot_loss_curve,
    read_metrics,
    truncate_metrics,
    truncate_samples,
)
from archlab.training.optim import build_optimizer, lr_multiplier, param_groups, schedule_progress, warmup_shortfall
from archlab.training.placement import (
    check_memory_fits,
    device_kind,
    memory_per_device,
    resolve_device,
    resolve_precision,
    warn_past_context,
)
from archlab.training.rng import rng_state, seed_everything, set_rng_state
from archlab.training.throughput import CpuShare, busy_note, matmul_peak_flops, peak_memory, train_flops_per_token

# re-exported: callers import these from archlab.training.trainer
__all__ = ["TrainConfig", "TrainResult", "Diverged", "Stopped", "MemoryCheckError", "train", "param_groups",
           "lr_multiplier",
           "matmul_peak_flops", "train_flops_per_token", "plot_loss_curve", "read_metrics", "fit_vocab"]

MAX_CONSECUTIVE_SKIPS = 10


class Diverged(RuntimeError):
    """The loss (or gradient norm) became NaN/Inf. `.step` and `.checkpoint` (Path or None) say where;
    `.result` holds the TrainResult up to that point (diverged=True)."""

    def __init__(self, message: str, step: int, checkpoint: Path | None, result: "TrainResult | None" = None):
        super().__init__(message)
        self.step, self.checkpoint, self.result = step, checkpoint, result


class Stopped(SignalStop):
    """SIGTERM or SIGINT arrived (cluster preemption, Ray cancel, Ctrl-C): the loop finished its step,
    saved a checkpoint and stopped. `.signal_name`, `.step`, `.checkpoint` say where; `--resume` continues."""

    def __init__(self, signal_name: str, step: int, checkpoint: Path | None):
        super().__init__(f"stopped by {signal_name} at step {step}; checkpoint {checkpoint} saved: continue with "
                         "--resume")
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint


class _StopSignals:
    """While active (main thread only), SIGTERM / SIGINT set `received` instead of killing the process;
    the loop checks it after each step. A second SIGINT interrupts at once."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass
class TrainResult:
    steps: int
    tokens_seen: int
    final_val_loss: float | None
    best_val_loss: float | None
    final_train_loss: float | None
    tokens_per_s: float
    peak_memory_bytes: int          # CUDA: max allocated; CPU: the process's peak RSS
    device: str                     # the device type trained on: "cuda" or "cpu"
    diverged: bool
    run_dir: Path
    metrics_path: Path
    cpu_others_share: float | None = None   # CPU runs: the machine's CPU time other processes took meanwhile

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["run_dir"], d["metrics_path"] = str(self.run_dir), str(self.metrics_path)
        return d


def fit_vocab(model_cfg: ModelConfig, data_dir: str | os.PathLike) -> ModelConfig:
    """The model config with vocab_size set to the data folder's (presets carry their own vocab)."""
    from archlab.data.tokens import load_meta

    vocab = int(load_meta(data_dir, expect=None)["vocab_size"])
    return model_cfg if model_cfg.vocab_size == vocab else model_cfg.with_overrides({"vocab_size": vocab})


# --------------------------------------------------------------------------- the loop
def train(model_cfg: ModelConfig, train_cfg: TrainConfig, data_dir: str | os.PathLike,
          out_dir: str | os.PathLike, *, resume: bool = False, progress: bool | str = True,
          allow_new_data: bool = False, init_from: InitSource | None = None, locked: bool = False) -> TrainResult:
    """Train `model_cfg` on the prepared data in `data_dir`; write the run folder `out_dir`.

    resume=True continues from the newest checkpoint in out_dir that verifies (a fresh start if there is
    none); the model config, tokenizer and data are compared with the run's before anything is written,
    and other data is refused unless allow_new_data. One process writes a run folder at a time
    (runlock.RunLock: a second writer gets LockedError). init_from (training.init_from.InitSource): a fresh
    start begins from its weights (checked against model_cfg's shapes, the data's tokenizer against its own)
    with a new optimizer and schedule; a resume continues from the run's checkpoint as usual.
    Raises Diverged on a NaN/Inf loss with optimizer.nan_policy="stop"; ConfigError for impossible settings;
    FileExistsError when out_dir already holds a run and resume is False.
    Under torchrun (WORLD_SIZE > 1) it runs data-parallel (train_cfg.dist_strategy); rank 0 writes.
    progress: True, the plan and a progress bar on stderr; "lines", the plan and plain log lines instead (a loss
    line at most every 30 s: batch jobs); False, nothing but warnings.
    locked: the caller holds RunLock(out_dir) already (finetune takes it before it writes the data folder).
    """
    cfg = train_cfg
    data_dir, run_dir = Path(data_dir), Path(out_dir)
    if int(os.environ.get("RANK", "0")) == 0:      # the writer; other ranks would see rank 0's lock as another's
        check_run_output(run_dir, data_dir, init_from)
    info = dist_util.setup(device_kind(cfg.device), cfg.dist_strategy)
    try:
        return _train(model_cfg, cfg, data_dir, run_dir, resume, progress, info, allow_new_data, init_from, locked)
    finally:
        dist_util.teardown(info)


def check_run_output(run_dir: Path, data_dir: Path, init_from: InitSource | None) -> None:
    """runs.outputs.check_output for a run folder, before any write or lock: never the data folder or the
    --init-from source, nor inside or above either, nor a live writer's. A data folder inside the run folder is
    the run's own (finetune's OUT/data), written by the command that made it."""
    from archlab.runs.outputs import check_output

    own = Path(os.path.realpath(data_dir)).is_relative_to(Path(os.path.realpath(run_dir)) / "data")
    source = init_from.spec if init_from is not None and not init_from.spec.startswith("hf:") else None
    check_output(run_dir, inputs=[None if own else data_dir, source], in_place=True)


def _train(model_cfg, cfg, data_dir, run_dir, resume, progress, info, allow_new_data=False,
           init_from=None, locked=False) -> TrainResult:
    # 1. the method (training/methods) opens its data and batches, checked against the settings: a setting this
    # data cannot train is an error that leaves nothing behind
    device = resolve_device(cfg, info)
    session = open_run(model_cfg, cfg, data_dir, init_from, info, progress=progress is True)
    # trainable token texts (train.lora.trainable_tokens) become ids with the data's tokenizer; config.yaml keeps ids
    cfg = lora_stage.resolve_tokens(cfg, session.tokenizer_dir)
    lora_stage.check(model_cfg, cfg)                   # LoRA targets this model lacks: refused before any write
    if cfg.memory_check:
        check_memory_fits(model_cfg, cfg, device, info)
    # 2. run folder: rank 0 locks and writes it, the others wait
    with RunLock(run_dir) if info.is_main and not locked else contextlib.nullcontext():
        latest = _prepare_run_dir(run_dir, data_dir, model_cfg, cfg, session, resume,
                                  info, allow_new_data, init_from)
        return _train_in(model_cfg, cfg, data_dir, run_dir, latest, progress, info, device, session, init_from)


def _train_in(model_cfg, cfg, data_dir, run_dir, latest, progress, info, device, session: MethodRun,
              init_from=None) -> TrainResult:
    """Steps 3-5 of `_train`, with the run folder locked."""
    if info.enabled:
        torch.distributed.barrier()
    # 3. model, optimizer, sampler; config.yaml keeps dtype "auto", precision.json what it resolved to
    if info.is_main:
        warn_past_context(model_cfg, cfg)             # said once every check has passed
    cfg = resolve_precision(cfg, device, info, run_dir, resuming=latest is not None)
    run = _Run(model_cfg, cfg, info, device, data_dir, run_dir, session)
    if info.is_main:
        write_provenance(run_dir, provenance(device=device, dtype=cfg.dtype, model=run.raw))
    # 4. resume, or start from another model's weights
    if latest is not None:
        run.resume_from(latest)
    elif init_from is not None:   # the source's weights; LoRA adapters (train.lora) keep their fresh init
        from archlab.nn.lora import lora_state
        dist_util.load_full_model_state(run.model, {**lora_state(run.raw), **run.fresh_state,
                                                     **init_from.weights_for(run.fresh_state)}, info)
    session.start(run.raw, run_dir, device=device, dtype=cfg.dtype, info=info, resuming=latest is not None,
                  progress=progress is True)          # what the method needs of the starting weights (a reference)
    # 5. the loop
    run.open_reporting(progress)
    try:
        with run.signals:
            run.loop()
    except Diverged as exc:
        exc.result = run.result(diverged=True)
        raise
    finally:
        run.close()
    return run.result(diverged=False)


def _finite(*losses: float | None) -> bool:
    return all(loss is None or math.isfinite(loss) for loss in losses)


class _StepStats(NamedTuple):
    ce: float              # mean over micro-batches and ranks
    total: float           # ce + z-loss + aux losses, likewise
    grad_norm: float
    finite: bool           # False: the update was skipped
    stop_requested: bool   # SIGTERM / SIGINT on some rank: checkpoint and stop after this step
    tokens: int            # tokens the model read in this step, all ranks (batches.tokens_processed)


@dataclass
class _Meter:
    """Tokens and seconds of training steps (eval, samples and saves are not counted)."""
    tokens: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds

    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class _Run:
    """One training run: the built objects, the counters a checkpoint saves, and one method per stage
    of the loop. Every rank holds one; methods that write files do so on rank 0 only."""

    def __init__(self, model_cfg, cfg, info, device, data_dir, run_dir, session: MethodRun):
        from archlab.models import build_model

        self.cfg, self.info, self.device = cfg, info, device
        self.data_dir, self.run_dir = data_dir, run_dir
        self.ckpt_root = run_dir / ckpt_io.CHECKPOINT_DIR
        self.metrics_path = run_dir / "metrics.jsonl"
        self.train_data = session.train_data

        seed_everything(cfg.seed + info.rank)
        self.raw = build_model(model_cfg).to(device)        # TransformerLM, EncoderLM or EncoderDecoderLM by arch
        self.lora = lora_stage.attach(self.raw, cfg)        # train.lora: adapters on, the base frozen (lora.py)
        self.fresh_state = session.extend(self.raw)          # modules the method adds (a scalar head): they train
        # (inputs, labels) per micro-step, a function of (seed, step, micro-batch, rank): the method's batches
        self.method, self.batches = session, session.batches
        self.flops_token = train_flops_per_token(model_cfg, cfg.seq_len)
        prepared = dist_util.prepare_model(                             # recompute -> wrap -> optimizer -> compile
            self.raw, info, device, activation_checkpointing=cfg.activation_checkpointing, compile=cfg.compile,
            build_optimizer=lambda model: build_optimizer(model, cfg, device, info.strategy))
        self.model, self.optimizer, self.step_model = prepared.model, prepared.optimizer, prepared.step_model
        self.total_steps = cfg.total_steps()

        # saved in checkpoints, restored by resume_from
        self.step, self.tokens, self.elapsed = 0, 0, 0.0
        self.best_val: float | None = None
        self.last_val: float | None = None
        self.skipped = 0
        # this process only
        self.last_good: Path | None = None      # the checkpoint Diverged names
        self.last_train_loss: float | None = None
        self.window, self.session = _Meter(), _Meter()   # since the last log line; since this process began
        self.signals = _StopSignals()                     # entered around the loop: SIGTERM / SIGINT stop cleanly
        # set by open_reporting
        self.tokenizer: Any = None
        self.tb: TensorBoardLogger | None = None
        self.bar: Any = None
        self.lines: LogLines | None = None        # plain log lines instead of the bar (progress="lines")
        self.peak = 0.0
        self.resumed_from: Path | None = None
        self.cpu: CpuShare | None = None          # CPU runs: other processes' share of the machine...
        self.cpu_others: float | None = None      # ...over the run, read at close()

    # ---- before the loop
    def resume_from(self, checkpoint: Path) -> None:
        """Continue from `checkpoint` exactly: weights, optimizer, sampler position, counters, RNG
        states; metrics.jsonl drops the lines past its step (the loop writes them again)."""
        info = self.info
        model_state, state = ckpt_io.load_checkpoint(checkpoint)        # on CPU first
        if not state or "optimizer" not in state:
            raise ckpt_io.CheckpointError(_weights_only_message(self.run_dir, checkpoint))
        arch = self.raw.config.arch       # a checkpoint of an earlier module layout: its names read as today's
        dist_util.load_full_model_state(self.model, upgrade_keys(model_state, arch), info)
        dist_util.load_full_optimizer_state(self.model, self.optimizer,
                                            upgrade_optimizer_state(state["optimizer"], arch), info)
        self.batches.load_state_dict(state["sampler"])
        self.step, self.tokens, self.elapsed = state["step"], state["tokens"], state["elapsed_s"]
        self.best_val, self.last_val = state.get("best_val"), state.get("last_val")
        self.skipped = state.get("skipped", 0)
        self.last_train_loss = state.get("last_train_loss")     # a resume past the budget still reports it
        rngs = state["rng"]
        set_rng_state(rngs[info.rank] if len(rngs) == info.world_size else rngs[0])
        if info.is_main:
            truncate_metrics(self.metrics_path, self.step)
            truncate_samples(self.run_dir / "samples.txt", self.step)
        self.last_good = checkpoint if _finite(self.last_val) else None
        self.resumed_from = checkpoint

    def open_reporting(self, progress: bool | str) -> None:
        """Tokenizer (for samples), peak FLOP/s (for MFU), TensorBoard, progress bar or lines. After resume_from,
        so that the bar starts at the resumed step and peak memory counts training only."""
        info = self.info
        if (info.is_main or info.strategy == "fsdp") and (self.data_dir / "tokenizer").is_dir():
            self.tokenizer = model_folder.load_run_tokenizer(self.data_dir)
        # one CPU process (data-parallel ranks on one machine would count as each other's load)
        self.cpu = CpuShare() if self.device.type == "cpu" and info.is_main and not info.enabled else None
        self.peak = matmul_peak_flops(self.device, self.cfg.dtype) if info.is_main else 0.0
        peak_busy = busy_note(self.cpu.others(), "the matmul peak was measured") if self.cpu else None
        self.tb = TensorBoardLogger(self.run_dir, info.is_main)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if progress and info.is_main:
            from archlab.progress import progress_bar
            print(self.describe(), file=sys.stderr)
            if self.resumed_from is not None:
                print(f"resuming from {self.resumed_from} at step {self.step:,} ({self.tokens:,} tokens)",
                      file=sys.stderr)
            if peak_busy:
                print(f"note: {peak_busy}", file=sys.stderr)
            if progress == "lines":
                self.lines = LogLines(self.total_steps)
            else:
                self.bar = progress_bar(total=self.total_steps, initial=self.step, desc="train", unit="step",
                                        file=sys.stderr)
        short = warmup_shortfall(self.cfg, self.total_steps) if info.is_main else None
        if short:
            warnings.warn(short, stacklevel=5)   # at the caller of train()
        if self.cpu is not None:
            self.cpu.start()                      # from here: the run

    def describe(self) -> str:
        """What is about to run: model size, batch, budget, device, and the memory the accounting
        module expects (so a run that cannot fit says so before it starts)."""
        from archlab.units import human_bytes, human_count

        cfg, mc, info = self.cfg, self.raw.config, self.info
        memory = memory_per_device(mc, cfg, info)
        total = human_bytes(sum(memory.values()))
        parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in memory.items())
        if cfg.activation_checkpointing:
            parts += "; activations before recompute: an upper bound"
        batch = f"{cfg.batch_size} x {cfg.seq_len} tokens"
        batch += f" x {cfg.grad_accum} accum" if cfg.grad_accum > 1 else ""
        budget = f"{self.total_steps:,} steps" if self.total_steps is not None else f"{cfg.budget:g} minutes"
        device = f"{self.device.type} {cfg.dtype}"
        device += f" x {info.world_size} ({info.strategy})" if info.enabled else ""
        device += "".join(f", {name}" for name, on in (("compiled", cfg.compile),
                                                      ("recompute", cfg.activation_checkpointing)) if on)
        return (f"model {mc.name or 'custom'}: {human_count(self.raw.num_params())} params, "
                f"{mc.n_layers} layers x d {mc.d_model}; {batch} per step, {budget}\n"
                f"device {device}; expected memory per device {total} ({parts})")

    # ---- the loop
    def loop(self) -> None:
        """Optimizer steps until the budget is spent; log, eval, sample and checkpoint on their schedules."""
        cfg = self.cfg
        self.model.train()
        t_prev = time.perf_counter()
        while not self.budget_spent():
            lr = cfg.lr * lr_multiplier(cfg, self.step, schedule_progress(cfg, self.step, self.total_steps,
                                                                          self.elapsed))
            stats = self.optimizer_step(lr)
            self.step += 1
            self.tokens += stats.tokens
            now = time.perf_counter()
            self.elapsed += now - t_prev
            self.window.add(stats.tokens, now - t_prev)
            self.session.add(stats.tokens, now - t_prev)
            t_prev = now
            if not stats.finite:
                self.stop_or_skip(stats)                # raises Diverged, or warns and moves on
                continue
            self.last_train_loss = stats.ce
            if self.lora is not None:
                self.lora.after_step(self)                # once: the optimizer's memory, measured and printed
            if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                self.log_step(stats, lr)
            if self.bar is not None:
                self.bar.update(1)
            end = self.budget_spent()
            if end:
                self.say(self.end_of_run())
            if (cfg.eval.every and self.step % cfg.eval.every == 0) or end:
                self.validate()
            if (cfg.sample.every > 0 and self.step % cfg.sample.every == 0) or (end and cfg.sample.every >= 0):
                self.sample()
            saved = (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0) or end
            if saved:
                self.checkpoint()
            if stats.stop_requested:
                self.stop(saved)
            t_prev = time.perf_counter()   # eval / sample / checkpoint time is not training time...
            if self.total_steps is None:   # ...except for a minutes budget, which is wall time
                self.elapsed += t_prev - now
        short = warmup_shortfall(cfg, self.step) if self.total_steps is None and self.info.is_main else None
        if short:                          # a minutes budget knows its steps only now
            warnings.warn(short, stacklevel=5)

    def say(self, line: str) -> None:
        """A line on stderr beside the progress bar or the log lines (nothing where progress is off)."""
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        elif self.lines is not None:
            print(line, file=sys.stderr, flush=True)

    def end_of_run(self) -> str:
        """What runs after the last step: on a real model these take minutes, which looked like a hang."""
        cfg = self.cfg
        parts = [f"validation (up to {cfg.eval.batches} batches)"]
        if cfg.sample.every >= 0 and self.tokenizer is not None and self.raw.config.arch == "decoder":
            parts.append(f"a {cfg.sample.tokens}-token sample (samples.txt)")
        parts.append("the checkpoint (weights and optimizer state)")
        return f"step {self.step:,} was the last: now " + ", ".join(parts)

    def checkpoint(self) -> None:
        """Save; the NaN guard names the checkpoint only when its recorded losses are finite."""
        path = self.save()
        if path is not None and _finite(self.last_val, self.last_train_loss):
            self.last_good = path

    def stop(self, saved: bool) -> None:
        """After SIGTERM / SIGINT: checkpoint (unless this step just did) and raise Stopped."""
        if not saved:
            self.checkpoint()
        name = signal.Signals(self.signals.received or signal.SIGTERM).name
        raise Stopped(name, self.step, ckpt_io.latest_checkpoint(self.run_dir))

    def budget_spent(self) -> bool:
        """A minutes budget is rank 0's clock, broadcast: every rank stops at the same step."""
        if self.total_steps is not None:
            return self.step >= self.total_steps
        return dist_util.broadcast_flag(self.elapsed >= self.cfg.budget * 60.0, self.info)

    def optimizer_step(self, lr: float) -> _StepStats:
        """Forward/backward over grad_accum micro-batches, clip, and update unless the loss or the
        gradient norm is NaN/Inf."""
        cfg, info, device = self.cfg, self.info, self.device
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        sums = torch.zeros(2, dtype=torch.float64, device=device)  # ce, total: summed on device
        tokens = 0
        for micro in range(cfg.grad_accum):
            inputs, y = self.batches.next(self.step, micro)                   # {input_ids, ...}, labels
            tokens += tokens_processed(inputs, y, self.raw.config.arch)
            inputs = {k: v.to(device, non_blocking=True) for k, v in inputs.items()}
            y = y.to(device, non_blocking=True)
            # gradients are all-reduced across ranks once, on the last micro-step
            with dist_util.no_grad_sync(self.model, info, sync=micro == cfg.grad_accum - 1):
                with autocast(device, cfg.dtype):
                    out = self.forward_loss(inputs, y)                            # LossOutput
                (out.total / cfg.grad_accum).backward()
            sums += torch.stack((out.ce.detach(), out.total.detach()))
        ce, total_loss = (sums / cfg.grad_accum).tolist()   # one host sync per optimizer step
        # a SIGTERM / SIGINT on any rank rides on the one all-reduce of the step: every rank stops together
        ce, total_loss, stop, tokens_mean = dist_util.all_reduce_mean(
            [ce, total_loss, float(self.signals.received is not None), float(tokens)], info)
        grad_norm = self._grad_norm()
        finite = math.isfinite(total_loss) and math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            self.skipped = 0
        # MoE balance=bias: the expert biases move by this step's routed counts, summed over ranks (DeepSeek-V3)
        moe_balance_step(self.raw, update=finite,
                         reduce=lambda t: torch.tensor(dist_util.all_reduce_sum(t.flatten().tolist(), info),
                                                       dtype=t.dtype, device=t.device).view_as(t))
        self.optimizer.zero_grad(set_to_none=True)
        return _StepStats(ce, total_loss, grad_norm, finite, stop > 0, round(tokens_mean * info.world_size))

    def forward_loss(self, inputs: dict[str, torch.Tensor], y: torch.Tensor) -> Any:
        """The method's loss of one micro-batch (LossOutput)."""
        return self.method.loss(self.step_model, inputs, y)

    def _grad_norm(self) -> float:
        """Global gradient norm, after clipping to cfg.optimizer.grad_clip when set."""
        if self.cfg.optimizer.grad_clip:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.raw.parameters(), self.cfg.optimizer.grad_clip)
        else:
            grads = [p.grad for p in self.raw.parameters() if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads)
        if hasattr(grad_norm, "full_tensor"):     # FSDP: a DTensor
            grad_norm = grad_norm.full_tensor()
        return float(grad_norm)

    def stop_or_skip(self, stats: _StepStats) -> None:
        """After a NaN/Inf step: raise Diverged (optimizer.nan_policy="stop", or MAX_CONSECUTIVE_SKIPS in a row),
        else warn; optimizer_step has already skipped the update."""
        where = f"last good checkpoint: {self.last_good}" if self.last_good else "no checkpoint saved yet"
        msg = f"loss {stats.total} / grad norm {stats.grad_norm} at step {self.step}; {where}"
        self.log({"step": self.step, "tokens": self.tokens, "loss": stats.ce, "nonfinite": True})
        self.skipped += 1
        if self.cfg.optimizer.nan_policy == "stop" or self.skipped >= MAX_CONSECUTIVE_SKIPS:
            if self.cfg.optimizer.nan_policy == "skip":
                msg += f" ({self.skipped} non-finite steps in a row)"
            raise Diverged("training diverged: " + msg, self.step, self.last_good)
        warnings.warn("skipping the update: " + msg, stacklevel=2)

    # ---- outputs
    def log(self, record: dict) -> None:
        if self.info.is_main:
            append_jsonl(self.metrics_path, record)
            if self.tb is not None:
                self.tb.log(record)

    def log_step(self, stats: _StepStats, lr: float) -> None:
        """A training line (throughput since the last one) to metrics.jsonl and the progress bar."""
        tps = self.window.tokens_per_s()
        mfu = self.flops_token * tps / self.peak if self.peak else 0.0
        record: dict[str, Any] = {"step": self.step, "tokens": self.tokens, "loss": stats.ce, "lr": lr,
                                  "grad_norm": stats.grad_norm, "tokens_per_s": tps, "mfu": mfu}
        if stats.total != stats.ce:
            record["loss_total"] = stats.total
        record.update(self.method.log_fields())   # the method's own figures (this rank's, since the last line)
        record.update(moe_load_fields(self.raw))  # routed experts' load: the last micro-batch's, this rank's
        self.log(record)
        left = {}
        if self.total_steps is None:              # a minutes budget: the bar has no total, so say what is left
            seconds = max(0.0, self.cfg.budget * 60.0 - self.elapsed)
            left = {"left": f"{int(seconds // 60)}:{int(seconds % 60):02d}"}
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{stats.ce:.3f}", tok_s=f"{tps:,.0f}", mfu=f"{mfu:.1%}", **left, refresh=False)
        elif self.lines is not None:
            self.lines.step(self.step, loss=stats.ce, lr=lr, tokens_per_s=tps, mfu=mfu, **left)
        self.window = _Meter()

    def validate(self) -> None:
        """Validation loss now, logged; sets last_val (None without a usable val split) and best_val."""
        cfg = self.cfg
        self.last_val = None
        scores = self.method.evaluate(self.model, device=self.device, dtype=cfg.dtype, info=self.info)
        if scores:
            self.log({"step": self.step, "tokens": self.tokens, **scores})
            self.last_val = scores["val_loss"]
        if self.last_val is not None and (self.best_val is None or self.last_val < self.best_val):
            self.best_val = self.last_val

    def sample(self) -> None:
        """Append a sampled continuation to samples.txt. DDP: rank 0 alone samples; FSDP: every rank
        takes part in the sharded forward passes (no KV-cache generate); rank 0 writes."""
        cfg, info = self.cfg, self.info
        if cfg.sample.every < 0 or self.tokenizer is None or self.raw.config.arch != "decoder":
            return   # encoders don't sample; an encoder-decoder's samples need a source (archlab generate)
        if info.strategy == "ddp" and not info.is_main:
            return
        prompt = self.tokenizer.encode(cfg.sample.prompt) if cfg.sample.prompt else [self.train_data.eot_id]
        module = self.raw if info.strategy != "fsdp" else self.model
        ids = sample_ids(module, prompt, cfg.sample.tokens, temperature=cfg.sample.temperature,
                         seed=cfg.seed + self.step, device=self.device, use_cache=info.strategy != "fsdp",
                         vocab_limit=vocab_limit(self.raw, self.tokenizer))   # a padded vocabulary: decodable ids
        if info.is_main:
            text = self.tokenizer.decode(ids)
            with open(self.run_dir / "samples.txt", "a") as f:
                f.write(f"=== step {self.step} (tokens {self.tokens}) ===\n{cfg.sample.prompt}{text}\n\n")

    def save(self) -> Path | None:
        """A checkpoint of everything resume_from restores (collective: every rank calls it). Returns its
        path (on other ranks, the latest one on disk)."""
        info = self.info
        model_state = dist_util.full_model_state(self.model, info)
        optim_state = dist_util.full_optimizer_state(self.model, self.optimizer, info)
        rngs = dist_util.gather_objects(rng_state(), info)
        path = None
        if info.is_main:
            state = {"step": self.step, "tokens": self.tokens, "elapsed_s": self.elapsed,
                     "best_val": self.best_val, "last_val": self.last_val, "skipped": self.skipped,
                     "last_train_loss": self.last_train_loss,
                     "optimizer": optim_state, "sampler": self.batches.state_dict(), "rng": rngs,
                     "world_size": info.world_size, "train_config": self.cfg.to_dict()}
            path = ckpt_io.save_checkpoint(self.ckpt_root, self.step, model_state, state,
                                           keep_last=self.cfg.checkpoint.keep_last, extra_meta={"tokens": self.tokens})
        if info.enabled:
            torch.distributed.barrier()
        return path if info.is_main else ckpt_io.latest_checkpoint(self.run_dir)

    # ---- after the loop
    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.cpu_others = self.cpu.others() if self.cpu is not None else None
        busy = busy_note(self.cpu_others, "this run trained")
        if busy and (self.bar is not None or self.lines is not None):
            print(f"note: {busy}", file=sys.stderr)
        if self.tb is not None:
            self.tb.close()
        if self.info.is_main:
            try:
                plot_loss_curve(self.run_dir)
            except Exception as exc:  # a plot must never lose a finished run
                warnings.warn(f"could not draw loss_curve.png: {exc}", stacklevel=2)

    def result(self, diverged: bool) -> TrainResult:
        return TrainResult(steps=self.step, tokens_seen=self.tokens, final_val_loss=self.last_val,
                           best_val_loss=self.best_val, final_train_loss=self.last_train_loss,
                           tokens_per_s=self.session.tokens_per_s(), peak_memory_bytes=peak_memory(self.device),
                           device=self.device.type, diverged=diverged, run_dir=self.run_dir,
                           metrics_path=self.metrics_path, cpu_others_share=self.cpu_others)


def _check_resumable_weights(checkpoint: Path) -> None:
    """NaN / inf weights are refused before the run folder changes; --resume always takes the newest checkpoint
    that verifies, so the message says how to reach the one before it."""
    try:
        ckpt_io.load_weights(checkpoint / ckpt_io.MODEL_FILE)
    except ckpt_io.NonFiniteWeightsError as e:
        raise ckpt_io.NonFiniteWeightsError(f"{e}; --resume takes the newest checkpoint: move {checkpoint} out "
                                            f"of {checkpoint.parent} to resume from the one before it") from None


def _weights_only_message(run_dir: Path, checkpoint: Path) -> str:
    return (f"{checkpoint} holds weights without a trainer state (an imported or exported model), so there is "
            f"no run to resume: start a new run from them with --init-from {run_dir} --out NEW_FOLDER")


def _prepare_run_dir(run_dir, data_dir, model_cfg, cfg, session, resume, info,
                     allow_new_data=False, init_from=None) -> Path | None:
    """Rank 0 checks the run folder can take this run, then writes its config and tokenizer: nothing in
    the folder changes before every check has passed. Returns the checkpoint to resume from (None: a
    fresh start)."""
    metrics_path = run_dir / "metrics.jsonl"
    train_data, val_data = session.train_data, session.val_data
    latest = ckpt_io.resumable_checkpoint(run_dir) if resume else None
    if not info.is_main:
        return latest
    if not resume and (metrics_path.exists() or ckpt_io.list_checkpoints(run_dir)):
        raise FileExistsError(f"{run_dir} already holds a run; pass resume=True (--resume) to "
                              "continue it or choose another --out")
    tok_src = data_dir / train_data.meta.get("tokenizer", "tokenizer")
    data_info = {"dir": str(data_dir.resolve()), "corpus": train_data.meta.get("corpus"),
                 "vocab_size": train_data.vocab_size, "train_tokens": train_data.n_tokens,
                 "val_tokens": val_data.n_tokens, "bytes_per_token": train_data.bytes_per_token,
                 "fingerprint": data_fingerprint(data_dir)}
    if latest is not None and not ckpt_io.holds_trainer_state(latest):
        raise ckpt_io.CheckpointError(_weights_only_message(run_dir, latest))
    if latest is not None:
        _check_resumable_weights(latest)
        check_resume_matches(run_dir, model_cfg, data_info, tok_src, allow_new_data)
        lora_stage.check_resume(run_dir, cfg)
        session.check_resume(run_dir)                 # the method's own files in the run folder
        started_from = model_folder.read_run_config(run_dir).get("init_from")
    elif init_from is not None:
        init_from.check_model(model_cfg)
        init_from.check_tokenizer(tok_src, data_dir)
        started_from = init_from.record()
    else:
        started_from = None
    model_folder.write_run_config(run_dir, model_cfg.to_dict(), cfg.to_dict(), data_info, init_from=started_from)
    if tok_src.is_dir() and not (run_dir / "tokenizer").exists():
        shutil.copytree(tok_src, run_dir / "tokenizer")
    if latest is None and metrics_path.exists():
        metrics_path.unlink()
    return latest

