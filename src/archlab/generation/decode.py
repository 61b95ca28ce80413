"""`generate` and `stream`: prefill the prompt, then decode token by token over the KV cache.

    ids = archlab.generate(model, prompt_ids, max_new_tokens=64, temperature=0.8, top_p=0.95, seed=0)
    for tokens in archlab.generation.stream(model, prompt_ids, max_new_tokens=64):  # (b,) per step
        ...

Sampling filters and their order: see archlab.generation.sampling. Stopping: `eos_token_id`
(an id or a list) ends a row, `stop_strings` (needs `tokenizer` with decode(list[int]) -> str)
ends a row once its generated text contains one of them (the token that completes it is kept);
finished rows are filled with `pad_token_id` until every row is done or max_new_tokens is reached.
Logits processors (n-gram blocking, bad words, forced BOS/EOS, minimum lengths): see
archlab.generation.processors; `generation_config=` (archlab.generation.config) supplies defaults
from a folder's generation_config.json, which explicit arguments override.
"""
from __future__ import annotations

import warnings
from typing import Callable, Iterator, Sequence

import torch

from archlab.generation.beam import beam_search
from archlab.generation.config import GenerationConfig
from archlab.generation.drafts import resolve as resolve_draft
from archlab.generation.prefix import PrefixCache
from archlab.generation.processors import apply as apply_processors
from archlab.generation.processors import build as build_processors
from archlab.generation.sampling import Generator, SamplingParams, next_token
from archlab.generation.speculative import Scorer, SpeculativeStats
from archlab.generation.speculative import prepare as prepare_speculation
from archlab.generation.speculative import steps as speculative_steps
from archlab.generation.stepper import Stepper, is_encoder_decoder, prepare_prompts, prepare_source


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


_DEFAULT_NEW_TOKENS = 32


def stream(model, prompt_ids, max_new_tokens: int | None = None, *, attention_mask=None,
           temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
           min_p: float | None = None, repetition_penalty: float | None = None,
           eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
           no_repeat_ngram_size: int | None = None, bad_words_ids: Sequence[Sequence[int]] | None = None,
           min_length: int | None = None, min_new_tokens: int | None = None,
           forced_bos_token_id: int | None = None, forced_eos_token_id: int | Sequence[int] | None = None,
           stop_strings: Sequence[str] | None = None, tokenizer=None, seed: int | None = None,
           generator: Generator | None = None, use_cache: bool = True,
           sink_tokens: int | None = None, sink_window: int | None = None,
           fast_decode: bool = True, vocab_limit: int | None = None,
           decoder_start_token_id: int | None = None, sampling_order: str | Sequence[str] | None = None,
           generation_config: GenerationConfig | None = None, draft=None, draft_tokens: int | str | None = None,
           stats: SpeculativeStats | None = None, prefix_cache: PrefixCache | None = None,
           compile: bool = False) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, (b,) long, as each is decoded.

    Arguments as for `generate` (which collects this iterator; beams are `generate`'s alone). Bad
    arguments raise here, before the first token, not on first iteration.
    """
    cfg = _settings(generation_config, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                    top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty, eos_token_id=eos_token_id,
                    pad_token_id=pad_token_id, no_repeat_ngram_size=no_repeat_ngram_size,
                    bad_words_ids=bad_words_ids, min_length=min_length, min_new_tokens=min_new_tokens,
                    forced_bos_token_id=forced_bos_token_id, forced_eos_token_id=forced_eos_token_id,
                    stop_strings=stop_strings, decoder_start_token_id=decoder_start_token_id,
                    sampling_order=sampling_order)
    params = SamplingParams(temperature=cfg.temperature or 0.0, top_k=cfg.top_k, top_p=cfg.top_p,
                            min_p=cfg.min_p, repetition_penalty=cfg.repetition_penalty,
                            **({"order": cfg.sampling_order} if cfg.sampling_order else {}))
    eos, pad = cfg.eos, _pad(cfg)
    ids, mask, _, source = _model_inputs(model, prompt_ids, attention_mask, pad, cfg)
    new = _new_tokens(cfg, ids.shape[1])
    speculation = None
    if draft is not None:
        if source is not None or sink_window is not None:
            raise ValueError("speculative decoding (draft=) is for decoder-only models without StreamingLLM's "
                             "sink_window")
        speculation = resolve_draft(draft, fast=fast_decode, vocab_limit=vocab_limit)
        schedule = prepare_speculation(speculation, model, ids.shape[1], new, draft_tokens)
        if compile:
            warnings.warn("compile=True with a draft: the forwards that check the drafts run eagerly (the compiled "
                          "step takes one token); only rounds without a draft use it", stacklevel=3)
    elif draft_tokens is not None:
        raise ValueError("draft_tokens is the length of a draft: give draft= too")
    stepper = Stepper(model, ids, mask, new, use_cache=use_cache,
                      sink_tokens=4 if sink_tokens is None and sink_window is not None else sink_tokens,
                      sink_window=sink_window, fast=fast_decode, vocab_limit=vocab_limit, source=source,
                      rewindable=speculation is not None, prefix=prefix_cache, compile=compile)
    if generator is None and seed is not None:
        generator = torch.Generator(stepper.ids.device).manual_seed(seed)
    stops = None
    if cfg.stop_strings:
        if tokenizer is None and stop_strings is None:   # named by the generation config only
            warnings.warn(f"stop_strings {list(cfg.stop_strings)} from the generation config need a tokenizer= "
                          "to be applied", stacklevel=2)
        else:
            stops = _StopStrings(cfg.stop_strings, tokenizer, ids.shape[0])
    if speculation is not None:   # the repetition penalty as a processor: it sees the drafts of each position
        processors = build_processors(cfg, eos=eos, prompt_width=ids.shape[1], max_length=ids.shape[1] + new,
                                      padding=(~mask).sum(-1))
        finished = _Finished(ids.shape[0], eos, stops, pad, stepper.ids.device)
        loop = speculative_steps(stepper, speculation, schedule, new, Scorer(params, processors, generator), ids,
                                 finished.mark, finished.done, finished.active,
                                 stats if stats is not None else SpeculativeStats(), tuple(eos))
        if stats is not None:
            stats.draft = getattr(speculation, "name", type(speculation).__name__)
        return _run(stepper, new, loop)
    processors = build_processors(cfg, eos=eos, prompt_width=ids.shape[1], max_length=ids.shape[1] + new,
                                  penalty=False)   # the repetition penalty: in next_token
    return _run(stepper, new, _steps(stepper, new, params, eos, pad, stops, generator, processors, ids))


class _Finished:
    """Which rows have stopped (an EOS id, a stop string): their tokens are shown as `pad` from then on."""

    def __init__(self, b: int, eos, stops: _StopStrings | None, pad: int, device):
        self.stops, self.pad = stops, pad
        self.eos = torch.tensor(eos, device=device) if eos else None
        self.rows = torch.zeros(b, dtype=torch.bool, device=device)

    def mark(self, sampled: torch.Tensor) -> torch.Tensor:     # (b,) -> (b,) the tokens shown
        if self.eos is None and self.stops is None:
            return sampled
        tokens = torch.where(self.rows, self.pad, sampled)
        before = self.rows.clone()
        if self.eos is not None:
            self.rows |= torch.isin(tokens, self.eos)
        if self.stops is not None:
            self.rows |= torch.tensor(self.stops.update(tokens.tolist(), (~before).tolist()), device=tokens.device)
        return tokens

    def done(self) -> bool:
        return (self.eos is not None or self.stops is not None) and bool(self.rows.all())

    def active(self) -> torch.Tensor:
        return ~self.rows


@torch.inference_mode()
def _run(stepper: Stepper, max_new_tokens: int, loop: Iterator[torch.Tensor]):
    if max_new_tokens == 0:
        return
    yield from loop


def _settings(generation_config: GenerationConfig | None, **arguments) -> GenerationConfig:
    """The generation config (defaults) with every argument that was given in its place."""
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError("generation_config must be an archlab.generation.GenerationConfig "
                        "(archlab.generation.read_generation_config(folder) reads one)")
    return (generation_config or GenerationConfig()).merged(**arguments)


def _model_inputs(model, prompt_ids, attention_mask, pad: int, cfg: GenerationConfig):
    """-> the decoder's prompt ids (b, t), its mask (b, t), single, and the encoder's source (ids, mask) or None.

    A decoder-only model continues the prompt; an encoder-decoder reads `prompt_ids` as its source (padded on
    either side, `attention_mask` 1 = real token) and decodes from the decoder start token: the generation
    config's decoder_start_token_id, else the model config's."""
    if not is_encoder_decoder(model):
        ids, mask, single = prepare_prompts(prompt_ids, attention_mask, pad)
        return ids, mask, single, None
    src, src_mask, single = prepare_source(prompt_ids, attention_mask, pad)
    start = cfg.decoder_start_token_id
    if start is None:
        start = model.config.decoder_start_token_id
    ids = torch.full((src.shape[0], 1), start, dtype=torch.long)
    return ids, torch.ones_like(ids, dtype=torch.bool), single, (src, src_mask)


def _pad(cfg: GenerationConfig) -> int:
    eos = cfg.eos
    return cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else 0)


def _new_tokens(cfg: GenerationConfig, width: int) -> int:
    """max_new_tokens, else what max_length (prompt + new, transformers' count) leaves, else 32."""
    if cfg.max_new_tokens is not None:
        new = cfg.max_new_tokens
    elif cfg.max_length is not None:
        new = cfg.max_length - width
        if new < 1:
            raise ValueError(f"max_length={cfg.max_length} leaves no new tokens after a prompt of {width}: "
                             "pass max_new_tokens")
    else:
        new = _DEFAULT_NEW_TOKENS
    if new < 0:
        raise ValueError(f"max_new_tokens={new} must be >= 0")
    return new


def _steps(stepper: Stepper, max_new_tokens, params, eos, pad, stops, generator, processors, prompt):
    b, device = stepper.ids.shape[0], stepper.ids.device
    logits = stepper.prefill()                                             # (b, v)
    seqs = prompt.to(device) if processors else None                       # what the processors see
    seen = None                                                            # (b, v) bool
    if params.repetition_penalty not in (None, 1.0):
        seen = torch.zeros(logits.shape, dtype=torch.bool, device=device)
        row_of = torch.arange(b, device=device)[:, None].expand_as(stepper.ids)
        seen[row_of[stepper.mask], stepper.ids[stepper.mask]] = True
    finished = _Finished(b, eos, stops, pad, device)
    rows = torch.arange(b, device=device)
    for step in range(max_new_tokens):
        if seqs is not None:
            logits = apply_processors(processors, seqs, logits.float())
        sampled = next_token(logits, params, seen=seen, generator=generator)   # (b,)
        tokens = finished.mark(sampled)  # finished rows show `pad` but feed the model a valid id (ignored later)
        yield tokens
        if step == max_new_tokens - 1 or finished.done():
            return
        if seen is not None:
            seen[rows, sampled] = True
        if seqs is not None:
            seqs = torch.cat((seqs, tokens[:, None]), 1)
        logits = stepper.step(sampled)


def generate(model, prompt_ids, max_new_tokens: int | None = None, *, num_beams: int | None = None,
             length_penalty: float | None = None, early_stopping: bool | str | None = None,
             callback: Callable[[torch.Tensor], None] | None = None,
             generation_config: GenerationConfig | None = None, **kwargs) -> torch.Tensor:
    """Prompt followed by the new tokens; for an encoder-decoder, the decoder start token followed by them.

    prompt_ids: list[int] | list[list[int]] | tensor (t,) or (b, t) (+ attention_mask for a
        left-padded tensor). Lists of different lengths are left-padded with pad_token_id.
    An encoder-decoder (archlab.EncoderDecoderLM) reads prompt_ids as the source: the encoder runs once
    (attention_mask may pad either side), the cross-attention keys and values are projected once, and the
    decoder starts from decoder_start_token_id (default: the generation config's, else model.config's)
    over its KV cache; sampling, beams and processors apply to the decoder's ids as for a prompt.
    Returns (b, t + n) long, n <= max_new_tokens (default 32; fewer when every row stopped early),
    or (t + n,) for a single 1-D prompt. Rows that stopped early are filled with pad_token_id
    (default: the first EOS id, else 0).
    temperature=0 (the default) is greedy; top_k / top_p / min_p / repetition_penalty filter the
    distribution (in transformers' order, or sampling_order="notes" / "top_k,top_p,temperature": see
    archlab.generation.sampling); seed (or generator=: a torch.Generator, or a
    GroupGenerators with one per block of rows, archlab.generation.sampling) makes sampling reproducible.
    eos_token_id: an id or a list of ids that end a row; stop_strings (with tokenizer=) too.
    no_repeat_ngram_size, bad_words_ids, min_length, min_new_tokens, forced_bos_token_id,
    forced_eos_token_id: transformers' logits processors of those names (archlab.generation.processors).
    num_beams > 1: beam search, transformers' algorithm (archlab.generation.beam): hypotheses scored
    sum(log p) / n_generated ** length_penalty; early_stopping True, False (default) or "never".
    generation_config: defaults, as a model folder's generation_config.json names them
    (archlab.generation.read_generation_config(folder); the folder loaders attach it to the model as
    `model.generation_config`, which is not read unless passed here); every argument given here wins
    over it (eos_token_id=[] for no EOS).
    sink_window (+ sink_tokens, default 4): StreamingLLM decoding past the context.
    callback(tokens) is called with each step's (b,) tokens as they come (a streaming variant;
    `stream` is the iterator form). use_cache=False recomputes the whole sequence each step.
    fast_decode=True runs the model's modules over packed, transposed copies of their weights
    (a DecodeSession, archlab.nn.fused, tested equal to the plain forward; one extra copy of the weights):
    pass False to save that memory on large models.
    compile=True: each decode step runs the model's compiled step (torch.compile with inductor, held by the
    model's decode plan: archlab.nn.compiled_step; tested equal to the eager step). The first call compiles
    (tens of seconds; again for another batch size or after the weights change); later calls of any length
    reuse it. Worth it for long or repeated generations (docs/benchmarks.md has the figures).
    draft: speculative decoding (archlab.generation.speculative): a model of the same vocabulary,
    "prompt_lookup", "ngram", or a draft object (archlab.generation.drafts: PromptLookupDraft(max_ngram=3),
    NgramDraft(order=3, data=token_ids)); draft_tokens: tokens drafted per round (default and "auto":
    transformers' heuristic schedule). Greedy decoding gives plain greedy's tokens; sampling, draws from the
    target's distribution (Leviathan's rule). stats: a SpeculativeStats to fill in (acceptance rate, tokens
    per target forward, the theory's prediction). Example:
        stats = archlab.generation.SpeculativeStats()
        archlab.generate(model, ids, 64, draft="prompt_lookup", draft_tokens=8, stats=stats); print(stats.summary())
    prefix_cache: a PrefixCache (archlab.generation.prefix) kept across calls on one row (a chat's turns): the
    prompt's tokens it already holds are not prefilled again. Example:
        cache = archlab.generation.PrefixCache(); archlab.generate(model, ids, 32, prefix_cache=cache)
    """
    cfg = _settings(generation_config, num_beams=num_beams, length_penalty=length_penalty,
                    early_stopping=early_stopping)
    if (cfg.num_beams or 1) > 1 and kwargs.get("draft") is not None:
        raise ValueError(f"speculative decoding (draft=) checks one continuation per row; it does not combine with "
                         f"beam search (num_beams={cfg.num_beams}): use num_beams=1 or no draft")
    if (cfg.num_beams or 1) > 1:
        return _beam(model, prompt_ids, max_new_tokens, cfg, callback, **kwargs)
    given = cfg.merged(eos_token_id=kwargs.get("eos_token_id"), pad_token_id=kwargs.get("pad_token_id"),
                       decoder_start_token_id=kwargs.get("decoder_start_token_id"))
    ids, _, single, _ = _model_inputs(model, prompt_ids, kwargs.get("attention_mask"), _pad(given), given)
    new = []
    for tokens in stream(model, prompt_ids, max_new_tokens, generation_config=cfg, **kwargs):
        new.append(tokens)
        if callback is not None:
            callback(tokens)
    out = ids.to(new[0].device) if new else ids
    if new:
        out = torch.cat((out, torch.stack(new, dim=1)), dim=1)
    return out[0] if single else out


_NOT_IN_BEAMS = ("top_k", "top_p", "min_p", "sampling_order", "stop_strings", "sink_window", "generator", "seed",
                 "prefix_cache")
_BEAM_SETTINGS = ("repetition_penalty", "eos_token_id", "pad_token_id", "no_repeat_ngram_size", "bad_words_ids",
                  "min_length", "min_new_tokens", "forced_bos_token_id", "forced_eos_token_id",
                  "decoder_start_token_id")


def _beam(model, prompt_ids, max_new_tokens, cfg: GenerationConfig, callback, *, attention_mask=None,
          use_cache: bool = True, vocab_limit: int | None = None, temperature: float | None = None,
          fast_decode: bool = True, tokenizer=None, sink_tokens: int | None = None, compile: bool = False,
          **kwargs):
    unsupported = {k for k, v in kwargs.items() if v is not None and k in _NOT_IN_BEAMS}
    if temperature not in (0, 0.0, None):
        unsupported.add("temperature")
    if callback is not None:
        unsupported.add("callback")
    if unsupported:
        raise ValueError(f"beam search is deterministic and does not take {sorted(unsupported)}")
    unknown = set(kwargs) - set(_NOT_IN_BEAMS) - set(_BEAM_SETTINGS)
    if unknown:
        raise TypeError(f"generate() got unexpected keyword argument(s) {sorted(unknown)}")
    cfg = cfg.merged(max_new_tokens=max_new_tokens, **{k: kwargs[k] for k in _BEAM_SETTINGS if k in kwargs})
    if (cfg.temperature or 0.0) > 0.0 and temperature is None:
        warnings.warn("the generation config samples (temperature > 0); beam search here is deterministic",
                      stacklevel=3)
    eos, pad = cfg.eos, _pad(cfg)
    ids, mask, single, source = _model_inputs(model, prompt_ids, attention_mask, pad, cfg)
    new = _new_tokens(cfg, ids.shape[1])
    nb = cfg.num_beams or 1
    processors = build_processors(cfg, eos=eos, prompt_width=ids.shape[1], max_length=ids.shape[1] + new,
                                  padding=(~mask).sum(-1).repeat_interleave(nb))
    out = beam_search(model, ids, mask, max_new_tokens=new, num_beams=nb,
                      length_penalty=1.0 if cfg.length_penalty is None else cfg.length_penalty,
                      early_stopping=False if cfg.early_stopping is None else cfg.early_stopping,
                      eos=eos, pad=pad, use_cache=use_cache, vocab_limit=vocab_limit, processors=processors,
                      source=source, compile=compile)
    return out[0] if single else out
