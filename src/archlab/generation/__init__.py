"""Text generation over archlab's KV caches: sampling, beam search, streaming, StreamingLLM.

    archlab.generate(model, prompt_ids, max_new_tokens=..., temperature=..., top_k=..., top_p=...)
    archlab.generate(model, prompt_ids, num_beams=4, length_penalty=1.0, early_stopping=True)
    archlab.generation.stream(model, prompt_ids, ...)   # iterator of (b,) tokens
    archlab.generate(model, prompt_ids, generation_config=read_generation_config(folder))
    archlab.generate(model, prompt_ids, draft="prompt_lookup", draft_tokens=8)   # speculative decoding

Modules: sampling (filters and their order), processors (transformers' logits processors: n-gram
blocking, bad words, forced BOS/EOS, minimum lengths, repetition penalty), config (a folder's
generation_config.json), stepper (prompts, padding, caches, model steps), decode (generate / stream),
beam (beam search), speculative and drafts (speculative decoding: a draft model, prompt lookup, the
n-gram model), prefix (a KV cache kept across calls: a chat's turns). Caches live in archlab.nn.kv_cache;
the model's math lives in archlab.nn alone: every step, cached or not, runs through the model's own modules.
"""
from archlab.generation.beam import beam_search
from archlab.generation.config import GenerationConfig, read_generation_config
from archlab.generation.decode import generate, stream
from archlab.generation.drafts import ModelDraft, NgramDraft, PromptLookupDraft
from archlab.generation.prefix import PrefixCache
from archlab.generation.sampling import SamplingParams, filter_logits, next_token
from archlab.generation.speculative import SpeculativeStats
from archlab.generation.stepper import Stepper, positions_from_mask, prepare_prompts

__all__ = [
    "GenerationConfig", "ModelDraft", "NgramDraft", "PrefixCache", "PromptLookupDraft", "SamplingParams",
    "SpeculativeStats",
    "Stepper", "beam_search", "filter_logits", "generate", "next_token",
    "positions_from_mask", "prepare_prompts", "read_generation_config", "stream",
]
