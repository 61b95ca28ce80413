"""A written GGUF file read back twice, through archlab (load.py) and through transformers' own GGUF loader, with
the logits and perplexity printed beside the model's: what `archlab convert --to-gguf` shows after writing.

    report = readback(model, "out/model.gguf", ids)      # {"archlab": {...}, "transformers": {...} or a reason}
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from archlab.config import ModelConfig

# perplexity text when the run has a tokenizer (random tokens otherwise)
SAMPLE_TEXT = ("The capital of France is Paris. It lies on the Seine, and about two million people live in the city "
               "itself. Paris is known for its museums, its cafes and the Eiffel Tower, which was built for the "
               "world fair of 1889. Every year, millions of visitors come to see it.")


def sample_ids(model: torch.nn.Module, tokenizer: Any = None, seq_len: int = 48, seed: int = 0) -> torch.Tensor:
    """(1, t) ids: SAMPLE_TEXT through `tokenizer` (cut to the model's context), else seeded random tokens."""
    cfg: ModelConfig = model.config       # type: ignore[assignment]
    if tokenizer is not None:
        ids = list(tokenizer.encode(SAMPLE_TEXT))[:cfg.max_seq_len]
        if len(ids) >= 2 and max(ids) < cfg.vocab_size:
            return torch.tensor([ids])
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (1, min(seq_len, cfg.max_seq_len)), generator=gen)


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """exp(mean next-token cross-entropy) of logits (1, t, v) on ids (1, t)."""
    loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
    return math.exp(float(loss))


def compare(reference: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor) -> dict[str, float]:
    """max |a - b| / max |a| and both perplexities."""
    rel = float((logits.float() - reference.float()).abs().max() / reference.float().abs().max())
    return {"max_rel": rel, "ppl_ref": perplexity(reference, ids), "ppl": perplexity(logits, ids)}


def readback(model: torch.nn.Module, path: str | os.PathLike, ids: torch.Tensor) -> dict[str, Any]:
    """The file's logits on `ids` against `model`'s: read by archlab, and by transformers when it is installed
    (its result is the reason it could not read the file otherwise: transformers lacks some architectures'
    fields, such as GPT-2's n_inner)."""
    from archlab.interop.gguf.load import load_gguf
    from archlab.progress import transformers_quiet

    path = Path(path)
    with torch.no_grad():
        reference = model(ids)
        out: dict[str, Any] = {"archlab": compare(reference, load_gguf(path)(ids), ids)}
        try:
            import transformers
        except ImportError:
            out["transformers"] = "transformers is not installed (pip install archlab[hf])"
            return out
        try:
            with transformers_quiet():       # its bars would interleave with the command's own lines
                theirs = transformers.AutoModelForCausalLM.from_pretrained(
                    path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager").eval()
            out["transformers"] = compare(reference, theirs(ids, use_cache=False).logits, ids)
        except Exception as exc:        # any failure of the other library is reported, not raised
            out["transformers"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return out


def report_lines(report: dict[str, Any]) -> list[str]:
    """One line per reader: max relative logit difference and perplexity against the model's."""
    lines = []
    for reader, result in report.items():
        if isinstance(result, str):
            lines.append(f"read back by {reader:<12}  not compared: {result}")
            continue
        change = 100 * (result["ppl"] / result["ppl_ref"] - 1)
        lines.append(f"read back by {reader:<12}  max rel logit diff {result['max_rel']:.2e}   perplexity "
                     f"{result['ppl']:.3f} vs the run's {result['ppl_ref']:.3f} ({change:+.2f}%)")
    return lines
