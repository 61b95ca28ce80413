"""`archlab demo --arch encoder_decoder`: a T5-style encoder-decoder learns span corruption on Shakespeare.

    1-3. corpus, a byte-level BPE tokenizer with T5's sentinels <extra_id_0..15> among its specials, token data
    4.   train a small T5 v1.1-style model (pre-norm RMSNorm, gated GeLU, relative position buckets per stack, an
         untied head) on span corruption (Raffel et al. 2020: 15% of the tokens in spans of mean length 3, each
         span a sentinel in the source; the target lists the spans behind their sentinels)
    5.   report the validation loss on the held-out spans before/after and one held-out line with its spans
         filled in by greedy decoding next to the truth
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from archlab.config import ModelConfig
from archlab.training.trainer import TrainConfig

__all__ = ["EncoderDecoderDemoResult", "encoder_decoder_demo_configs", "run_encoder_decoder_demo", "SENTINELS"]

SENTINELS = [f"<extra_id_{i}>" for i in range(16)]     # more than a window's spans: round(0.15 * 128 / 3) = 6


@dataclass
class EncoderDecoderDemoResult:
    run_dir: Path
    val_loss_before: float          # cross-entropy of the target (sentinels + spans + EOS), nats per token
    val_loss_after: float
    source: str                     # a held-out window with its spans replaced by sentinels
    predicted: str                  # the model's target, greedy
    truth: str                      # the spans that were removed
    seconds: float


def encoder_decoder_demo_configs(*, quick: bool, vocab_size: int, minutes: float, start_id: int
                                 ) -> tuple[ModelConfig, TrainConfig]:
    """T5 v1.1-style encoder-decoder and its span-corruption training config; `quick` shrinks both to seconds."""
    d_model, layers, heads, d_ff = (32, 1, 4, 64) if quick else (192, 3, 6, 512)
    # init std d_model**-0.5, the scale of T5's dense weights, not GPT's 0.02: on spans of a cycling alphabet
    # (d_model 64, 600 steps) 0.02 left the loss at 0.95 nats, its cross-attention unable to find the sentinel,
    # where d_model**-0.5 reached 0.3-0.5, as transformers' T5 init does
    model = ModelConfig(name="demo-t5-quick" if quick else "demo-t5", arch="encoder_decoder", vocab_size=vocab_size,
                        d_model=d_model, n_layers=layers, max_seq_len=128, decoder_start_token_id=start_id,
                        init={"std": d_model ** -0.5},
                        attention={"n_heads": heads}, mlp={"activation": "geglu", "d_ff": d_ff},
                        norm={"kind": "rmsnorm", "position": "pre"},
                        position={"kind": "t5", "t5_num_buckets": 32, "t5_max_distance": 128},
                        tie_embeddings=False)
    if quick:
        train = TrainConfig(lr=3e-3, warmup_steps=2, batch_size=4, seq_len=64, budget=12, budget_unit="steps",
                            eval_every=6, eval_batches=2, log_every=2, checkpoint_every=6, sample_every=-1,
                            keep_last=1, device="cpu", objective="span_corruption")
        return model, train
    train = TrainConfig(lr=2e-3, warmup_steps=30, schedule="cosine", min_lr_ratio=0.1, weight_decay=0.01,
                        batch_size=16, seq_len=128, budget=minutes, budget_unit="minutes", eval_every=40,
                        eval_batches=8, log_every=5, checkpoint_every=200, keep_last=1, sample_every=-1,
                        device="cpu", dtype="auto", objective="span_corruption")
    return model, train


def first_token_guesses(model, tokenizer, inputs: dict, labels, sentinels, k: int = 3) -> list[str]:
    """One line per span of one row: the true first token after its sentinel and the model's top-k there, the
    decoder fed the true target before it (what the loss scores, easier to read than a greedy decode that an
    early model ends with the next sentinel)."""
    import torch

    from archlab.models.encoder_decoder import shift_right

    dec = shift_right(labels, model.config.decoder_start_token_id)                # (1, t): teacher forcing
    with torch.no_grad():
        logits = model(inputs["input_ids"], decoder_input_ids=dec, attention_mask=inputs.get("attention_mask"))
    probs = logits[0].float().softmax(-1)                          # (t, v): position j predicts labels[0, j]
    row, is_sentinel = labels[0], torch.isin(labels[0], sentinels)
    lines = []
    for j in torch.nonzero(is_sentinel[:-1]).flatten().tolist():
        if is_sentinel[j + 1]:                                      # an empty span: nothing to guess
            continue
        top = probs[j + 1].topk(k)
        shown = ", ".join(f"{tokenizer.decode([int(i)])!r} {float(p):.0%}" for p, i in zip(top.values, top.indices))
        lines.append(f"{tokenizer.decode([int(row[j])])} truth {tokenizer.decode([int(row[j + 1])])!r}: {shown}")
    return lines


def run_encoder_decoder_demo(out: Path, *, quick: bool, minutes: float, corpus: str, vocab_size: int | None,
                             progress: bool, log) -> EncoderDecoderDemoResult:
    from archlab.data.batches import objective_for
    from archlab.data.tokenizer_adapter import EOT_TOKEN
    from archlab.data.tokens import TokenDataset, eval_batches
    from archlab.demo.stages import busy_machine, prepare_demo_data, sign_off, train_and_reload
    from archlab.eval.evaluate import evaluate
    from archlab.generation import generate
    from archlab.models.encoder_decoder import EncoderDecoderLM

    t0 = time.perf_counter()
    vocab_size = vocab_size or (320 if quick else 2048)
    meta = prepare_demo_data(out, corpus, quick=quick, vocab_size=vocab_size, specials=[EOT_TOKEN, *SENTINELS],
                             progress=progress, log=log)
    data_dir = out / "data"
    model_cfg, train_cfg = encoder_decoder_demo_configs(quick=quick, vocab_size=int(meta["vocab_size"]),
                                                        minutes=minutes, start_id=int(meta["eot_id"]))
    val = TokenDataset(data_dir, "val")
    objective = objective_for(model_cfg, train_cfg, val).objective  # the trainer's validation spans (SpanCorruption)

    def score(model):
        return evaluate(model, val, batch_size=train_cfg.batch_size, seq_len=train_cfg.seq_len,
                        max_batches=train_cfg.eval.batches, objective=objective)

    untrained = EncoderDecoderLM(model_cfg)
    before = score(untrained)
    result, model, tokenizer = train_and_reload(
        model_cfg, train_cfg, data_dir, out, progress=progress, log=log,
        what=f"a T5-style encoder-decoder on span corruption ({untrained.num_params() / 1e6:.2f}M params, "
             f"{model_cfg.n_layers}+{model_cfg.stack_depth('cross_decoder')} layers, d_model {model_cfg.d_model}, "
             f"windows of {train_cfg.seq_len} tokens, 15% in spans of mean length 3)",
        before=f"validation loss on the held-out spans before training: {before.loss:.3f}")
    after = score(model)
    x, _ = next(eval_batches(val, 1, train_cfg.seq_len, 1))        # the first held-out window
    inputs, labels = objective.batch(x, step=-1)                   # its evaluation spans
    out_ids = generate(model, inputs["input_ids"], labels.shape[1] + 8, eos_token_id=val.eot_id)
    predicted = tokenizer.decode(out_ids[0, 1:].tolist())          # after the decoder start token
    source, truth = tokenizer.decode(inputs["input_ids"][0].tolist()), tokenizer.decode(labels[0].tolist())
    guesses = first_token_guesses(model, tokenizer, inputs, labels, objective.sentinels)
    with open(out / "samples.txt", "a") as f:
        f.write(f"=== demo span filling (step {result.steps}) ===\nsource: {source}\npredicted: {predicted}\n"
                f"truth: {truth}\n" + "".join(line + "\n" for line in guesses) + "\n")
    seconds = time.perf_counter() - t0
    log(f"      {result.steps} steps, {result.tokens_seen:,} tokens read (source + target), "
        f"{result.tokens_per_s:,.0f} tokens/s")
    busy_machine(result, progress, log)
    log(f"      validation loss on the held-out spans: {before.loss:.3f} before -> {after.loss:.3f} after")
    log("      a held-out window, its spans filled in greedily:")
    for name, text in (("source", source), ("predicted", predicted), ("truth", truth)):
        log(f"        {name + ':':<10} " + " ".join(text.split()))
    log("      each span's first token, the model's top 3 given the truth before it (teacher-forced):")
    for line in guesses:
        log("        " + line)
    sign_off(out, seconds, f"archlab generate {out} --source \"To be, or not to be, <extra_id_0> the question\"",
             log)
    return EncoderDecoderDemoResult(run_dir=out, val_loss_before=before.loss, val_loss_after=after.loss,
                                    source=source, predicted=predicted, truth=truth, seconds=seconds)
