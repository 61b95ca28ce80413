"""Prompt preparation and the model step shared by sampling and beam search.

A `Stepper` owns the running state of one batch: the KV cache (or, uncached, the whole sequence so
far) and the next positions. `prefill()` runs the prompt, `step(tokens)` feeds one token per row;
both return the next-token logits (b, v). `reorder(index)` selects rows (beam search). Speculative decoding
(rewindable=True) feeds several tokens at once with `extend(tokens)` -> logits at each (b, m, v) and drops
the rejected ones with `rewind(n)`. Every step
runs the model's own forward; fast=True (the default) hands each one the Stepper's DecodeSession over the
model's decode plan (`model(..., session=...)`, archlab.nn.fused): packed weight copies and, for a hook-free
model, its modules called straight into forward; fast=False: no session, no weight copies, every call through
nn.Module.__call__. compile=True decodes each one-token step through the model's compiled step (the plain
forward traced by torch.compile, held by the decode plan: archlab.nn.compiled_step), tested equal to the eager
one; the prefill, speculative verification and models it cannot take run eagerly.

Batched prompts of different lengths are left-padded: positions = cumsum(mask) - 1 and padded
slots get position -1, which attention masks out; every row's newest token is then in the last
column, so decoding appends one column for all rows.

StreamingLLM mode (sink_window: a SinkKVCache) prefills a prompt longer than the cache in forwards of STRETCH tokens
past its capacity, scored as feeding them token by token would (SinkKVCache.stretch), where every layer allows it
(`stretches`); a model with a position bias or windows of its own fills the cache, then goes on token by token.

An encoder-decoder (archlab.EncoderDecoderLM) is stepped the same way over its decoder: the Stepper is
given the source (`source=(ids, mask)`, any padding) and the decoder's prompt (the start token per row).
`prefill()` runs the encoder once into a Context, whose cross-attention keys and values each layer
projects once; every step then runs the decoder alone over its self-attention KV cache.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Sequence

import torch

from archlab.config import ABSOLUTE_POSITIONS
from archlab.generation.prefix import PrefixCache
from archlab.nn.attention import Attention
from archlab.nn.compiled_step import compilable, compiled_step
from archlab.nn.fused import call, decode_session
from archlab.nn.kv_cache import SinkKVCache, StaticKVCache
from archlab.nn.masks import Context, MaskSpec


def prepare_prompts(prompt_ids, attention_mask=None, pad_token_id: int = 0):
    """-> ids (b, t) long, mask (b, t) bool, single (True when one 1-D prompt was given).

    Accepts a list of ints, a list of lists (left-padded here), a 1-D tensor, or a 2-D tensor with
    an optional left-padding attention mask (1 = token, 0 = padding).
    """
    single = False
    if isinstance(prompt_ids, torch.Tensor):
        ids = prompt_ids.long()
        if ids.dim() == 1:
            ids, single = ids[None], True
        if ids.dim() != 2:
            raise ValueError(f"prompt_ids must be 1-D or 2-D, got shape {tuple(prompt_ids.shape)}")
        mask = (torch.ones_like(ids, dtype=torch.bool) if attention_mask is None
                else torch.as_tensor(attention_mask, device=ids.device).bool())
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask shape {tuple(mask.shape)} != prompt shape {tuple(ids.shape)}")
    else:
        rows: Sequence = list(prompt_ids)
        if rows and all(isinstance(x, int) for x in rows):
            rows, single = [rows], True
        if not rows or any(len(r) == 0 for r in rows):
            raise ValueError("every prompt needs at least one token")
        if attention_mask is not None:
            raise ValueError("attention_mask is only accepted with a tensor prompt; lists are padded here")
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, r in enumerate(rows):
            ids[i, width - len(r):] = torch.as_tensor(list(r), dtype=torch.long)
            mask[i, width - len(r):] = True
    if ids.shape[1] == 0:
        raise ValueError("prompt_ids is empty: give at least one token (e.g. a BOS token)")
    if not mask[:, -1].all() or (mask[:, 1:].long() < mask[:, :-1].long()).any():
        raise ValueError("attention_mask must be left padding (zeros, then ones, ending in a token)")
    return ids, mask, single


def is_encoder_decoder(model) -> bool:
    """The model is an encoder-decoder (its config's arch): generation encodes a source, decodes a target."""
    return getattr(getattr(model, "config", None), "arch", None) == "encoder_decoder"


def prepare_source(source_ids, attention_mask=None, pad_token_id: int = 0):
    """An encoder-decoder's source -> ids (b, s) long, mask (b, s) bool or None (no padding), single.

    Accepts what prepare_prompts does; a tensor's attention_mask may pad on either side (the encoder counts
    positions over each row's real tokens); lists of different lengths are right-padded here."""
    single = False
    if isinstance(source_ids, torch.Tensor):
        ids = source_ids.long()
        if ids.dim() == 1:
            ids, single = ids[None], True
        if ids.dim() != 2:
            raise ValueError(f"source ids must be 1-D or 2-D, got shape {tuple(source_ids.shape)}")
        mask = None if attention_mask is None else torch.as_tensor(attention_mask, device=ids.device).bool()
        if mask is not None and mask.shape != ids.shape:
            raise ValueError(f"attention_mask shape {tuple(mask.shape)} != source shape {tuple(ids.shape)}")
    else:
        rows = list(source_ids)
        if rows and all(isinstance(x, int) for x in rows):
            rows, single = [rows], True
        if attention_mask is not None:
            raise ValueError("attention_mask is only accepted with a tensor source; lists are padded here")
        if not rows:
            raise ValueError("no source given")
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.as_tensor(list(r), dtype=torch.long)
            mask[i, :len(r)] = True
        if bool(mask.all()):
            mask = None
    if ids.shape[1] == 0 or (mask is not None and not bool(mask.any(-1).all())):
        raise ValueError("every source needs at least one token")
    return ids, mask, single


def check_source(model, ids: torch.Tensor, mask: torch.Tensor | None) -> None:
    """A source longer than the encoder's position table (learned positions, or a frozen sinusoid table as
    Marian's) raises a ValueError naming both lengths."""
    config = model.config
    longest = ids.shape[1] if mask is None else int(mask.sum(-1).max())
    frozen = getattr(getattr(model, "abs_position", None), "table", None)     # Marian's sinusoid table
    table = config.position.kind == "learned" or frozen is not None
    if table and longest > config.max_seq_len:
        raise ValueError(f"the source has {longest} tokens, longer than the encoder takes: its position table "
                         f"stops at max_seq_len={config.max_seq_len}")


def expand_context(context: Context, repeats: int) -> Context:
    """Each row of an encoder's Context repeated `repeats` times in place (beam search: one row per beam)."""
    if repeats == 1:
        return context
    return select_context(context, torch.arange(context.hidden.shape[0], device=context.hidden.device)
                          .repeat_interleave(repeats))


def select_context(context: Context, index: torch.Tensor) -> Context:
    """Rows `index` of a Context, cross-attention keys and values already projected included."""
    pad = context.spec.key_padding
    spec = context.spec if pad is None else dataclasses.replace(context.spec, key_padding=pad.index_select(0, index))
    positions = context.positions
    if positions.shape[0] > 1:
        positions = positions.index_select(0, index)
    kv = {layer: (k.index_select(0, index), v.index_select(0, index)) for layer, (k, v) in context.kv.items()}
    return Context(context.hidden.index_select(0, index), positions, spec, kv)


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """(b, t) bool -> (b, t) long: cumsum(mask) - 1, padded slots -1."""
    return torch.where(mask, mask.long().cumsum(-1) - 1, -1)


# tokens per forward of a StreamingLLM prefill past the cache's capacity: the scores of one such forward are
# (b, h, STRETCH, capacity + STRETCH), so a long prompt never holds a (prompt x prompt) matrix; 128 was the fastest
# of 32-2,048 for capacities 256 and 1,024 (benchmarks/sink_prefill.py: smaller chunks score fewer masked pairs,
# smaller still run the linears on too few rows)
STRETCH = 128


def stretches(model) -> bool:
    """Whether a fresh StreamingLLM cache can take a prompt longer than it holds in one forward of `model` (every
    self-attention layer: SinkKVCache.stretches), scoring it as feeding it token by token would.
    Example: stretches(TransformerLM(archlab.presets.tiny("llama3"))) is True; an ALiBi model's is False"""
    return all(SinkKVCache.stretches(m.position, MaskSpec(causal=True).restricted(m.local))
               for m in model.modules() if isinstance(m, Attention))


def vocab_limit(model, tokenizer) -> int | None:
    """The tokenizer's vocabulary size where the model's embedding is padded past it (else None): the
    `vocab_limit` that keeps decoding from picking ids the tokenizer cannot decode.
    Example: archlab.generate(model, ids, 32, vocab_limit=vocab_limit(model, tokenizer))"""
    size = getattr(tokenizer, "vocab_size", None)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if size is not None and vocab is not None and size < vocab else None


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    p = next(model.parameters(), None)
    return p.dtype if p is not None else torch.float32


def model_device(model: torch.nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


class Stepper:
    """Runs the model over a batch, cached (StaticKVCache or StreamingLLM's SinkKVCache) or not."""

    def __init__(self, model, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, *,
                 use_cache: bool = True, sink_tokens: int | None = None,
                 sink_window: int | None = None, fast: bool = True, vocab_limit: int | None = None,
                 source: tuple[torch.Tensor, torch.Tensor | None] | None = None, source_repeats: int = 1,
                 rewindable: bool = False, prefix: PrefixCache | None = None, compile: bool = False):
        """source: an encoder-decoder's (source ids (b', s), mask (b', s) or None), encoded once at prefill, each
        row serving `source_repeats` consecutive rows of `ids` (its decoder prompts: b = b' * source_repeats).
        rewindable: `rewind` may drop tokens at any point (windowed layers keep every slot, no rolling buffer).
        prefix: a PrefixCache kept across calls (one unpadded row): only the prompt's tokens it does not hold are
        prefilled, and every token fed is recorded in it.
        compile: one-token steps through the model's compiled step (nn/compiled_step.py) where it can take one:
        cached, decoder-only, no StreamingLLM, no hooks (else eager, with a warning)."""
        self.model = model
        self.config = config = getattr(model, "config", None)
        device = model_device(model)
        self.mask = mask.to(device)
        self.ids = ids.to(device).masked_fill(~self.mask, 0)  # pad ids may be anything (e.g. -1)
        self.positions = positions_from_mask(self.mask)
        self.sink = sink_window is not None
        b, t = ids.shape
        self.source, self.source_repeats, self.context = None, source_repeats, None
        if is_encoder_decoder(model) != (source is not None):
            raise ValueError("an encoder-decoder decodes from a source (source=...)" if source is None
                             else "source= is for encoder-decoders; this model is decoder-only")
        if source is not None:
            src, src_mask = source
            if src.shape[0] * source_repeats != b or not bool(self.mask.all()):
                raise ValueError(f"{src.shape[0]} sources x {source_repeats} need as many unpadded decoder "
                                 f"prompts, got {b}")
            if self.sink:
                raise ValueError("StreamingLLM mode (sink_window) is for decoder-only models")
            check_source(model, src, src_mask)
            self.source = (src.to(device), None if src_mask is None else src_mask.to(device))
        self.prefix = prefix
        self.compiled = None          # the model's compiled decode step (compile=True), or None: eager steps
        self._first_compiled = True   # its first call checks the guards (then skipped)
        if compile:
            why = self._why_not_compiled(model, use_cache, source, sink_window)
            if why is None:
                self.compiled = compiled_step(model.decode_plan(), model)
            else:
                warnings.warn(f"compile=True: decoding eagerly, the compiled step needs {why}", stacklevel=4)
        if prefix is not None:
            if b != 1 or not bool(self.mask.all()) or self.sink or source is not None or not use_cache:
                raise ValueError("a prefix cache (prefix_cache=) serves one unpadded row of a decoder-only model, "
                                 "cached, without StreamingLLM")
            if config is None:
                raise ValueError("a prefix cache needs model.config")
            self._check_context(max_new_tokens)
            self.cache = prefix.open(model, self.ids, model_dtype(model), device,
                                     need=t + max_new_tokens + (self.compiled is not None))   # a spare slot, as below
        elif self.sink:
            self._check_sink_mode(sink_tokens, sink_window)
            self.cache = SinkKVCache(config, b, sink_tokens=sink_tokens or 0, window=sink_window,
                                     dtype=model_dtype(model), device=device)
        elif use_cache:
            if config is None:
                raise ValueError("a KV cache needs model.config; pass use_cache=False for this model")
            self._check_context(max_new_tokens)
            depth = config.stack_depth("cross_decoder") if source is not None else None   # the decoder's
            # compiled: every slot, and one to spare (the compiled step never fills the last: nn/compiled_step.py)
            compiled = self.compiled is not None
            self.cache = StaticKVCache(config, b, t + max_new_tokens + compiled, dtype=model_dtype(model),
                                       device=device, n_layers=depth, rolling=not (rewindable or compiled))
        else:
            if config is not None:
                self._check_context(max_new_tokens)
            self.cache = None
        self._hidden_head = hasattr(model, "lm_head") and config is not None
        # no padding: a TransformerLM is given positions=None and counts them from its cache (0..t-1 at first)
        self.implied = config is not None and bool(self.mask.all())
        # the model's decode plan (packed weights, direct calls) checked once per generate call, not per step
        self.session = decode_session(model) if fast else None
        # a model whose embedding is padded past its tokenizer (e.g. to a multiple of 64) must never pick
        # an id the tokenizer cannot decode: logits are cut to the first `vocab_limit` ids
        if vocab_limit is not None and vocab_limit < 1:
            raise ValueError(f"vocab_limit={vocab_limit} must be >= 1")
        self.vocab_limit = vocab_limit

    # ---- checks ------------------------------------------------------------------------------
    @staticmethod
    def _why_not_compiled(model, use_cache: bool, source, sink_window) -> str | None:
        """What the compiled step (nn/compiled_step.py) needs that this generation lacks, or None."""
        if not use_cache or source is not None or sink_window is not None:
            return "a KV cache (not uncached, an encoder-decoder or StreamingLLM)"
        why = compilable(model)
        if why is None and decode_session(model).views is None:
            why = "a model without hooks or compiled wrappers"
        return why

    def _check_context(self, max_new_tokens: int) -> None:
        ctx = self.config.max_seq_len
        longest = int(self.mask.sum(-1).max())
        hint = ("shorten the prompt, or decode in StreamingLLM mode (sink_window=N, sink_tokens=4) which keeps "
                "attention sinks + a recent window")
        if self.source is not None:
            if longest + max_new_tokens > ctx:
                raise ValueError(f"the decoder's start ({longest} tokens) + max_new_tokens={max_new_tokens} "
                                 f"exceeds the model's context max_seq_len={ctx}: lower max_new_tokens")
            return
        if longest > ctx:
            raise ValueError(f"prompt has {longest} tokens, longer than the model's context "
                             f"max_seq_len={ctx}: {hint}")
        if longest + max_new_tokens > ctx:
            raise ValueError(f"prompt ({longest} tokens) + max_new_tokens={max_new_tokens} exceeds "
                             f"the model's context max_seq_len={ctx}: lower max_new_tokens or {hint}")

    def _check_sink_mode(self, sink_tokens, sink_window) -> None:
        if self.config is None:
            raise ValueError("StreamingLLM mode needs a TransformerLM (model.config)")
        if self.config.position.kind in ABSOLUTE_POSITIONS:
            raise ValueError(
                f"StreamingLLM mode needs positions inside attention (rope, alibi, t5, none); "
                f"position.kind={self.config.position.kind!r} is added at the input"
            )
        if not self.mask.all():
            raise ValueError("StreamingLLM mode does not take padded prompts (each row's first "
                             "tokens are its sinks): decode rows of different lengths separately")
        if (sink_tokens or 0) + sink_window > self.config.max_seq_len:
            raise ValueError(f"sink_tokens + sink_window = {(sink_tokens or 0) + sink_window} must "
                             f"fit the context max_seq_len={self.config.max_seq_len}")

    # ---- running the model ---------------------------------------------------------------------
    def _logits(self, ids, positions, cache, last: int | None = None) -> torch.Tensor:
        """-> (b, v) at the last position, or (b, last, v) at the last `last` positions."""
        if self.implied:   # unpadded rows: the model continues the cache itself (a decode step needs no mask)
            positions = None
        return self._within_vocab(self._model_logits(ids, positions, cache, last))

    def _within_vocab(self, logits: torch.Tensor) -> torch.Tensor:    # (..., v) -> (..., vocab_limit | v)
        return logits if self.vocab_limit is None else logits[..., :self.vocab_limit]

    def _model_logits(self, ids, positions, cache, last: int | None = None) -> torch.Tensor:
        where = -1 if last is None else slice(ids.shape[1] - last, None)   # the positions whose logits are wanted
        if self.context is not None:   # an encoder-decoder's decoder (unpadded rows: positions implied)
            session = self.session
            hidden = self.model.decode(ids, self.context, return_hidden=True, cache=cache, session=session)
            return call(self.model.lm_head, session)(hidden[:, where], session)          # (b, v) | (b, last, v)
        if self._hidden_head:  # the head over the last position(s) only (the prompt can be long)
            session = self.session
            hidden = call(self.model, session)(ids, positions, cache, return_hidden=True, session=session)  # (b, t, d)
            return call(self.model.lm_head, session)(hidden[:, where], session)  # (b, v) | (b, last, v)
        return self.model(ids, positions=positions, cache=cache)[:, where]

    def prefill(self) -> torch.Tensor:
        if self.source is not None:    # the encoder, once; its rows repeated for the decoder's (beams)
            self.context = expand_context(self.model.encode(*self.source), self.source_repeats)
        if self.cache is None:
            return self._logits(self.ids, self.positions, None)
        if self.prefix is not None:   # continue the held prefix: only what the prompt adds
            new = self.ids[:, self.prefix.reused:]
            logits = self._logits(new, None, self.cache)
            self.prefix.fed(new)
        elif self.sink:
            # the cache's capacity in one forward, then the rest in chunks of STRETCH tokens, each scored as feeding
            # it token by token would (SinkKVCache.stretch), or, where some layer does not allow that (a position
            # bias, a window of its own), token by token
            t, cap = self.ids.shape[1], self.cache.sink_tokens + self.cache.window
            chunk = STRETCH if stretches(self.model) else 1
            for start, end in zip([0, *range(cap, t, chunk)], [*range(cap, t, chunk), t]):
                logits = self._logits(self.ids[:, start:end], self.positions[:, start:end], self.cache)
        else:
            logits = self._logits(self.ids, self.positions, self.cache)
        self.next_pos = self.positions[:, -1:] + 1                   # (b, 1)
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:            # (b,) -> (b, v)
        tokens = tokens[:, None]
        if self.compiled is not None:
            logits = self.compiled(tokens, self.next_pos, self.cache, first=self._first_compiled)
            if logits is not None:
                self._first_compiled = False
                self.next_pos = self.next_pos + 1
                if self.prefix is not None:
                    self.prefix.fed(tokens)
                return self._within_vocab(logits)
            self.compiled = None                                    # it failed to compile: eager from here
        if self.cache is None:
            next_pos = self.positions[:, -1:] + 1
            self.ids = torch.cat((self.ids, tokens), dim=1)
            self.positions = torch.cat((self.positions, next_pos), dim=1)
            return self._logits(self.ids, self.positions, None)
        logits = self._logits(tokens, self.next_pos, self.cache)
        self.next_pos = self.next_pos + 1
        if self.prefix is not None:
            self.prefix.fed(tokens)
        return logits

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:         # (b, m) -> (b, m, v)
        """Feed m tokens per row in one forward: the logits after each (speculative decoding's verification)."""
        m = tokens.shape[1]
        steps = torch.arange(m, device=tokens.device)[None]                          # (1, m)
        if self.cache is None:
            next_pos = self.positions[:, -1:] + 1 + steps
            self.ids = torch.cat((self.ids, tokens), dim=1)
            self.positions = torch.cat((self.positions, next_pos), dim=1)
            return self._logits(self.ids, self.positions, None, last=m)
        logits = self._logits(tokens, self.next_pos + steps, self.cache, last=m)
        self.next_pos = self.next_pos + m
        if self.prefix is not None:
            self.prefix.fed(tokens)
        return logits

    def rewind(self, n: int) -> None:
        """Forget the last n tokens fed (rejected drafts): the cache is cropped, positions step back."""
        if n == 0:
            return
        if self.cache is None:
            self.ids, self.positions = self.ids[:, :-n], self.positions[:, :-n]
            return
        self.cache.crop(len(self.cache) - n)
        self.next_pos = self.next_pos - n
        if self.prefix is not None:
            self.prefix.dropped(n)

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows `index` (beam search)."""
        if self.context is not None:
            self.context = select_context(self.context, index)
        if self.cache is None:
            self.ids, self.positions = self.ids[index], self.positions[index]
        else:
            self.cache.reorder(index)
            self.next_pos = self.next_pos[index]
