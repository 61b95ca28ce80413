"""Evaluation: validation loss, perplexity and bits per byte; and progress samples through archlab.generate.

Bits per byte (bpb) makes losses comparable across tokenizers: the model's total code length in bits
divided by the UTF-8 bytes it encodes,  bpb = loss_nats * tokens / (bytes * ln 2)  (e.g. Gao et al.
2020, "The Pile"). `bytes` is the split's bytes per token (meta.json) times the tokens scored.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from archlab.training.precision import autocast  # re-exported: the step's bf16 / float32 context
from archlab.units import bits_per_byte  # re-exported: eval.evaluate.bits_per_byte, its long-standing name

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


@torch.no_grad()
def evaluate(model: nn.Module, dataset, *, batch_size: int, seq_len: int,
             max_batches: int | None = None, device: str | torch.device = "cpu",
             dtype: str = "float32", dist_info=None, progress: bool = False, objective=None) -> EvalResult:
    """Cross-entropy over `max_batches` deterministic validation batches of `dataset` (token windows: spread
    over the split; archlab.data.batches.validation_batches: token windows, or source/target pairs for an
    archlab.data.seq2seq.Seq2SeqDataset).
    Under data parallelism every rank runs the same number of forwards (FSDP needs all ranks in each all-gather);
    the sums are all-reduced. `objective` (an objectives.Objective, or a batches.Task that may draw its own rows)
    turns the windows as in training, batch i the same way at every evaluation: an encoder scored on its masked
    slots, an encoder-decoder on its noised spans."""
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
               use_cache: bool = True, vocab_limit: int | None = None) -> list[int]:
    """New token ids after `prompt`, through archlab.generate: over the KV cache, or recomputing every step
    (use_cache=False: FSDP's sharded forwards, where every rank must run each one). Past the model's context
    the window slides: each round prompts with the last half-context and fills the rest. Temperature 0 is
    greedy. Draws from a private generator, so the caller's RNG stream (and a resumed run) is untouched.
    vocab_limit: only ids below it (a model padded past its tokenizer).
    Example: sample_ids(model, tok.encode("ROMEO:"), 40, seed=0)"""
    from archlab.generation import generate

    device = torch.device(device)
    limit = getattr(getattr(model, "config", None), "max_seq_len", None)
    generator = torch.Generator(device=device).manual_seed(seed)
    ids, n_new = list(prompt), 0
    was_training = model.training
    model.eval()
    try:
        while n_new < max_new_tokens:
            window = ids if limit is None or len(ids) < limit else ids[-(limit // 2):]
            room = max_new_tokens - n_new if limit is None else min(max_new_tokens - n_new, limit - len(window))
            out = generate(model, torch.tensor(window, dtype=torch.long, device=device), room,
                           temperature=max(temperature, 0.0), top_k=top_k, generator=generator,
                           use_cache=use_cache, vocab_limit=vocab_limit, eos_token_id=[])
            fresh = out[len(window):].tolist()
            ids += fresh
            n_new += len(fresh)
    finally:
        model.train(was_training)
    return ids[len(prompt):]
