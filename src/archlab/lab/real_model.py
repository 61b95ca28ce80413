"""The measurements of the real-model lab suites (runs: real_model; archlab.lab.real_model_run loads the model): the
attention notes' claims about massive activations, quantization and attention sinks, measured on a pretrained model
(SmolLM2-135M-Instruct from the `models` extra by default). Each suite's variant names one condition (what is
zeroed, how the linears are quantized, which cache decodes); its measurement returns the row's metrics (`ppl`, and
what the probe found), and the suite's rules (archlab.lab.verdicts, kind `bound`) judge them across rows.

    massive_activations  Sun et al. 2024 (arXiv 2402.17762): the largest |h| / median per layer (eval/diagnostics),
                         the massive entries of the peak middle layer (|h| > 100 and >= 1,000x the median, the
                         paper's definition), and perplexity with nothing, those entries, or as many random ones
                         zeroed after every block from where they appear
    quantization         Dettmers et al. 2022 (arXiv 2208.07339): perplexity in float, per-tensor and per-token W8A8,
                         int8 weight-only (the int8 run's own path, nn/int8) and the LLM.int8 outlier split; the
                         fake-quantization math is nn/quantize's, the one the int8 run uses
    streaming            Xiao et al. 2023 (arXiv 2309.17453): perplexity past the window as decoding token by token
                         computes it, with the full cache, a window cache (first tokens dropped) or StreamingLLM's (4
                         sinks + window - 4; nn/kv_cache.SinkKVCache, in-cache positions as in the paper), several
                         stretches of text as one batch, each scored in one forward (SinkKVCache.stretch)

Example: MEASURES["quantization"](model, ids, {"scheme": "w8a8_per_token", "seq_len": 256})["ppl"]
"""
from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from archlab.eval.perplexity import perplexity
from archlab.nn import quantize as qm

__all__ = ["MEASURES", "SETTINGS", "SCHEMES", "CACHES", "ZEROED", "massive_activations", "quantization", "streaming"]

MIDDLE_MARGIN = 2          # layers at each end that are not "middle"
RANDOM_DRAWS = 3           # random zeroings averaged


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


def _probe(model: nn.Module, ids: torch.Tensor, seq_len: int) -> dict:
    """Where the massive activations sit: per-layer max/median (eval/diagnostics), the peak middle layer's massive
    entries (token, dim), and the layers they are zeroed after (from the first with a ratio >= 100)."""
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
    # Sun et al.'s definition: |h| > 100 and about 1,000x the median (entries >= 100x the median are counted too)
    entries = [(int(t), int(d)) for t, d in ((h > 100) & (h >= 1_000 * median)).nonzero().tolist()]
    first = [i for i in range(n) if layers[i]["ratio"] >= 100]                # where they appear, onward
    return {"ratios": [layer["ratio"] for layer in layers], "peak_layer": peak, "peak_ratio": layers[peak]["ratio"],
            "entries": entries, "dims": sorted({d for _, d in entries}), "width": h.shape[1],
            "over_100x_median": int((h >= 100 * median).sum()), "zero_from": first[0] if first else peak}


ZEROED = ("none", "massive", "random")


@torch.no_grad()
def massive_activations(model: nn.Module, ids: torch.Tensor, *, zeroed: str = "none", seq_len: int = 256,
                        seed: int = 0) -> dict:
    """The probe's findings and the perplexity with `zeroed` (none, the massive entries, or as many random (token > 0,
    dim) entries, the mean of 3 draws) set to 0 after every block from where they appear."""
    if zeroed not in ZEROED:
        raise ValueError(f"zeroed={zeroed!r}; known: {', '.join(ZEROED)}")
    found = _probe(model, ids, seq_len)
    entries, layers = found["entries"], list(range(found["zero_from"], len(found["ratios"])))
    draws: list[list[tuple[int, int]]] = [[]]
    if zeroed == "massive":
        draws = [entries]
    elif zeroed == "random":
        gen = torch.Generator().manual_seed(seed)
        draws = [[(int(torch.randint(1, seq_len, (1,), generator=gen)),
                   int(torch.randint(0, found["width"], (1,), generator=gen))) for _ in entries]
                 for _ in range(RANDOM_DRAWS)]
    ppls = []
    for picks in draws:
        with _zeroed(model, layers, picks):
            ppls.append(perplexity(model, ids, seq_len))
    at_first = sum(t == 0 for t, _ in entries)
    return {"ppl": sum(ppls) / len(ppls), "ppl_draws": ppls, "peak_ratio": found["peak_ratio"],
            "peak_layer": found["peak_layer"], "ratios": found["ratios"], "n_massive": len(entries),
            "massive_dims": len(found["dims"]), "massive_dim_ids": found["dims"],
            "massive_at_first_token": at_first / len(entries) if entries else 0.0,
            "entries_over_100x_median": found["over_100x_median"], "zeroed_from_layer": found["zero_from"],
            "n_zeroed": len(draws[0])}


@contextlib.contextmanager
def _linears_as(model: nn.Module, forward: Callable[[nn.Linear, torch.Tensor], torch.Tensor]) -> Iterator[nn.Module]:
    """Within the block, every nn.Linear of the model's blocks computes forward(linear, x) instead."""
    linears = [m for m in model.blocks.modules() if type(m) is nn.Linear]
    for lin in linears:
        lin.forward = (lambda x, lin=lin: forward(lin, x))                    # type: ignore[method-assign]
    try:
        yield model
    finally:
        for lin in linears:
            del lin.forward


Scheme = Callable[[nn.Module], contextlib.AbstractContextManager]     # (model) -> the model to score, within


def _w8a8(activations: Callable[[torch.Tensor], torch.Tensor]) -> Scheme:
    """Weights int8 per output row, activations fake-quantized by `activations` (per tensor or per token)."""
    def scheme(model: nn.Module):
        weights = {lin: qm.fake_quant_rows(lin.weight) for lin in model.blocks.modules() if type(lin) is nn.Linear}
        return _linears_as(model, lambda lin, x: F.linear(activations(x), weights[lin], lin.bias))
    return scheme


@contextlib.contextmanager
def _int8_weights(model: nn.Module) -> Iterator[nn.Module]:
    from archlab.nn.int8 import quantize_int8
    yield quantize_int8(copy.deepcopy(model))


# a quantization variant's scheme -> (model) -> a context manager giving the model to score (the original restored)
SCHEMES: dict[str, Scheme] = {
    "float": contextlib.nullcontext,
    "w8a8_per_tensor": _w8a8(qm.fake_quant_per_tensor),
    "w8a8_per_token": _w8a8(qm.fake_quant_per_token),
    "int8_weight_only": _int8_weights,
    "outlier_split": lambda model: _linears_as(
        model, lambda lin, x: qm.outlier_split_linear(x, lin.weight, lin.bias, threshold=6.0)),
}


@torch.no_grad()
def quantization(model: nn.Module, ids: torch.Tensor, *, scheme: str = "float", seq_len: int = 256) -> dict:
    """Perplexity with the blocks' linears under `scheme` (SCHEMES; the LLM.int8 split at threshold 6)."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r}; known: {', '.join(SCHEMES)}")
    with SCHEMES[scheme](model) as scored:
        return {"ppl": perplexity(scored, ids, seq_len)}


def _token_nll(model: nn.Module, ids: torch.Tensor, cache, *, start: int = 0,
               stepwise: bool = False) -> torch.Tensor:                          # (b, L) -> (b, L - 1 - start)
    """Next-token NLL of the targets past `start` (start + 1 .. L - 1): one forward over the tokens, through `cache`
    when given (a fresh nn/kv_cache.SinkKVCache scores a stretch past its capacity as decoding it would:
    SinkKVCache.stretch), or stepwise, one token at a time through `cache` (what decoding computes, the reference the
    one forward is tested equal to). The full cache is cache=None: one causal forward."""
    if not stepwise:
        hidden = model(ids[:, :-1], cache=cache, return_hidden=True)[:, start:]   # (b, L - 1 - start, d)
        logits = model.lm_head(hidden).float()                                     # only the scored targets' logits
        return F.cross_entropy(logits.transpose(1, 2), ids[:, start + 1:], reduction="none")
    nll = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    for i in range(ids.shape[1] - 1):
        pos = torch.full((ids.shape[0], 1), i)
        logits = model(ids[:, i:i + 1], positions=pos, cache=cache)[:, 0].float()
        nll[:, i] = F.cross_entropy(logits, ids[:, i + 1], reduction="none")
    return nll[:, start:]


CACHES = ("full", "window", "sinks")


@torch.no_grad()
def streaming(model: nn.Module, ids: torch.Tensor, *, cache: str = "full", window: int = 1024, scored: int = 256,
              rows: int = 4, sinks: int = 4) -> dict:
    """Perplexity past the window: `rows` consecutive stretches of the text, window + 1 + scored tokens each, scored
    as decoding them token by token through a window cache of `window` tokens (the first ones dropped) or `sinks`
    sinks + window - sinks recent ones computes, or seen whole (the full cache); the `scored` targets of each row
    past its window are scored. Each is one forward over the rows (SinkKVCache.stretch: the same scores as decoding
    them one at a time, tested so)."""
    from archlab.nn.kv_cache import SinkKVCache

    if cache not in CACHES:
        raise ValueError(f"cache={cache!r}; known: {', '.join(CACHES)}")
    length = window + 1 + scored                   # each scored target's context holds more than `window` tokens
    if not (0 < sinks < window and scored > 0 and rows > 0 and rows * length <= ids.numel()):
        raise ValueError(f"streaming needs 0 < sinks={sinks} < window={window}, scored={scored} > 0 and rows={rows} "
                         f"x {length} tokens <= the {ids.numel()} tokens of text")
    cfg = model.config
    made = {"full": lambda: None,
            "window": lambda: SinkKVCache(cfg, rows, sink_tokens=0, window=window),
            "sinks": lambda: SinkKVCache(cfg, rows, sink_tokens=sinks, window=window - sinks)}[cache]()
    batch = ids[:rows * length].view(rows, length)                             # (r, L)
    past = _token_nll(model, batch, made, start=window)                       # (r, scored): targets window+1 .. L-1
    return {"ppl": math.exp(float(past.mean())), "scored_tokens": past.numel()}


# a suite's `real_model.measure` -> its measurement; SETTINGS: the keys each takes (suite-wide or per variant)
MEASURES: dict[str, Callable[..., dict]] = {"massive_activations": massive_activations, "quantization": quantization,
                                            "streaming": streaming}
SETTINGS: dict[str, dict[str, type]] = {
    "massive_activations": {"zeroed": str, "seq_len": int, "seed": int},
    "quantization": {"scheme": str, "seq_len": int},
    "streaming": {"cache": str, "window": int, "scored": int, "rows": int, "sinks": int},
}
