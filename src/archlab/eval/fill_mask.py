"""Fill-mask: an encoder's most likely tokens at each mask token of a text (BERT's cloze task).

    model, tok = load_masked_lm("runs/demo-encoder")        # archlab.runs.model_folder: a run or HF folder
    result = fill_mask(model, tok, "To be, or not to [MASK]", top_k=5)
    result.masks[0].predictions[0].token, result.filled

The text is encoded as the model saw text in training: a tokenizer with a post-processor (an HF BERT's
[CLS] ... [SEP], RoBERTa's <s> ... </s>) wraps it, archlab's own tokenizers (no post-processor) do not. One
forward scores every mask position at once, each independently of the others (as transformers' fill-mask
pipeline does); probabilities are the softmax over the model's whole vocabulary, and the top-k are drawn from
the ids the tokenizer can decode.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

import torch

from archlab.data.objectives import MASK_TOKENS
from archlab.errors import UserError
from archlab.models.encoder import EncoderLM

__all__ = ["FillMaskResult", "MaskPrediction", "Prediction", "encode_for_model", "fill_mask", "mask_token",
           "require_encoder"]

_KINDS = {"decoder": "a decoder-only model", "encoder_decoder": "an encoder-decoder model"}


@dataclass(frozen=True)
class Prediction:
    token_id: int
    token: str            # the piece decoded on its own (" the", "##ing")
    probability: float


@dataclass(frozen=True)
class MaskPrediction:
    position: int                     # index of the mask in the model's input ids (special tokens included)
    predictions: list[Prediction]     # best first


@dataclass(frozen=True)
class FillMaskResult:
    text: str
    filled: str                       # the text with each mask replaced by its top-1 token
    masks: list[MaskPrediction]

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        """The readable form: per mask its top-k pieces (quoted, so spaces show) and probabilities; the filled
        text."""
        lines = [f"text:   {self.text}"]
        for n, mask in enumerate(self.masks, 1):
            lines.append(f"mask {n} of {len(self.masks)} (token {mask.position}):")
            width = max(len(repr(p.token)) for p in mask.predictions)
            for rank, p in enumerate(mask.predictions, 1):
                lines.append(f"  {rank:>2}. {repr(p.token):<{width}}  {p.probability:7.2%}  (id {p.token_id})")
        lines.append(f"filled: {self.filled}")
        return "\n".join(lines)


def require_encoder(what: str, arch: str) -> None:
    """One line for a model fill-mask cannot use: `what` (a folder, a model's name) is not an encoder."""
    if arch != "encoder":
        raise UserError(f"{what} is {_KINDS.get(arch, f'arch={arch}')}; fill-mask needs an encoder (arch=encoder)")


def mask_token(tokenizer: Any) -> tuple[str, int]:
    """(spelling, id) of the tokenizer's mask token, [MASK] or <mask>; a tokenizer without one is a UserError."""
    for token in MASK_TOKENS:
        token_id = tokenizer.token_to_id(token) if hasattr(tokenizer, "token_to_id") else None
        if token_id is not None:
            return token, int(token_id)
    raise UserError("the tokenizer has no mask token ([MASK] or <mask>): fill-mask needs the tokenizer an encoder "
                    "was trained with (`archlab tokenizer train ... --special-tokens '<|endoftext|>' '[MASK]'`)")


def encode_for_model(tokenizer: Any, text: str, mask: str | None = None) -> tuple[list[int], slice]:
    """(ids the model reads, the slice of them that encodes the text itself). A tokenizer with a post-processor
    (archlab.tokenizer.HFTokenizer) adds its special tokens ([CLS] ... [SEP]) and applies its own rules around
    the mask token (RoBERTa's <mask> takes the space before it). archlab's own tokenizers add none; their
    pieces carry their leading space (" thee"), so one space right before `mask` goes with the mask, as it went
    with the token a mask replaced in training: "I [MASK] thee" reads as "I", [MASK], " thee"."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        if mask is not None:
            text = re.sub(" " + re.escape(mask), mask, text)
        ids = list(tokenizer.encode(text))
        return ids, slice(0, len(ids))
    body = hf.encode(text, add_special_tokens=False).ids
    ids = hf.encode(text, add_special_tokens=True).ids
    start = next((i for i in range(len(ids) - len(body) + 1) if ids[i:i + len(body)] == body), 0)
    return ids, slice(start, start + len(body))


@torch.no_grad()
def fill_mask(model: EncoderLM, tokenizer: Any, text: str, top_k: int = 5) -> FillMaskResult:
    """The top_k tokens (with probabilities) at each mask token of `text`, and the text with the top-1 filled
    in. UserErrors: no mask token in the tokenizer or in the text, a text past the model's max_seq_len."""
    config = model.config
    require_encoder(config.name, config.arch)
    if top_k < 1:
        raise UserError(f"--top-k {top_k} must be at least 1")
    spelling, mask_id = mask_token(tokenizer)
    ids, body = encode_for_model(tokenizer, text, spelling)
    positions = [i for i, t in enumerate(ids) if t == mask_id]
    if not positions:
        other = next((m for m in MASK_TOKENS if m != spelling and m in text), None)
        hint = f" ({other} is not this tokenizer's mask token)" if other else ""
        raise UserError(f"the text holds no mask token{hint}: write {spelling} where a token should be filled in, "
                        f"e.g. \"To be, or not to {spelling}\"")
    limit = config.max_seq_len
    if len(ids) > limit:
        raise UserError(f"the text is {len(ids)} tokens, past the model's max_seq_len={limit} positions: "
                        "shorten it")
    device = next(model.parameters()).device
    logits = model(torch.tensor([ids], device=device))[0, positions].float()         # (masks, v)
    probs = torch.softmax(logits, dim=-1)
    size = getattr(tokenizer, "vocab_size", None)
    decodable = min(probs.shape[-1], size) if isinstance(size, int) else probs.shape[-1]
    k = min(top_k, decodable)
    top_p, top_i = probs[:, :decodable].topk(k, dim=-1)                               # (masks, k)
    masks = []
    filled_ids = list(ids)
    for j, position in enumerate(positions):
        preds = [Prediction(int(i), tokenizer.decode([int(i)]), float(p)) for p, i in zip(top_p[j], top_i[j])]
        masks.append(MaskPrediction(position, preds))
        filled_ids[position] = preds[0].token_id
    return FillMaskResult(text=text, filled=tokenizer.decode(filled_ids[body]), masks=masks)
