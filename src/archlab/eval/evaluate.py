"""Evaluation: validation loss, perplexity and bits per byte; and a small sampler for progress samples.

Bits per byte (bpb) makes losses comparable across tokenizers: the model's total code length in bits
divided by the UTF-8 bytes it encodes,  bpb = loss_nats * tokens / (bytes * ln 2)  (e.g. Gao et al.
2020, "The Pile"). `bytes` is the split's bytes per token (meta.json) times the tokens scored.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass

import torch
from torch import nn

from archlab.generation.sampling import SamplingParams, next_token
from archlab.training.precision import autocast  # re-exported: the step's bf16 / float32 context

__all__ = ["EvalResult", "evaluate", "autocast", "sample_ids", "bits_per_byte"]


@dataclass(frozen=True)
class EvalResult:
    loss: float        # mean cross-entropy over the scored tokens (next-token, or masked for an MLM), nats
    ppl: float         # exp(loss)
    bpb: float         # bits per UTF-8 byte (nan for an MLM: masked slots are not a compression of the text)
    tokens: int        # tokens scored
    accuracy: float | None = None   # MLM: share of masked slots predicted exactly
    nsp_loss: float | None = None   # next-sentence prediction: its cross-entropy per row (not in `loss`)
    nsp_accuracy: float | None = None   # and the share of rows whose IsNext / NotNext it predicts

    def to_dict(self) -> dict:
        return asdict(self)


def bits_per_byte(loss_nats: float, tokens: int, n_bytes: float) -> float:
    return loss_nats * tokens / (n_bytes * math.log(2)) if n_bytes else float("nan")


@torch.no_grad()
def evaluate(model: nn.Module, dataset, *, batch_size: int, seq_len: int,
             max_batches: int | None = None, device: str | torch.device = "cpu",
             dtype: str = "float32", dist_info=None, progress: bool = False, objective=None) -> EvalResult:
    """Cross-entropy over the first `max_batches` deterministic validation batches of `dataset`
    (archlab.data.batches.validation_batches: token windows, or source/target pairs for an
    archlab.data.pairs.PairDataset).
    Under data parallelism every rank runs the same number of forwards (FSDP needs all ranks in each all-gather);
    the sums are all-reduced. `objective` (objectives.py) turns the windows as in training, batch i the same way at
    every evaluation: an encoder scored on its masked slots, an encoder-decoder on its noised spans."""
    from archlab.data.batches import scores_text, validation_batches

    device = torch.device(device)
    rank, world = (dist_info.rank, dist_info.world_size) if dist_info is not None else (0, 1)
    batches = list(validation_batches(dataset, batch_size=batch_size, seq_len=seq_len, max_batches=max_batches,
                                      objective=objective))
    mine = batches[rank::world]
    rounds = -(-len(batches) // world)
    was_training = model.training
    model.eval()
    total_nats, total_tokens, total_correct = 0.0, 0, 0.0
    has_accuracy = False            # an MLM's evaluation reports accuracy on its masked slots
    nsp = torch.zeros(3, dtype=torch.float64)   # next-sentence rows, nats, hits
    try:
        iterator = range(rounds)
        if progress:
            from archlab.progress import progress_bar
            iterator = progress_bar(iterator, desc="eval", leave=False)
        for i in iterator:
            inputs, y = mine[i] if i < len(mine) else batches[0]   # a filler forward, weight 0
            weight = 1 if i < len(mine) else 0
            inputs = {k: v.to(device) for k, v in inputs.items()}
            y = y.to(device)
            with autocast(device, dtype):   # the fused head + loss: no (b, t, v) logits in memory
                out = model(**inputs, targets=y)
            scored = int((y != -100).sum())
            total_nats += weight * float(out.ce) * scored
            total_tokens += weight * scored
            if out.accuracy is not None:
                has_accuracy = True
                total_correct += weight * float(out.accuracy) * scored
            if out.nsp_accuracy is not None and out.nsp_loss is not None:
                rows = len(inputs["next_sentence_labels"])
                nsp += weight * torch.tensor([rows, float(out.nsp_loss) * rows, float(out.nsp_accuracy) * rows],
                                             dtype=torch.float64)
    finally:
        model.train(was_training)
    if dist_info is not None and dist_info.enabled:
        from archlab.training.distributed import all_reduce_sum
        total_nats, total_tokens, total_correct, *nsp_sums = all_reduce_sum(
            [total_nats, float(total_tokens), total_correct, *nsp.tolist()], dist_info)
        nsp = torch.tensor(nsp_sums, dtype=torch.float64)
        total_tokens = int(total_tokens)
    if total_tokens == 0:
        raise ValueError("evaluation scored no tokens")
    loss = total_nats / total_tokens
    ppl = math.exp(min(loss, 700.0))
    accuracy = total_correct / total_tokens if has_accuracy else None
    nsp_fields = {"nsp_loss": float(nsp[1] / nsp[0]), "nsp_accuracy": float(nsp[2] / nsp[0])} if nsp[0] else {}
    if not scores_text(objective):
        return EvalResult(loss=loss, ppl=ppl, bpb=float("nan"), tokens=total_tokens, accuracy=accuracy,
                          **nsp_fields)
    n_bytes = dataset.bytes_per_token * total_tokens
    return EvalResult(loss=loss, ppl=ppl, bpb=bits_per_byte(loss, total_tokens, n_bytes), tokens=total_tokens,
                      accuracy=accuracy)


@torch.no_grad()
def sample_ids(model: nn.Module, prompt: list[int], max_new_tokens: int, *, temperature: float = 0.8,
               top_k: int | None = 50, seed: int = 0, device: str | torch.device = "cpu",
               use_generate: bool = True, vocab_limit: int | None = None) -> list[int]:
    """New token ids after `prompt`: archlab.generate when it is available and the sample fits the
    context, else a plain loop (full forward per token, no cache, a window sliding past the context)
    that picks each token with generation's next_token. Temperature 0 (or below) is greedy. Draws from
    a private generator, so the caller's RNG stream (and hence a resumed run) is untouched.
    vocab_limit: only ids below it (a model padded past its tokenizer)."""
    device = torch.device(device)
    was_training = model.training
    model.eval()
    try:
        limit = model.config.max_seq_len if hasattr(model, "config") else None
        fits = limit is None or len(prompt) + max_new_tokens <= limit   # else: the sliding loop below
        if use_generate and fits:
            ids = _try_archlab_generate(model, prompt, max_new_tokens, temperature, top_k, seed, device,
                                        vocab_limit)
            if ids is not None:
                return ids
        params = SamplingParams(temperature=max(temperature, 0.0), top_k=top_k)
        gen = torch.Generator(device=device).manual_seed(seed)
        x = torch.tensor([prompt], dtype=torch.long, device=device)
        out = []
        for _ in range(max_new_tokens):
            window = x if limit is None else x[:, -limit:]
            logits = model(window)[:, -1, :vocab_limit].float()              # (1, v)
            nxt = next_token(logits, params, generator=gen)[:, None]          # (1, 1)
            x = torch.cat([x, nxt], dim=1)
            out.append(int(nxt))
        return out
    finally:
        model.train(was_training)


def _try_archlab_generate(model, prompt, max_new_tokens, temperature, top_k, seed, device, vocab_limit=None):
    """archlab.generation.generate (KV cache): prompt (t,) -> prompt + new ids (t + n,)."""
    from archlab.generation import generate
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            out = generate(model, torch.tensor(prompt, dtype=torch.long, device=device),
                           max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                           vocab_limit=vocab_limit)
    except Exception as exc:  # a sample must never stop a training run
        warnings.warn(f"archlab.generate failed ({exc}); sampling with the plain loop", stacklevel=2)
        return None
    return [int(t) for t in out.reshape(-1)[len(prompt):].tolist()]
