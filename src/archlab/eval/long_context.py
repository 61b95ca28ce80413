"""Long-context evaluation: overlapping-window perplexity, loss by position in the window, and
perplexity by evaluation length.

Overlapping windows (`strided_nll`) are transformers' perplexity-guide loop ("Perplexity of fixed-length
models"): windows of `seq_len` tokens start every `stride` tokens, and each scores only the tokens that the
previous window did not, so every token after the first is scored once, with at least
seq_len - stride tokens of context (all but those of the first window). The guide weights each window's mean
by (scored tokens - 1); here each token's loss is summed exactly, which is what its formula means.

    nats, n = strided_nll(model, ids, seq_len=512, stride=256)      # ppl = exp(nats / n)
    by_pos = loss_by_position(model, val, seq_len=256, batch_size=8) # (256,) mean nats at each position
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["token_nll", "strided_windows", "strided_nll", "StridedResult", "strided_perplexity",
           "loss_by_position", "position_buckets", "plot_curve"]


def token_nll(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of each target, nats, (b, t) float32; 0 where targets == -100.
    inputs, targets: (b, t) long (targets already shifted)."""
    logits = model(inputs).float()                                    # (b, t, v)
    return F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="none")   # (b, t)


def strided_windows(n_tokens: int, seq_len: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """(begin, end, first_scored) of each window, in order, as the guide's loop walks them: a window holds
    tokens [begin, end), end = min(begin + seq_len, n_tokens), and scores tokens [first_scored, end) (those
    past the previous window's end; in the first window every token but the first).
    Example: list(strided_windows(10, 4, 2)) -> [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]"""
    if not 0 < stride < seq_len:
        raise ValueError(f"stride {stride} must be in 1..seq_len-1 = {seq_len - 1}")
    prev_end = 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + seq_len, n_tokens)
        if end - begin < 2:
            break
        yield begin, end, max(prev_end, begin + 1)
        prev_end = end
        if end == n_tokens:
            break


@torch.no_grad()
def strided_nll(model: nn.Module, ids: torch.Tensor, *, seq_len: int, stride: int, batch_size: int = 8,
                max_windows: int | None = None, device: str | torch.device = "cpu",
                progress: bool = False) -> tuple[float, int]:
    """(total nats, tokens scored) of the 1-D token stream `ids` under overlapping windows (strided_windows),
    batch_size windows per forward (windows of one length together). max_windows: only the first ones.
    Example: nats, n = strided_nll(model, torch.tensor(tok.encode(text)), seq_len=64, stride=32)"""
    windows = list(strided_windows(len(ids), seq_len, stride))[:max_windows]
    groups: dict[int, list[tuple[int, int, int]]] = {}
    for w in windows:
        groups.setdefault(w[1] - w[0], []).append(w)
    batches = [ws[i:i + batch_size] for ws in groups.values() for i in range(0, len(ws), batch_size)]
    if progress:
        from archlab.progress import progress_bar
        batches = progress_bar(batches, desc="strided eval", leave=False)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for batch in batches:
            span = torch.stack([ids[b:e] for b, e, _ in batch]).long()        # (n, L)
            x, y = span[:, :-1].clone(), span[:, 1:].clone()                  # (n, L - 1) each
            for row, (b, _, first) in enumerate(batch):
                y[row, : first - b - 1] = -100                                # tokens an earlier window scored
            nll = token_nll(model, x.to(device), y.to(device))
            total += float(nll.double().sum())
            count += int((y != -100).sum())
    finally:
        model.train(was_training)
    return total, count


@dataclass(frozen=True)
class StridedResult:
    loss: float       # mean nats per scored token
    ppl: float
    tokens: int       # tokens scored
    windows: int
    seq_len: int
    stride: int

    def to_dict(self) -> dict:
        return asdict(self)


def strided_perplexity(model: nn.Module, ids: torch.Tensor, *, seq_len: int, stride: int, batch_size: int = 8,
                       max_windows: int | None = None, device: str | torch.device = "cpu",
                       progress: bool = False) -> StridedResult:
    """strided_nll as a perplexity. Example: strided_perplexity(model, ids, seq_len=64, stride=16).ppl"""
    n_windows = len(list(strided_windows(len(ids), seq_len, stride))[:max_windows])
    nats, count = strided_nll(model, ids, seq_len=seq_len, stride=stride, batch_size=batch_size,
                              max_windows=max_windows, device=device, progress=progress)
    if count == 0:
        raise ValueError("strided evaluation scored no tokens")
    loss = nats / count
    return StridedResult(loss=loss, ppl=math.exp(min(loss, 700.0)), tokens=count, windows=n_windows,
                         seq_len=seq_len, stride=stride)


@torch.no_grad()
def loss_by_position(model: nn.Module, dataset, *, seq_len: int, batch_size: int, max_batches: int | None = None,
                     device: str | torch.device = "cpu", progress: bool = False) -> torch.Tensor:
    """(seq_len,) float64 mean next-token loss (nats) at each position of the validation windows
    (archlab.data.tokens.eval_batches: the windows `archlab eval` scores): entry p is the loss of predicting
    token p + 1 from the p + 1 tokens before it in its window. Example:
    loss_by_position(model, TokenDataset("data/d", "val"), seq_len=64, batch_size=8)[:4]"""
    from archlab.data.tokens import eval_batches

    batches = eval_batches(dataset, batch_size, seq_len, max_batches)
    if progress:
        from archlab.progress import progress_bar
        batches = progress_bar(batches, desc="loss by position", leave=False)
    total = torch.zeros(seq_len, dtype=torch.float64)
    rows = 0
    was_training = model.training
    model.eval()
    try:
        for x, y in batches:
            total += token_nll(model, x.to(device), y.to(device)).double().sum(0).cpu()   # (t,)
            rows += len(x)
    finally:
        model.train(was_training)
    return total / rows


def position_buckets(losses: Sequence[float]) -> list[tuple[int, int, float]]:
    """(first, last, mean loss) over positions 0, 1, 2-3, 4-7, ...: the table `eval --by-position` prints.
    Example: position_buckets([3.0, 2.0, 1.0, 1.0]) -> [(0, 0, 3.0), (1, 1, 2.0), (2, 3, 1.0)]"""
    out, first = [], 0
    while first < len(losses):
        last = min(len(losses) - 1, max(first, 2 * first - 1))
        chunk = losses[first:last + 1]
        out.append((first, last, float(sum(chunk) / len(chunk))))
        first = last + 1
    return out


def plot_curve(series: dict[str, tuple[Sequence[float], Sequence[float]]], path, *, xlabel: str, ylabel: str,
               title: str, logx: bool = True) -> None:
    """One PNG of named (x, y) curves (loss by position, perplexity by length), log-scaled x by default."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (name, (xs, ys)), style in zip(series.items(), itertools.cycle(("-o", "--s", "-.^", ":D"))):
        ax.plot(list(xs), list(ys), style, label=name, markersize=3)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(series) > 1:
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
