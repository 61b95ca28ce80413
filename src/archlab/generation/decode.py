"""`generate` and `stream`: prefill the prompt, then decode token by token over the KV cache.

    ids = archlab.generate(model, prompt_ids, max_new_tokens=64, temperature=0.8, top_p=0.95, seed=0)
    for tokens in archlab.generation.stream(model, prompt_ids, max_new_tokens=64):  # (b,) per step
        ...

Sampling filters and their order: see archlab.generation.sampling. Stopping: `eos_token_id`
(an id or a list) ends a row, `stop_strings` (needs `tokenizer` with decode(list[int]) -> str)
ends a row once its generated text contains one of them (the token that completes it is kept);
finished rows are filled with `pad_token_id` until every row is done or max_new_tokens is reached.
"""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch

from archlab.generation.beam import beam_search
from archlab.generation.sampling import SamplingParams, next_token
from archlab.generation.stepper import Stepper, prepare_prompts


def _eos_list(eos_token_id) -> list[int]:
    if eos_token_id is None:
        return []
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]


class _StopStrings:
    """Per-row check that the generated text contains a stop string (decodes a short tail only)."""

    def __init__(self, stop_strings: Sequence[str], tokenizer, batch: int):
        if tokenizer is None or not hasattr(tokenizer, "decode"):
            raise ValueError("stop_strings needs a tokenizer with decode(list[int]) -> str")
        if any(not s for s in stop_strings):
            raise ValueError("stop_strings must be non-empty strings")
        self.strings, self.tokenizer = list(stop_strings), tokenizer
        # a token decodes to at least one character unless it is part of a multi-byte character
        self.tail = 4 * max(len(s) for s in self.strings) + 4
        self.generated: list[list[int]] = [[] for _ in range(batch)]

    def update(self, tokens: list[int], active: list[bool]) -> list[bool]:
        hits = []
        for row, (tok, on) in enumerate(zip(tokens, active)):
            if not on:
                hits.append(False)
                continue
            self.generated[row].append(tok)
            text = self.tokenizer.decode(self.generated[row][-self.tail:])
            hits.append(any(s in text for s in self.strings))
        return hits


def stream(model, prompt_ids, max_new_tokens: int = 32, *, attention_mask=None,
           temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
           min_p: float | None = None, repetition_penalty: float | None = None,
           eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
           stop_strings: Sequence[str] | None = None, tokenizer=None, seed: int | None = None,
           generator: torch.Generator | None = None, use_cache: bool = True,
           sink_tokens: int | None = None, sink_window: int | None = None,
           fast_decode: bool = True, vocab_limit: int | None = None) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, (b,) long, as each is decoded.

    Arguments as for `generate` (which collects this iterator). Bad arguments raise here, before
    the first token, not on first iteration.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            repetition_penalty=repetition_penalty)
    eos = _eos_list(eos_token_id)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    ids, mask, _ = prepare_prompts(prompt_ids, attention_mask, pad)
    stepper = Stepper(model, ids, mask, max_new_tokens, use_cache=use_cache,
                      sink_tokens=4 if sink_tokens is None and sink_window is not None else sink_tokens,
                      sink_window=sink_window, fast=fast_decode, vocab_limit=vocab_limit)
    if generator is None and seed is not None:
        generator = torch.Generator(stepper.ids.device).manual_seed(seed)
    stops = _StopStrings(stop_strings, tokenizer, ids.shape[0]) if stop_strings else None
    return _decode(stepper, max_new_tokens, params, eos, pad, stops, generator)


@torch.inference_mode()
def _decode(stepper: Stepper, max_new_tokens, params, eos, pad, stops, generator):
    if max_new_tokens == 0:
        return
    b, device = stepper.ids.shape[0], stepper.ids.device
    logits = stepper.prefill()                                             # (b, v)
    seen = None                                                            # (b, v) bool
    if params.repetition_penalty not in (None, 1.0):
        seen = torch.zeros(logits.shape, dtype=torch.bool, device=device)
        row_of = torch.arange(b, device=device)[:, None].expand_as(stepper.ids)
        seen[row_of[stepper.mask], stepper.ids[stepper.mask]] = True
    finished = torch.zeros(b, dtype=torch.bool, device=device) if (eos or stops) else None
    eos_t = torch.tensor(eos, device=device) if eos else None
    rows = torch.arange(b, device=device)
    for step in range(max_new_tokens):
        sampled = next_token(logits, params, seen=seen, generator=generator)   # (b,)
        tokens = sampled  # finished rows show `pad` but feed the model a valid id (ignored later)
        if finished is not None:
            tokens = torch.where(finished, pad, sampled)
            now = finished.clone()
            if eos_t is not None:
                finished |= torch.isin(tokens, eos_t)
            if stops is not None:
                hits = stops.update(tokens.tolist(), (~now).tolist())
                finished |= torch.tensor(hits, device=device)
        yield tokens
        if step == max_new_tokens - 1 or (finished is not None and bool(finished.all())):
            return
        if seen is not None:
            seen[rows, sampled] = True
        logits = stepper.step(sampled)


def generate(model, prompt_ids, max_new_tokens: int = 32, *, num_beams: int = 1,
             length_penalty: float = 1.0, callback: Callable[[torch.Tensor], None] | None = None,
             **kwargs) -> torch.Tensor:
    """Prompt followed by the new tokens.

    prompt_ids: list[int] | list[list[int]] | tensor (t,) or (b, t) (+ attention_mask for a
        left-padded tensor). Lists of different lengths are left-padded with pad_token_id.
    Returns (b, t + n) long, n <= max_new_tokens (fewer when every row stopped early), or (t + n,)
    for a single 1-D prompt. Rows that stopped early are filled with pad_token_id.
    temperature=0 (the default) is greedy; top_k / top_p / min_p / repetition_penalty filter the
    distribution (order in archlab.generation.sampling); seed makes sampling reproducible.
    num_beams > 1: beam search (deterministic), scores sum(log p) / n_generated**length_penalty.
    sink_window (+ sink_tokens, default 4): StreamingLLM decoding past the context.
    callback(tokens) is called with each step's (b,) tokens as they come (a streaming variant;
    `stream` is the iterator form). use_cache=False recomputes the whole sequence each step.
    fast_decode=True runs the model's modules over packed, transposed copies of their weights
    (a DecodeSession, archlab.nn.fused, tested equal to the plain forward; one extra copy of the weights):
    pass False to save that memory on large models.
    """
    if num_beams > 1:
        return _beam(model, prompt_ids, max_new_tokens, num_beams, length_penalty, callback, **kwargs)
    eos = _eos_list(kwargs.get("eos_token_id"))
    pad = kwargs.get("pad_token_id")
    pad = pad if pad is not None else (eos[0] if eos else 0)
    ids, _, single = prepare_prompts(prompt_ids, kwargs.get("attention_mask"), pad)
    new = []
    for tokens in stream(model, prompt_ids, max_new_tokens, **kwargs):
        new.append(tokens)
        if callback is not None:
            callback(tokens)
    out = ids.to(new[0].device) if new else ids
    if new:
        out = torch.cat((out, torch.stack(new, dim=1)), dim=1)
    return out[0] if single else out


def _beam(model, prompt_ids, max_new_tokens, num_beams, length_penalty, callback, **kwargs):
    unsupported = {k for k, v in kwargs.items()
                   if v is not None and k in ("top_k", "top_p", "min_p", "repetition_penalty",
                                               "stop_strings", "sink_window", "generator", "seed")}
    if kwargs.get("temperature", 0.0) not in (0, 0.0, None):
        unsupported.add("temperature")
    if callback is not None:
        unsupported.add("callback")
    if unsupported:
        raise ValueError(f"beam search is deterministic and does not take {sorted(unsupported)}")
    eos = _eos_list(kwargs.get("eos_token_id"))
    pad = kwargs.get("pad_token_id")
    pad = pad if pad is not None else (eos[0] if eos else 0)
    ids, mask, single = prepare_prompts(prompt_ids, kwargs.get("attention_mask"), pad)
    out = beam_search(model, ids, mask, max_new_tokens=max_new_tokens, num_beams=num_beams,
                      length_penalty=length_penalty, eos=eos, pad=pad,
                      use_cache=kwargs.get("use_cache", True), vocab_limit=kwargs.get("vocab_limit"))
    return out[0] if single else out
