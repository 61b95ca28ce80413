"""Text generation over archlab's KV caches: sampling, beam search, streaming, StreamingLLM.

    archlab.generate(model, prompt_ids, max_new_tokens=..., temperature=..., top_k=..., top_p=...)
    archlab.generation.stream(model, prompt_ids, ...)   # iterator of (b,) tokens

Modules: sampling (filters and their order), stepper (prompts, padding, caches, model steps),
fast_decode (the lean cached decode step for LLaMA-style models), decode (generate / stream),
beam (beam search). Caches live in archlab.nn.kv_cache.
"""
from archlab.generation.beam import beam_search
from archlab.generation.decode import generate, stream
from archlab.generation.fast_decode import FastDecoder
from archlab.generation.sampling import SamplingParams, filter_logits, next_token
from archlab.generation.stepper import Stepper, positions_from_mask, prepare_prompts

__all__ = [
    "FastDecoder", "SamplingParams", "Stepper", "beam_search", "filter_logits", "generate", "next_token",
    "positions_from_mask", "prepare_prompts", "stream",
]
