"""The training loop: `train()` runs one model config on one prepared data folder into a run folder.

    result = train(model_cfg, train_cfg, data_dir, out_dir, resume=False)

The pieces it wires together live beside it: TrainConfig (train_config.py), AdamW groups and LR
schedules (optim.py), metrics.jsonl and the loss curve (metrics.py), FLOPs and peak memory for MFU
(throughput.py), RNG states (rng.py), checkpoints (checkpoint.py), DDP/FSDP (distributed.py).

- Gradient clipping by global norm, gradient accumulation, bf16 autocast, torch.compile opt-in.
- Loss = LossOutput.total of the model (cross-entropy + z-loss + MoE auxiliary losses).
- Budget in optimizer steps, tokens or minutes of wall time. With a minutes budget the schedule
  follows elapsed time (so LR, and hence losses, are not bit-reproducible across runs).
- `batch_size` is GLOBAL (sequences per micro-step summed over data-parallel ranks): the same config
  trains the same model on 1 or N processes; tokens per optimizer step = batch_size*grad_accum*seq_len.
- Checkpoints (archlab.checkpoint) hold weights, optimizer, counters, RNG states and the sampler
  position: `resume=True` continues step for step as if never interrupted (tested on CPU with kill -9).
- A NaN/Inf loss or gradient norm raises `Diverged` (nan_policy="stop") naming the step and the last
  good checkpoint, or skips that step's update (nan_policy="skip"; 10 in a row still raise).
"""
from __future__ import annotations

import dataclasses
import math
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from archlab import checkpoint as ckpt_io
from archlab import distributed as dist_util
from archlab.config import ConfigError, ModelConfig
from archlab.evaluate import autocast, evaluate, sample_ids
from archlab.metrics import TensorBoardLogger, append_jsonl, plot_loss_curve, read_metrics, truncate_metrics
from archlab.optim import build_optimizer, lr_multiplier, param_groups, schedule_progress
from archlab.rng import rng_state, seed_everything, set_rng_state
from archlab.throughput import matmul_peak_flops, peak_memory, train_flops_per_token
from archlab.train_config import TrainConfig

# re-exported: callers import these from archlab.train
__all__ = ["TrainConfig", "TrainResult", "Diverged", "train", "param_groups", "lr_multiplier",
           "matmul_peak_flops", "train_flops_per_token", "plot_loss_curve", "read_metrics", "fit_vocab"]

_peak_memory = peak_memory   # the name benchmarks/train_throughput.py imports
MAX_CONSECUTIVE_SKIPS = 10


class Diverged(RuntimeError):
    """The loss (or gradient norm) became NaN/Inf. `.step` and `.checkpoint` (Path or None) say where;
    `.result` holds the TrainResult up to that point (diverged=True)."""

    def __init__(self, message: str, step: int, checkpoint: Path | None, result: "TrainResult | None" = None):
        super().__init__(message)
        self.step, self.checkpoint, self.result = step, checkpoint, result


@dataclass
class TrainResult:
    steps: int
    tokens_seen: int
    final_val_loss: float | None
    best_val_loss: float | None
    final_train_loss: float | None
    tokens_per_s: float
    peak_memory_bytes: int          # CUDA: max allocated; CPU: the process's peak RSS
    diverged: bool
    run_dir: Path
    metrics_path: Path

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["run_dir"], d["metrics_path"] = str(self.run_dir), str(self.metrics_path)
        return d


def _resolve_device(cfg: TrainConfig, info: dist_util.DistInfo) -> torch.device:
    kind = cfg.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("train.device='cuda' but CUDA is not available")
        return torch.device("cuda", info.local_rank if info.enabled else torch.cuda.current_device())
    return torch.device("cpu")


def fit_vocab(model_cfg: ModelConfig, data_dir: str | os.PathLike) -> ModelConfig:
    """The model config with vocab_size set to the data folder's (presets carry their own vocab)."""
    from archlab.data import load_meta

    vocab = int(load_meta(data_dir)["vocab_size"])
    return model_cfg if model_cfg.vocab_size == vocab else model_cfg.with_overrides({"vocab_size": vocab})


# --------------------------------------------------------------------------- the loop
def train(model_cfg: ModelConfig, train_cfg: TrainConfig, data_dir: str | os.PathLike,
          out_dir: str | os.PathLike, *, resume: bool = False, progress: bool = True) -> TrainResult:
    """Train `model_cfg` on the prepared data in `data_dir`; write the run folder `out_dir`.

    resume=True continues from the latest checkpoint in out_dir (a fresh start if there is none).
    Raises Diverged on a NaN/Inf loss with nan_policy="stop"; ConfigError for impossible settings;
    FileExistsError when out_dir already holds a run and resume is False.
    Under torchrun (WORLD_SIZE > 1) it runs data-parallel (train_cfg.dist_strategy); rank 0 writes.
    """
    from archlab.data import BatchSampler, TokenDataset

    cfg = train_cfg
    data_dir, run_dir = Path(data_dir), Path(out_dir)
    info = dist_util.setup("cuda" if (cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()))
                           else "cpu", cfg.dist_strategy)
    try:
        return _train(model_cfg, cfg, data_dir, run_dir, resume, progress, info, BatchSampler, TokenDataset)
    finally:
        dist_util.teardown(info)


def _train(model_cfg, cfg, data_dir, run_dir, resume, progress, info, BatchSampler, TokenDataset):
    from archlab.model import TransformerLM

    device = _resolve_device(cfg, info)
    train_data = TokenDataset(data_dir, "train")
    val_data = TokenDataset(data_dir, "val")
    if model_cfg.vocab_size < train_data.vocab_size:
        raise ConfigError(f"model vocab_size={model_cfg.vocab_size} is smaller than the data's "
                          f"vocab_size={train_data.vocab_size} ({data_dir}); set vocab_size "
                          f"(archlab.train.fit_vocab does it)")
    if model_cfg.position.kind == "learned" and cfg.seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"train.seq_len={cfg.seq_len} exceeds max_seq_len={model_cfg.max_seq_len}")
    if cfg.batch_size % info.world_size:
        raise ConfigError(f"train.batch_size={cfg.batch_size} (global) must be divisible by the "
                          f"world size {info.world_size}")
    local_batch = cfg.batch_size // info.world_size
    can_eval = val_data.n_tokens >= cfg.seq_len + 1
    if not can_eval and info.is_main:
        warnings.warn(f"validation split has {val_data.n_tokens} tokens < seq_len + 1: no evaluation")

    # ---- run folder -------------------------------------------------------------------------
    ckpt_root = run_dir / ckpt_io.CHECKPOINT_DIR
    metrics_path = run_dir / "metrics.jsonl"
    latest = _prepare_run_dir(run_dir, data_dir, model_cfg, cfg, train_data, val_data, resume, info)
    if info.enabled:
        torch.distributed.barrier()

    # ---- model, optimizer, data -----------------------------------------------------------------
    seed_everything(cfg.seed + info.rank)
    model = TransformerLM(model_cfg).to(device)
    raw = model
    n_params = raw.num_params()
    model = dist_util.wrap(model, info, device)           # FSDP shards in place; DDP wraps
    optimizer = build_optimizer(raw, cfg, device, info.strategy)  # after FSDP: its DTensor params
    step_model = torch.compile(model) if cfg.compile else model
    sampler = BatchSampler(train_data, local_batch, cfg.seq_len, seed=cfg.seed, rank=info.rank,
                           world_size=info.world_size)
    total_steps = cfg.total_steps()
    step, tokens, elapsed, best_val, last_val, skipped = 0, 0, 0.0, None, None, 0

    if latest is not None:
        model_state, state = ckpt_io.load_checkpoint(latest)        # on CPU first
        dist_util.load_full_model_state(model, model_state, info)
        dist_util.load_full_optimizer_state(model, optimizer, state["optimizer"], info)
        sampler.load_state_dict(state["sampler"])
        step, tokens, elapsed = state["step"], state["tokens"], state["elapsed_s"]
        best_val, last_val, skipped = state.get("best_val"), state.get("last_val"), state.get("skipped", 0)
        rngs = state["rng"]
        set_rng_state(rngs[info.rank] if len(rngs) == info.world_size else rngs[0])
        if info.is_main:
            truncate_metrics(metrics_path, step)
        del model_state, state
    last_good = latest

    tokenizer = None
    if info.is_main or info.strategy == "fsdp":
        tokenizer = ckpt_io.load_run_tokenizer(data_dir) if (data_dir / "tokenizer").is_dir() else None
    flops_token = train_flops_per_token(model_cfg, cfg.seq_len, n_params)
    peak = matmul_peak_flops(device, cfg.dtype) if info.is_main else 0.0
    tb = TensorBoardLogger(run_dir, info.is_main)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    bar = None
    if progress and info.is_main:
        from archlab.progress import progress_bar
        bar = progress_bar(total=total_steps, initial=step, desc="train", unit="step", file=sys.stderr)

    def log(record: dict) -> None:
        if info.is_main:
            append_jsonl(metrics_path, record)
            tb.log(record)

    def run_eval() -> float | None:
        if not can_eval:
            return None
        result = evaluate(model, val_data, batch_size=cfg.batch_size,   # whole batches split over ranks
                          seq_len=cfg.seq_len, max_batches=cfg.eval_batches, device=device,
                          dtype=cfg.dtype, dist_info=info)
        log({"step": step, "tokens": tokens, "val_loss": result.loss, "val_ppl": result.ppl,
             "val_bpb": result.bpb})
        return result.loss

    def run_sample() -> None:
        if cfg.sample_every < 0 or tokenizer is None:
            return
        if info.strategy == "ddp" and not info.is_main:
            return
        prompt = tokenizer.encode(cfg.sample_prompt) if cfg.sample_prompt else [train_data.eot_id]
        module = raw if info.strategy != "fsdp" else model
        ids = sample_ids(module, prompt, cfg.sample_tokens, temperature=cfg.sample_temperature,
                         seed=cfg.seed + step, device=device, use_generate=info.strategy != "fsdp")
        if info.is_main:
            text = tokenizer.decode(ids)
            with open(run_dir / "samples.txt", "a") as f:
                f.write(f"=== step {step} (tokens {tokens}) ===\n{cfg.sample_prompt}{text}\n\n")

    def save() -> Path | None:
        model_state = dist_util.full_model_state(model, info)
        optim_state = dist_util.full_optimizer_state(model, optimizer, info)
        rngs = dist_util.gather_objects(rng_state(), info)
        path = None
        if info.is_main:
            state = {"step": step, "tokens": tokens, "elapsed_s": elapsed, "best_val": best_val,
                     "last_val": last_val, "skipped": skipped, "optimizer": optim_state,
                     "sampler": sampler.state_dict(), "rng": rngs, "world_size": info.world_size,
                     "train_config": cfg.to_dict()}
            path = ckpt_io.save_checkpoint(ckpt_root, step, model_state, state, keep_last=cfg.keep_last,
                                           extra_meta={"tokens": tokens})
        if info.enabled:
            torch.distributed.barrier()
        return path if info.is_main else ckpt_io.latest_checkpoint(run_dir)

    def budget_spent() -> bool:
        if total_steps is not None:
            return step >= total_steps
        return dist_util.broadcast_flag(elapsed >= cfg.budget * 60.0, info)

    model.train()
    window_tokens, window_s = 0, 0.0      # throughput counts training steps only, not eval/saves
    run_tokens, run_s = 0, 0.0
    last_train_loss = None
    diverged = False
    t_prev = time.perf_counter()
    try:
        while not budget_spent():
            mult = lr_multiplier(cfg, step, schedule_progress(cfg, step, total_steps, elapsed))
            for g in optimizer.param_groups:
                g["lr"] = cfg.lr * mult
            sums = torch.zeros(2, dtype=torch.float64, device=device)  # ce, total: summed on device
            for micro in range(cfg.grad_accum):
                x, y = next(sampler)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with dist_util.no_grad_sync(model, info, sync=micro == cfg.grad_accum - 1):
                    with autocast(device, cfg.dtype):
                        out = step_model(x, targets=y)                           # LossOutput
                    (out.total / cfg.grad_accum).backward()
                sums += torch.stack((out.ce.detach(), out.total.detach()))
            ce, total_loss = (sums / cfg.grad_accum).tolist()   # one host sync per optimizer step
            ce, total_loss = dist_util.all_reduce_mean([ce, total_loss], info)
            if cfg.grad_clip:
                grad_norm = torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg.grad_clip)
            else:
                grad_norm = torch.nn.utils.get_total_norm([p.grad for p in raw.parameters() if p.grad is not None])
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            grad_norm = float(grad_norm)
            finite = math.isfinite(total_loss) and math.isfinite(grad_norm)
            if finite:
                optimizer.step()
                skipped = 0
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens += cfg.tokens_per_step
            now = time.perf_counter()
            elapsed += now - t_prev
            window_s += now - t_prev
            run_s += now - t_prev
            t_prev = now
            window_tokens += cfg.tokens_per_step
            run_tokens += cfg.tokens_per_step
            if not finite:
                where = f"last good checkpoint: {last_good}" if last_good else "no checkpoint saved yet"
                msg = f"loss {total_loss} / grad norm {grad_norm} at step {step}; {where}"
                log({"step": step, "tokens": tokens, "loss": ce, "nonfinite": True})
                skipped += 1
                if cfg.nan_policy == "stop" or skipped >= MAX_CONSECUTIVE_SKIPS:
                    diverged = True
                    if cfg.nan_policy == "skip":
                        msg += f" ({skipped} non-finite steps in a row)"
                    raise Diverged("training diverged: " + msg, step, last_good)
                warnings.warn("skipping the update: " + msg)
                continue
            last_train_loss = ce
            if step % cfg.log_every == 0 or step == total_steps:
                tps = window_tokens / window_s if window_s > 0 else 0.0
                mfu = flops_token * tps / peak if peak else 0.0
                record = {"step": step, "tokens": tokens, "loss": ce, "lr": cfg.lr * mult,
                          "grad_norm": grad_norm, "tokens_per_s": tps, "mfu": mfu}
                if total_loss != ce:
                    record["loss_total"] = total_loss
                log(record)
                if bar is not None:
                    bar.set_postfix(loss=f"{ce:.3f}", tok_s=f"{tps:,.0f}", mfu=f"{mfu:.1%}", refresh=False)
                window_tokens, window_s = 0, 0.0
            if bar is not None:
                bar.update(1)
            end = budget_spent()
            if (cfg.eval_every and step % cfg.eval_every == 0) or end:
                last_val = run_eval()
                if last_val is not None and (best_val is None or last_val < best_val):
                    best_val = last_val
            if (cfg.sample_every > 0 and step % cfg.sample_every == 0) or (end and cfg.sample_every >= 0):
                run_sample()
            if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or end:
                last_good = save() or last_good
            t_prev = time.perf_counter()   # eval / sample / checkpoint time is not training time...
            if total_steps is None:        # ...except for a minutes budget, which is wall time
                elapsed += t_prev - now
    except Diverged as exc:
        exc.result = _result(step, tokens, last_val, best_val, last_train_loss, run_tokens, run_s,
                             device, True, run_dir, metrics_path)
        raise
    finally:
        if bar is not None:
            bar.close()
        tb.close()
        if info.is_main:
            try:
                plot_loss_curve(run_dir)
            except Exception as exc:  # a plot must never lose a finished run
                warnings.warn(f"could not draw loss_curve.png: {exc}")
    return _result(step, tokens, last_val, best_val, last_train_loss, run_tokens, run_s, device, diverged,
                   run_dir, metrics_path)


def _prepare_run_dir(run_dir, data_dir, model_cfg, cfg, train_data, val_data, resume, info) -> Path | None:
    """Rank 0 checks the run folder can take this run and writes its config and tokenizer.
    Returns the checkpoint to resume from (None: a fresh start)."""
    metrics_path = run_dir / "metrics.jsonl"
    latest = ckpt_io.latest_checkpoint(run_dir) if resume else None
    if not info.is_main:
        return latest
    if not resume and (metrics_path.exists() or ckpt_io.list_checkpoints(run_dir)):
        raise FileExistsError(f"{run_dir} already holds a run; pass resume=True (--resume) to "
                              "continue it or choose another --out")
    if latest is not None:
        saved = ckpt_io.read_run_config(run_dir)
        if saved["model"] != model_cfg.to_dict():
            raise ConfigError(f"cannot resume {run_dir}: its config.yaml has a different model config")
    run_dir.mkdir(parents=True, exist_ok=True)
    data_info = {"dir": str(data_dir.resolve()), "corpus": train_data.meta.get("corpus"),
                 "vocab_size": train_data.vocab_size, "train_tokens": train_data.n_tokens,
                 "val_tokens": val_data.n_tokens, "bytes_per_token": train_data.bytes_per_token}
    ckpt_io.write_run_config(run_dir, model_cfg.to_dict(), cfg.to_dict(), data_info)
    tok_src = data_dir / train_data.meta.get("tokenizer", "tokenizer")
    if tok_src.is_dir() and not (run_dir / "tokenizer").exists():
        shutil.copytree(tok_src, run_dir / "tokenizer")
    if latest is None and metrics_path.exists():
        metrics_path.unlink()
    return latest


def _result(step, tokens, last_val, best_val, last_train, run_tokens, dt, device, diverged, run_dir,
            metrics_path) -> TrainResult:
    return TrainResult(steps=step, tokens_seen=tokens, final_val_loss=last_val, best_val_loss=best_val,
                       final_train_loss=last_train, tokens_per_s=run_tokens / dt if dt > 0 else 0.0,
                       peak_memory_bytes=peak_memory(device), diverged=diverged, run_dir=run_dir,
                       metrics_path=metrics_path)
