"""Trainable token rows: some rows of the input embedding train, every other row stays frozen (PEFT's
TrainableTokens, `LoraConfig(trainable_token_indices=[...])`).

    E'[i] = E[i] + delta[k]    for the k-th listed token id i        delta (n, d), zero at the start
    E'[i] = E[i]               for every other id (the base row, bitwise)

What it is for: tokens the base never trained (a chat template's `<|im_start|>` added to a base pretrained on
plain text) keep their initial rows under LoRA, which freezes the embedding; these rows learn while the rest of the
vocabulary stays as it was. Only the (n, d) delta is a parameter, so gradients and optimizer state scale with the
listed rows, not the vocabulary. A head tied to the embedding reads the same rows (it is the same matrix, as in
PEFT); an untied head is left alone (PEFT's list form adapts the input embedding only).

`wrap_embedding(model, ids)` swaps the model's `embed` for a `TrainableTokens` holding the same base Parameter (its
state-dict key `embed.weight` unchanged) plus `trainable_tokens_delta` and `token_indices`; `unwrap_embedding`
folds the delta into the rows and puts a plain nn.Embedding back. PEFT stores the rows' new values rather than a
difference: interop/peft.py converts (values = E[i] + delta) when saving and loading.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from archlab.config import ConfigError

__all__ = ["TrainableTokens", "EMBED_PATH", "wrap_embedding", "unwrap_embedding", "token_module",
           "parse_token_list", "wrap_from_state"]

EMBED_PATH = "embed"           # the input embedding of every archlab model (nn/embedding.Embedder)


def parse_token_list(text: str) -> list[str]:
    """"259, <|im_end|>,template" -> ["259", "<|im_end|>", "template"]: the comma list as the command line gives it."""
    return [t.strip() for t in text.split(",") if t.strip()]


class TrainableTokens(nn.Embedding):
    """nn.Embedding whose listed rows add a trained delta: base `weight` (frozen, the same Parameter), the ids in
    `token_indices` (n,) and `trainable_tokens_delta` (n, d)."""

    token_indices: torch.Tensor       # buffers, (n,) and (v,)
    slot: torch.Tensor

    def __init__(self, base: nn.Embedding, token_ids: Iterable[int]):
        nn.Module.__init__(self)
        ids = sorted({int(i) for i in token_ids})
        if not ids:
            raise ConfigError("trainable tokens: no token ids given")
        if ids[0] < 0 or ids[-1] >= base.num_embeddings:
            bad = ids[0] if ids[0] < 0 else ids[-1]
            raise ConfigError(f"trainable token id {bad} is outside the embedding's {base.num_embeddings} rows")
        self.num_embeddings, self.embedding_dim = base.num_embeddings, base.embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = base.padding_idx, base.max_norm, base.norm_type
        self.scale_grad_by_freq, self.sparse = base.scale_grad_by_freq, base.sparse
        self.weight = base.weight                                # the same Parameter: `embed.weight` unchanged
        self.train(base.training)
        device, dtype = base.weight.device, base.weight.dtype
        self.register_buffer("token_indices", torch.tensor(ids, dtype=torch.long, device=device))
        # slot[i]: 1 + the position of id i in token_indices, 0 for every other id (the zero row of the padded delta)
        slot = torch.zeros(self.num_embeddings, dtype=torch.long, device=device)
        slot[self.token_indices] = torch.arange(1, len(ids) + 1, device=device)
        self.register_buffer("slot", slot, persistent=False)
        self.trainable_tokens_delta = nn.Parameter(torch.zeros(len(ids), self.embedding_dim, device=device,
                                                               dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:          # (b, t) -> (b, t, d)
        x = F.embedding(input_ids, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                        self.scale_grad_by_freq, self.sparse)
        # the delta looked up through the slots: gradients reach the (n + 1, d) table only, not a (v, d) copy
        table = F.pad(self.trainable_tokens_delta, (0, 0, 1, 0))       # (n + 1, d), row 0 zero
        return x + F.embedding(self.slot[input_ids], table)

    def effective_weight(self) -> torch.Tensor:                        # (v, d)
        """E with the delta added to the listed rows (a new tensor; gradients reach the delta): what a tied head
        multiplies by."""
        return self.weight.index_add(0, self.token_indices, self.trainable_tokens_delta.to(self.weight.dtype))

    def rows(self) -> torch.Tensor:                                     # (n, d)
        """The listed rows' values, E[i] + delta (PEFT's `trainable_tokens_delta`)."""
        return self.weight.detach()[self.token_indices] + self.trainable_tokens_delta.detach().to(self.weight.dtype)

    def merged(self) -> nn.Embedding:
        """A plain nn.Embedding holding E' (the base Parameter updated in place)."""
        with torch.no_grad():
            self.weight.index_add_(0, self.token_indices, self.trainable_tokens_delta.to(self.weight.dtype))
        out = nn.Embedding(self.num_embeddings, self.embedding_dim, self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse, device="meta")
        out.weight = self.weight
        return out.train(self.training)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, trainable_tokens={len(self.token_indices)}"


def token_module(model: nn.Module) -> TrainableTokens | None:
    """The model's TrainableTokens embedding, if it has one."""
    embed = getattr(model, EMBED_PATH, None)
    return embed if isinstance(embed, TrainableTokens) else None


def _swap(model: nn.Module, old: nn.Embedding, new: nn.Embedding) -> None:
    """Put `new` where `old` was: the model's `embed`, and every head tied to it (nn/heads.LMHead.tied)."""
    setattr(model, EMBED_PATH, new)
    for module in model.modules():
        tied = getattr(module, "tied", None)
        if isinstance(tied, tuple) and any(t is old for t in tied):
            setattr(module, "tied", tuple(new if t is old else t for t in tied))   # noqa: B010 (mypy: Module attrs)


def wrap_embedding(model: nn.Module, token_ids: Iterable[int]) -> TrainableTokens:
    """Swap the model's input embedding for a TrainableTokens on `token_ids` (in place; a tied head follows);
    returns it. Only the delta is left trainable there."""
    embed = getattr(model, EMBED_PATH, None)
    if not isinstance(embed, nn.Embedding) or isinstance(embed, TrainableTokens):
        raise ConfigError(f"{type(model).__name__} has no plain input embedding `{EMBED_PATH}` for trainable tokens")
    adapted = TrainableTokens(embed, token_ids)
    _swap(model, embed, adapted)
    return adapted


def unwrap_embedding(model: nn.Module) -> None:
    """Fold the trained rows into the embedding and put a plain nn.Embedding back (in place); no-op without one."""
    adapted = token_module(model)
    if adapted is not None:
        _swap(model, adapted, adapted.merged())


def wrap_from_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Wrap the embedding on the ids a checkpoint's tensors name (`embed.token_indices`, a run trained with
    train.lora.trainable_tokens), so that `model.load_state_dict(state)` finds its delta; no-op without them."""
    ids = state.get(f"{EMBED_PATH}.token_indices")
    if ids is not None:
        wrap_embedding(model, ids.tolist())
