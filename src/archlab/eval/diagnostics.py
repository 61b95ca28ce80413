"""Attention sinks, massive activations and attention entropy of a trained model on some text.

- Attention sinks (Xiao et al. 2023, arXiv 2309.17453, StreamingLLM): the share of attention each head
  puts on the first token, averaged over queries 1..t-1 (query 0 can only see token 0, so it is left out).
- Massive activations (Sun et al. 2024, arXiv 2402.17762): per layer, the largest |hidden state| and the
  (token, dimension) where it occurs, against the median |hidden state|; a ratio of 1e3-1e5 is "massive".
  Hidden states are the residual stream after each block (forward hooks on model.blocks).
- Attention entropy per head, in nats, averaged over queries 1..t-1 (uniform over n keys = ln n).
- Effective rank of each layer's hidden states (Roy & Vetterli 2007): exp of the entropy of the normalized
  singular values of the (t, d) matrix of a row's token states; 1 when every token's state is the same
  direction (rank collapse, Dong et al. 2021, arXiv 2103.03404), min(t, d) when all directions are equally used.
- Dead units per layer (Lu et al. 2019, "Dying ReLU"): the share of a ReLU-family MLP's units (relu, relu2, and
  reglu's gate) whose pre-activation is <= 0 at every token of the batch, so they pass nothing and get no
  gradient from it; None for activations that are never exactly zero (GeLU, SiLU, ...). A MoE layer counts
  the units of the experts that received tokens.
- Max attention logit per layer (Wortsman et al. 2023, arXiv 2309.14322): the largest raw q.k * scale
  before soft-capping, over the causal (and window) mask; growth past ~1e4 precedes divergence.
- Induction heads (Olsson et al. 2022, arXiv 2209.11895): the prefix-matching score of each head, its mean
  attention, on a random token sequence repeated twice, from each token of the second copy to the token after
  that token's occurrence in the first copy (where an induction head looks to copy what came next); ~0 for a
  head that does not, 1 for a perfect one.

Attention probabilities come from the model's own eager path: `record_probs = True` on every
`model.blocks[i].attn` keeps `last_probs` (b, h, t, s). Gated attention (Qiu et al. 2025) scales the
output after the softmax, so the probabilities measured here are before the gate.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import torch

from archlab.progress import progress_bar

__all__ = ["diagnose", "effective_rank", "singular_values", "dead_unit_fractions", "RELU_FAMILY",
           "max_attention_logits", "attention_scores", "prefix_matching", "prefix_matching_scores", "save_report",
           "load_model_and_tokenizer"]


def effective_rank(hidden: torch.Tensor) -> float:
    """exp(H(p)), p = sigma / sum(sigma) over the singular values of `hidden` (t, d): Roy & Vetterli (2007).
    Example: effective_rank(torch.eye(4)) -> 4.0; effective_rank(torch.ones(5, 3)) -> 1.0"""
    sigma = singular_values(hidden)
    total = sigma.sum()
    if total <= 0:
        return 0.0
    p = sigma / total
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


def singular_values(x: torch.Tensor) -> torch.Tensor:
    """float64 singular values of `x` (t, d), computed on one thread and on its tall orientation (d, t) where t < d:
    LAPACK's threaded SVD of SmolLM2's (256, 576) hidden states took 0.59 s each on 2 cores with the other core
    busy, 0.01 s on one; the (576, 256) orientation gives the same values ~1.8x sooner.
    Example: singular_values(torch.eye(3)) -> tensor([1., 1., 1.], dtype=torch.float64)"""
    x = x.double()
    if x.shape[0] < x.shape[1]:
        x = x.T
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return torch.linalg.svdvals(x)
    finally:
        torch.set_num_threads(threads)


# activations whose output is exactly 0 wherever the (gate's) pre-activation is <= 0
RELU_FAMILY = ("relu", "relu2", "reglu")


@torch.no_grad()
def dead_unit_fractions(model, input_ids: torch.Tensor) -> list[float | None]:
    """Per block: the share of its ReLU-family MLP units never active (pre-activation <= 0) on any token of
    `input_ids` (b, t); None where the block's MLP is of another activation.
    Example: dead_unit_fractions(model, ids) -> [0.0, 0.125, None, ...]"""
    from archlab.nn.mlp import DenseMLP

    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    counts: dict[int, list[int]] = {}            # block -> [dead units, units]

    def hook_for(i: int):
        def hook(mlp, args):
            x = args[0]
            if x.shape[:-1].numel() == 0:                      # an expert that got no token
                return
            proj = mlp.gate_proj if mlp.gate_proj is not None else mlp.up_proj   # what the ReLU reads
            pre = proj(x).flatten(0, -2)                                            # (tokens, f)
            dead = int((pre.amax(0) <= 0).sum())
            c = counts.setdefault(i, [0, 0])
            c[0] += dead
            c[1] += pre.shape[-1]
        return hook

    hooks = [mlp.register_forward_pre_hook(hook_for(i)) for i, blk in enumerate(model.blocks)
             for mlp in blk.modules() if isinstance(mlp, DenseMLP) and mlp.activation in RELU_FAMILY]
    if not hooks:                                # nothing to count: no forward (a whole one on a real model)
        return [None] * len(model.blocks)
    try:
        model.eval()
        model(input_ids.to(next(model.parameters()).device))
    finally:
        for h in hooks:
            h.remove()
    return [counts[i][0] / counts[i][1] if i in counts else None for i in range(len(model.blocks))]


def _attn_modules(model) -> list:
    return [block.attn for block in model.blocks]


@torch.no_grad()
def diagnose(model, input_ids: torch.Tensor, tokens: Sequence[str] | None = None, top_k: int = 5,
             progress: bool = False) -> dict:
    """Sinks, massive activations and entropies of `model` on `input_ids` (b, t) or (t,).

    Returns a JSON-ready dict: per layer `first_token_mass` and `entropy` per head, `max_abs`,
    `median_abs`, `ratio`, `dead_unit_fraction` (dead_unit_fractions), and the `top` activations (batch row,
    token index, token, dim, value); and a `summary` (first_token_mass averaged over layers and heads, max_ratio
    and its layer, max_activation, mean_entropy, dead_unit_fraction averaged over the layers that have one).
    progress=True: a bar over the layers (archlab.progress) while each is measured.
    """
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    b, t = input_ids.shape
    if t < 2:
        raise ValueError("diagnose needs at least 2 tokens")
    model.eval()
    attns = _attn_modules(model)
    hidden: list[torch.Tensor] = []
    hooks = [blk.register_forward_hook(lambda _m, _i, out: hidden.append(out.detach().float()))
             for blk in model.blocks]
    old = [a.record_probs for a in attns]
    try:
        for a in attns:
            a.record_probs = True
        device = next(model.parameters()).device
        model(input_ids.to(device))
        probs = [a.last_probs.float() for a in attns]                 # each (b, h, t, s)
    finally:
        for h in hooks:
            h.remove()
        for a, o in zip(attns, old):
            a.record_probs = o
            a.last_probs = None
    layers = []
    bar = progress_bar(total=len(probs), desc="measuring layers", unit="layer", disable=not progress, leave=False)
    for i, (p, hs) in enumerate(zip(probs, hidden)):
        p = p[:, :, 1:, :]                                            # queries 1..t-1
        first = p[..., 0].mean(dim=(0, 2))                            # (h,)
        ent = -(p * p.clamp_min(1e-30).log()).sum(-1).mean(dim=(0, 2))  # (h,)
        mag = hs.abs()                                                # (b, t, d)
        flat = mag.flatten()
        median = float(flat.median())
        vals, idx = flat.topk(min(top_k, flat.numel()))
        top = []
        for j in idx.tolist():
            row, rest = divmod(j, t * hs.shape[-1])
            pos, dim = divmod(rest, hs.shape[-1])
            top.append({"row": row, "token_index": pos, "dim": dim, "value": float(hs[row, pos, dim]),
                        "token": tokens[pos] if tokens is not None and pos < len(tokens) else None})
        max_abs = float(vals[0])
        layers.append({
            "layer": i, "first_token_mass": first.tolist(), "entropy": ent.tolist(),
            "max_abs": max_abs, "median_abs": median,
            "ratio": max_abs / median if median > 0 else float("inf"), "top": top,
            "effective_rank": sum(effective_rank(row) for row in hs) / len(hs),   # mean over batch rows
        })
        bar.update()
    bar.close()
    dead = dead_unit_fractions(model, input_ids)
    for layer, fraction in zip(layers, dead):
        layer["dead_unit_fraction"] = fraction
    # the text's own tokens drawn at random and repeated (induction heads); 64 tokens a copy keeps every layer's
    # recorded probabilities (rows, h, 128, 128) small for large models
    half = min(t, model.config.max_seq_len // 2, 64)
    causal = getattr(model.config, "arch", "decoder") != "encoder"
    matching = (prefix_matching_scores(model, sorted(set(input_ids.flatten().tolist())), half, rows=4)
                if causal and half >= 2 else [None] * len(layers))
    for layer, scores in zip(layers, matching):
        layer["prefix_matching"] = scores
    known_dead = [d for d in dead if d is not None]
    ratios = [layer["ratio"] for layer in layers]
    worst = max(range(len(layers)), key=lambda i: ratios[i])
    summary = {
        "n_tokens": t, "batch": b, "n_layers": len(layers),
        "first_token_mass": float(torch.tensor([layer["first_token_mass"] for layer in layers]).mean()),
        "max_ratio": ratios[worst], "max_ratio_layer": worst,
        "max_activation": max(layer["max_abs"] for layer in layers),
        "mean_entropy": float(torch.tensor([layer["entropy"] for layer in layers]).mean()),
        # uniform attention over the keys a query sees: i + 1 of them in a causal model, all t in an encoder
        "uniform_entropy": (math.log(t) if getattr(model.config, "arch", "decoder") == "encoder"
                            else float(sum(math.log(i + 1) for i in range(1, t)) / (t - 1))),
        "final_effective_rank": layers[-1]["effective_rank"],
        "dead_unit_fraction": sum(known_dead) / len(known_dead) if known_dead else None,   # mean over layers
        **_strongest_induction_head(matching),
    }
    return {"summary": summary, "layers": layers,
            "tokens": list(tokens[:t]) if tokens is not None else None}


def prefix_matching(probs: torch.Tensor, half: int) -> torch.Tensor:
    """(h,) prefix-matching score per head from attention probabilities (b, h, t, s) on rows whose second half
    repeats the first (t = 2 half): the mean over rows and queries i in [half, 2 half) of probs[..., i, i - half + 1].
    Example: a head attending only there scores 1.0; uniform causal attention scores about 1/(1.5 half)"""
    queries = torch.arange(half, 2 * half)                            # the second copy
    keys = queries - half + 1                                         # after the token's first occurrence
    return probs[:, :, queries, keys].float().mean(dim=(0, 2))        # (b, h, half) -> (h,)


@torch.no_grad()
def prefix_matching_scores(model, pool: Sequence[int], half: int, rows: int = 8, seed: int = 0) -> list[list[float]]:
    """Per layer, the prefix-matching score of each head (Olsson et al. 2022): `rows` sequences of `half` tokens
    drawn uniformly from `pool` (e.g. the ids of the text being diagnosed, so they are in-distribution), each
    repeated twice. Example: prefix_matching_scores(model, range(97, 123), 32) -> [[0.02, 0.01, ...], ...]"""
    if half < 2 or 2 * half > model.config.max_seq_len:
        raise ValueError(f"prefix matching needs 2 <= half and 2 x half <= max_seq_len={model.config.max_seq_len}")
    ids = torch.as_tensor(list(pool), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    first = ids[torch.randint(len(ids), (rows, half), generator=g)]   # (rows, half)
    x = torch.cat([first, first], dim=1)                              # (rows, 2 half)
    model.eval()
    attns = _attn_modules(model)
    old = [a.record_probs for a in attns]
    try:
        for a in attns:
            a.record_probs = True
        model(x.to(next(model.parameters()).device))
        return [prefix_matching(a.last_probs, half).tolist() for a in attns]
    finally:
        for a, o in zip(attns, old):
            a.record_probs = o
            a.last_probs = None


def _strongest_induction_head(matching: list) -> dict:
    """max_prefix_matching and the (layer, head) where it is; None for both without scores (an encoder)."""
    cells = [(score, (li, hi)) for li, row in enumerate(matching) if row for hi, score in enumerate(row)]
    if not cells:
        return {"max_prefix_matching": None, "max_prefix_matching_at": None}
    score, at = max(cells)
    return {"max_prefix_matching": score, "max_prefix_matching_at": list(at)}


@torch.no_grad()
def attention_scores(model, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Raw attention logits q.k * scale per layer, (b, h, t, s), -inf where masked; before soft-cap and
    before position biases (ALiBi/T5), i.e. the quantity whose growth Wortsman et al. track.

    Read from each layer's own attention call (archlab.nn.attention_backends.observe): the q and k it
    computed, norms, clipping and rotation included, and its mask.
    """
    from archlab.nn.attention_backends import AttnCall, observe

    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    model.eval()
    scores: list[torch.Tensor] = []

    def record(call: AttnCall) -> None:
        k = call.k.repeat_interleave(call.q.shape[1] // call.k.shape[1], dim=1)      # (b, h, s, e)
        s = (call.q @ k.transpose(-1, -2)).float() * call.scale                       # (b, h, t, s)
        mask = call.dense_mask()
        scores.append(s if mask is None else s.masked_fill(~mask, float("-inf")))

    device = next(model.parameters()).device
    with torch.no_grad(), observe(record):
        model(input_ids.to(device))
    return scores


def max_attention_logits(model, input_ids: torch.Tensor) -> list[float]:
    """Largest |raw attention logit| per layer over the allowed (causal/window) positions."""
    out = []
    for s in attention_scores(model, input_ids):
        finite = s[torch.isfinite(s)]
        out.append(float(finite.abs().max()) if finite.numel() else float("nan"))
    return out


# --------------------------------------------------------------------------- plots and files
def save_report(result: dict, out_dir: str | Path) -> dict[str, Path]:
    """summary.json and PNGs (first-token mass and entropy per layer x head; max/median ratio and effective
    rank per layer) into out_dir; returns the paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "summary.json"}
    paths["json"].write_text(json.dumps(result, indent=2, default=_json_default) + "\n")
    layers = result["layers"]
    shares = ("first_token_mass", "prefix_matching")          # in [0, 1]: one colour scale for every model
    for key, title, fname, cmap in (
        ("first_token_mass", "attention mass on the first token", "sinks.png", "viridis"),
        ("entropy", "attention entropy (nats)", "entropy.png", "magma"),
        ("prefix_matching", "prefix-matching score (induction heads)", "induction.png", "viridis"),
    ):
        grid = [layer.get(key) for layer in layers]
        if any(row is None for row in grid):                  # no induction scores for an encoder
            continue
        fig, ax = plt.subplots(figsize=(1.2 + 0.5 * len(grid[0]), 1.2 + 0.4 * len(grid)), dpi=110)
        im = ax.imshow(grid, cmap=cmap, aspect="auto", vmin=0 if key in shares else None,
                       vmax=1 if key in shares else None)
        for li, row in enumerate(grid):
            for hi, v in enumerate(row):
                ax.text(hi, li, f"{v:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if (key in shares and v < 0.5) else "black")
        ax.set_xticks(range(len(grid[0])))         # one tick per head and per layer: cells sit on integers
        ax.set_yticks(range(len(grid)))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(title, fontsize=9)
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        paths[key] = out / fname
        fig.savefig(paths[key])
        plt.close(fig)
    x = [layer["layer"] for layer in layers]
    paths["massive"] = _per_layer_plot(plt, x, [layer["ratio"] for layer in layers], "max |h| / median |h|",
                                       "massive activations per layer", out / "massive_activations.png", log=True)
    paths["effective_rank"] = _per_layer_plot(plt, x, [layer["effective_rank"] for layer in layers],
                                              "effective rank of the hidden states",
                                              "rank collapse: 1 = every token in one direction",
                                              out / "effective_rank.png")
    return paths


def _per_layer_plot(plt, x: list, y: list, ylabel: str, title: str, path: Path, log: bool = False) -> Path:
    """One quantity per layer as a line (log scale for ratios), saved to `path`."""
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    (ax.semilogy if log else ax.plot)(x, y, "o-")
    if not log:
        ax.set_ylim(bottom=0)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))     # layers are whole numbers: no 0.5 ticks
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _json_default(obj: Any):
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return str(obj)


def load_model_and_tokenizer(path: str | Path):
    """(model, tokenizer or None) from an archlab run folder or an HF folder (archlab.runs.model_folder)."""
    from archlab.runs.model_folder import load_model_and_tokenizer as load
    return load(path, need_tokenizer=False, archs=("decoder", "encoder"), purpose="diagnose")


def encode_text(tokenizer, text: str, max_tokens: int) -> tuple[list[int], list[str]]:
    """Token ids (at most max_tokens) and a printable string per token."""
    if tokenizer is None:
        raise ValueError("this model folder has no tokenizer: cannot encode --text")
    enc = tokenizer.encode(text)
    ids = list(enc.ids) if hasattr(enc, "ids") else list(enc)
    ids = ids[:max_tokens]
    pieces = []
    for i in ids:
        try:
            if hasattr(tokenizer, "id_to_token") and not hasattr(tokenizer, "eot_id"):
                piece = tokenizer.id_to_token(i)
            else:
                piece = tokenizer.decode([i])
        except Exception:  # noqa: BLE001 - a label only
            piece = str(i)
        pieces.append(piece if piece is not None else str(i))
    return ids, pieces
