"""Rollouts for the RL methods (grpo, ppo): prompts -> sampled completions through archlab's own KV-cached
generation (archlab.generation.generate), each with its per-token log-probs under the policy that sampled it and a
mask that ends at the first end-of-sequence token (the EOS itself kept, as TRL's GRPOTrainer keeps it).

    out = rollout(model, [[5, 6, 7], [8, 9]], group=4, max_new_tokens=32, eos_ids=[0], pad_id=0, seed=[17, 18])
    out.completion_ids          # (8, c): prompt 0's four completions, then prompt 1's (c <= 32)
    out.completion_mask         # (8, c): 1 up to and including the first EOS
    out.logps                   # (8, c): log p(token | prefix) at `temperature`, 0 outside the mask
    logps, entropy = completion_logps(model, out.prompt_ids, out.prompt_mask, out.completion_ids, temperature=1.0)

Prompts are left-padded; the forward that scores them gives each token its real position (padding -1), so a model
scores a padded row as it scores the row alone. The log-probs are those of the temperature-scaled distribution
(logits / T), the one sampled from, as TRL computes them; top-k / top-p are not applied to them (TRL neither).

Seeds: one per prompt (`slot_seed(seed, step, slot)`), each drawing its group's tokens from its own generator, so a
prompt's completions do not depend on which other prompts share the batch: data-parallel ranks that each sample their
share of a step's prompts sample what one process samples from all of them.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from archlab.generation import generate
from archlab.generation.sampling import GroupGenerators
from archlab.generation.stepper import model_device, positions_from_mask, prepare_prompts
from archlab.training import distributed as dist_util

__all__ = ["Rollout", "rollout", "end_ids", "completion_logps", "token_logps", "mask_at_eos", "prompt_completion",
           "slot_seed", "my_slots", "gather_rollout"]


def slot_seed(*parts: int) -> int:
    """A 63-bit seed from integers (the run's seed, the step, the prompt's slot in it): distinct tuples give unrelated
    seeds. Example: slot_seed(0, 12, 3) -> the seed of step 12's fourth prompt"""
    digest = hashlib.blake2b(",".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def my_slots(n: int, info: Any) -> list[int]:
    """The prompt slots 0..n-1 this data-parallel rank samples: every world_size-th, from its rank (all of them on one
    process). Example: my_slots(5, DistInfo(rank=1, world_size=2)) -> [1, 3]"""
    return list(range(info.rank, n, info.world_size))


def end_ids(data: Any) -> list[int]:
    """The ids a completion of `data`'s prompts (data/prompts.PromptData) ends at: the end-of-text token, and a chat
    template's end of turn when some prompt is chat messages; a UserError when there is none."""
    from archlab.errors import UserError
    from archlab.generation.chat import end_of_turn_ids
    from archlab.tokenizer.chat import ChatTokenizer

    turn = end_of_turn_ids(ChatTokenizer.of(data.tokenizer_dir)) if data.is_chat else []
    ends = list(dict.fromkeys(([data.eot_id] if data.eot_id is not None else []) + turn))
    if not ends:
        raise UserError(f"the tokenizer {data.tokenizer_dir} has no end-of-text token to end completions with")
    return ends


@dataclass
class Rollout:
    """One batch of sampled completions; row i is prompt i // group's (i % group)-th sample.

    prompt_ids, prompt_mask: (b, p) left-padded; completion_ids, completion_mask: (b, c) right-padded (pad_id past
    the first EOS); logps: (b, c) the sampling policy's log-probs (0 outside the mask); truncated: (b,) no EOS within
    max_new_tokens."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    logps: torch.Tensor
    truncated: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        """Each completion's tokens (b,), its EOS included."""
        return self.completion_mask.sum(-1)

    @classmethod
    def empty(cls, device: torch.device) -> Rollout:
        """No rows (a data-parallel rank with no prompt of its own this time)."""
        none = torch.zeros(0, 0, dtype=torch.long, device=device)
        return cls(none, none, none, none, none.float(), torch.zeros(0, dtype=torch.bool, device=device))

    def completion_tokens(self) -> list[list[int]]:
        """Each row's completion ids up to and including its EOS."""
        return [row[: int(n)].tolist() for row, n in zip(self.completion_ids, self.lengths)]


def mask_at_eos(completion_ids: torch.Tensor, eos_ids: Sequence[int]) -> torch.Tensor:
    """(b, c) long: 1 up to and including each row's first EOS (every slot when it has none), as TRL's GRPOTrainer.
    Example: mask_at_eos(torch.tensor([[4, 0, 0]]), [0]) -> [[1, 1, 0]]"""
    b, c = completion_ids.shape
    is_eos = torch.isin(completion_ids, torch.tensor(list(eos_ids), device=completion_ids.device))  # (b, c)
    first = torch.where(is_eos.any(-1), is_eos.int().argmax(-1), torch.full((b,), c, device=completion_ids.device))
    return (torch.arange(c, device=completion_ids.device)[None] <= first[:, None]).long()


def prompt_completion(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                      completion_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (b, p + c), positions (b, p + c)) of prompts and completions side by side: left padding and the slots past
    a completion's mask get position -1 (no token attends to them), real tokens their place in the row."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)                                    # (b, p + c)
    tail = torch.ones_like(completion_ids, dtype=torch.bool) if completion_mask is None else completion_mask.bool()
    mask = torch.cat([prompt_mask.bool(), tail], dim=1)
    return ids.masked_fill(~mask, 0), positions_from_mask(mask)


def completion_logps(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor, *,
                     temperature: float = 1.0, completion_mask: torch.Tensor | None = None,
                     vocab_limit: int | None = None, entropy: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (b, c) of the completions under `model` at `temperature` (float32), and the entropy (b, c)
    of each position's distribution (None with entropy=False); differentiable when grad is on. One forward over the
    prompt and completion (the policy's, the reference's). vocab_limit: the first ids only (a padded vocabulary).
    Example: logps, ent = completion_logps(model, prompt_ids, prompt_mask, completion_ids, temperature=0.7)"""
    p, c = prompt_ids.shape[1], completion_ids.shape[1]
    ids, positions = prompt_completion(prompt_ids, prompt_mask, completion_ids, completion_mask)
    logits = model(input_ids=ids, positions=positions)[:, p - 1: p + c - 1]               # (b, c, v)
    return token_logps(logits, completion_ids, temperature=temperature, vocab_limit=vocab_limit, entropy=entropy)


def token_logps(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0,
                vocab_limit: int | None = None, entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs (b, c) of `tokens` (b, c) under logits (b, c, v) scaled by 1 / temperature (float32), the entropy
    (b, c) of each slot's distribution or None). Example: logps, ent = token_logps(logits, ids, temperature=0.7)"""
    if vocab_limit is not None:
        logits = logits[..., :vocab_limit]
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)                      # (b, c, v)
    logps = logprobs.gather(-1, tokens[..., None]).squeeze(-1)                              # (b, c)
    if not entropy:
        return logps, None
    return logps, -(logprobs.exp() * logprobs).sum(-1)


@torch.no_grad()
def rollout(model, prompts: Sequence[Sequence[int]], *, group: int, max_new_tokens: int, eos_ids: Sequence[int],
            pad_id: int, seed: int | Sequence[int], temperature: float = 1.0, top_k: int | None = None,
            top_p: float | None = None, vocab_limit: int | None = None) -> Rollout:
    """`group` sampled completions of each prompt (token id lists), at most `max_new_tokens` each, through
    archlab.generate over the KV cache, from private generators (the caller's RNG untouched: a rollout is a function
    of the weights and the seeds, so a resumed run samples what the uninterrupted one did): `seed` one per prompt,
    each prompt's group drawn from its own (what it samples does not depend on the other prompts), or one int for
    the whole batch.
    The model is put in eval mode while it samples and scores (dropout off), then back as it was."""
    device = model_device(model)
    if not prompts:
        return Rollout.empty(device)
    rows = [list(p) for p in prompts for _ in range(group)]
    prompt_ids, prompt_mask, _ = prepare_prompts(rows, pad_token_id=pad_id)                 # (b, p) left-padded
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    if isinstance(seed, int):
        generator: Any = torch.Generator(device=device).manual_seed(seed)
    elif len(seed) != len(prompts):
        raise ValueError(f"{len(seed)} seeds for {len(prompts)} prompts")
    else:
        generator = GroupGenerators.seeded(seed, group, device)
    was_training = model.training
    model.eval()
    try:
        out = generate(model, prompt_ids, max_new_tokens, attention_mask=prompt_mask, temperature=temperature,
                       top_k=top_k, top_p=top_p, generator=generator, eos_token_id=list(eos_ids),
                       pad_token_id=pad_id, vocab_limit=vocab_limit)                        # (b, p + c)
        completion_ids = out[:, prompt_ids.shape[1]:]                                       # (b, c)
        if completion_ids.shape[1] == 0:
            raise ValueError("max_new_tokens must be >= 1 for a rollout")
        mask = mask_at_eos(completion_ids, eos_ids)                                         # (b, c)
        completion_ids = completion_ids.masked_fill(mask == 0, pad_id)
        logps, _ = completion_logps(model, prompt_ids, prompt_mask, completion_ids, temperature=temperature,
                                    completion_mask=mask, vocab_limit=vocab_limit, entropy=False)
    finally:
        model.train(was_training)
    truncated = ~torch.isin(completion_ids.gather(1, (mask.sum(-1, keepdim=True) - 1)),
                            torch.tensor(list(eos_ids), device=device)).squeeze(-1)          # (b,)
    return Rollout(prompt_ids.long(), prompt_mask.long(), completion_ids, mask, logps * mask, truncated)


def gather_rollout(out: Rollout, slots: Sequence[int], n: int, group: int, pad_id: int, info: Any, *,
                   per_row: dict[str, torch.Tensor] | None = None, per_token: dict[str, torch.Tensor] | None = None
                   ) -> tuple[Rollout, dict[str, torch.Tensor]]:
    """Every rank's share of a rollout, on every rank: `out` holds this rank's prompt slots `slots` (of 0..n-1, `group`
    rows each); returns the Rollout of all n slots in slot order, as one process samples it (prompts left-padded and
    completions right-padded to the widest rank's, with pad_id / 0), and the tensors of `per_row` ((rows, ...): a
    reward per row) and `per_token` ((rows, c): right-padded with 0) alongside, gathered the same way. One process:
    `out` and the tensors as they are. Example: whole, extra = gather_rollout(out, [1, 3], 4, 8, 0, info)"""
    per_row, per_token = dict(per_row or {}), dict(per_token or {})
    if info.world_size <= 1:
        return out, {**per_row, **per_token}
    device = out.prompt_ids.device
    fields = (out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask, out.logps, out.truncated)
    mine = [t.cpu() for t in (*fields, *per_row.values(), *per_token.values())]
    pieces = dist_util.gather_objects((list(slots), mine), info)
    p = max(tensors[0].shape[1] for _, tensors in pieces)                     # the widest prompt of any rank
    c = max(tensors[2].shape[1] for _, tensors in pieces)                     # the longest completion of any rank
    k = len(per_row)
    blocks: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for their_slots, tensors in pieces:
        ids, pmask, comp, cmask, logps, truncated = tensors[:6]
        left, right = (p - ids.shape[1], 0), (0, c - comp.shape[1])
        padded = [F.pad(ids, left, value=pad_id), F.pad(pmask, left), F.pad(comp, right, value=pad_id),
                  F.pad(cmask, right), F.pad(logps, right), truncated, *tensors[6:6 + k],
                  *(F.pad(t, right) for t in tensors[6 + k:])]
        for j, slot in enumerate(their_slots):
            blocks[slot] = [t[j * group:(j + 1) * group] for t in padded]
    whole = [torch.cat(column).to(device) for column in zip(*blocks)]
    return Rollout(*whole[:6]), dict(zip([*per_row, *per_token], whole[6:]))
