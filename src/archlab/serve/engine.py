"""The model behind the server, with continuous batching: concurrent requests share one batched decode.

Each request gets a row of a `SlotKVCache` (archlab.nn.kv_cache): it joins between decode steps (its prompt
prefilled into its row), every step runs ONE forward over all active rows (each at its own position), and a
finished or cancelled request leaves its row to the next one in the queue. Rows of different lengths mask
their empty slots through the positions the cache returns, so a row's tokens are those it would get alone.
The scheduler runs on its own thread: the event loop (health, model list, other connections) never waits
on a forward; a forward that fails fails the requests in it, not the scheduler. `rows_per_step` counts how
many rows each decode step carried. A request's deltas hold back a tail that may still become a stop string
(archlab.serve.stops), so they join to exactly the text cut just before the stop.

A model folder's generation_config.json gives each request its defaults (archlab.serve.settings): EOS ids,
sampling, stop strings and the logits processors, each request with its own (its own history for n-gram
blocking), its own fields winning.

The rows outlive their requests (archlab.serve.prefixes): a finished request's keys and values stay in its row, and
a request whose prompt shares a token prefix with what a row holds prefills only the rest (a chat's next turn, a
shared system prompt); `cache_rows` rows are kept, at most `max_batch` of them decoding at once, the least recently
used evicted first. Each answer's last delta counts the prompt tokens found cached (`cached_tokens`).
"""
from __future__ import annotations

import collections
import dataclasses
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from archlab.errors import UserError
from archlab.generation.chat import end_of_turn_ids, stopping_at
from archlab.generation.config import GenerationConfig
from archlab.nn.fused import DecodeSession, call, decode_session
from archlab.runs.chat_folder import chat_tokenizer
from archlab.runs.model_folder import check_vocabulary
from archlab.serve.fields import RANGES, RequestError
from archlab.serve.prefixes import SlotPrefixes
from archlab.serve.stops import first_stop, releasable, settled_stop
from archlab.tokenizer.chat import ChatTokenizer

__all__ = ["Engine", "CompletionRequest", "RequestError"]

# below this temperature a request decodes greedily (vLLM's _SAMPLING_EPS): dividing logits by 1e-45 overflows
GREEDY_BELOW = 1e-5


@dataclass
class CompletionRequest:
    """One request; None: not given (the folder's generation config, else OpenAI's default: 16 tokens,
    temperature 1). top_k, min_p and repetition_penalty are vLLM's extra fields; top_k 0 or -1: no top-k."""
    prompt: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    end_ids: tuple[int, ...] = ()          # ids that also end the answer: a chat turn's end-of-turn tokens


@dataclass
class Delta:
    text: str                              # new text since the previous delta ("" on the last one)
    finish_reason: str | None = None       # "stop" (EOS or a stop string) | "length" on the last one
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0                 # prompt tokens whose keys and values a slot already held


@dataclass
class _Job:
    ids: list[int]
    settings: GenerationConfig             # the request's own over the folder's (max_new_tokens resolved)
    cancel: threading.Event
    out: queue.Queue = field(default_factory=queue.Queue)
    row: int = -1
    cached: int = 0                        # prompt tokens found in the row's prefix cache
    new: list[int] = field(default_factory=list)
    sent: str = ""                         # the text handed out so far: never a part a stop string may still cut
    text: str = ""                         # the whole text decoded so far (past any stop string: cut)
    head: str = ""
    generator: torch.Generator | None = None
    processors: list = field(default_factory=list)


def _row_plan(config, rows: int, dtype: torch.dtype, device: torch.device, context: int | None):
    """A row's tokens: `context` where given (at most the model's), else archlab.serve.cache_size's default."""
    from archlab.models.accounting import available_memory, kv_bytes_per_token
    from archlab.serve.cache_size import CachePlan, cache_budget, row_tokens

    most = config.max_seq_len
    if context is not None:
        if not 1 <= context <= most:
            raise UserError(f"a KV cache row's context of {context} tokens must be in 1..{most} (the model's)")
        return CachePlan(context, context < most, 0)
    # keys and values of every layer, and its int64 position, for one token of one row (as SlotKVCache allocates)
    per_token = kv_bytes_per_token(config, dtype) + torch.long.itemsize
    return row_tokens(most, rows, per_token, cache_budget(available_memory(device)))


class Engine:
    """A loaded model and tokenizer serving up to `max_batch` requests at once; `generation_config`: the
    folder's decoding defaults (archlab.serve.settings), under each request's own fields. `cache_rows`: rows of
    keys and values kept (default max_batch), finished requests' prefixes held in the free ones for later
    requests; `context`: tokens a row holds (default the model's context, cut to fit a memory budget:
    archlab.serve.cache_size; `plan` says what was chosen); prefix_cache=False: every request prefills its whole
    prompt.
    Example: Engine.from_folder("runs/demo").complete(CompletionRequest("ROMEO:", max_tokens=8))"""

    def __init__(self, model, tokenizer, name: str, chat_template: str | ChatTokenizer | None = None,
                 max_batch: int = 8,
                 generation_config: GenerationConfig | None = None, *, cache_rows: int | None = None,
                 context: int | None = None, prefix_cache: bool = True):
        from archlab.generation.stepper import vocab_limit
        from archlab.nn.kv_cache import SlotKVCache
        from archlab.serve.settings import applied, defaults_for, not_served

        self.model, self.tokenizer, self.name = model, tokenizer, name
        # the template and the special tokens it reads (archlab.tokenizer.chat), or None: no chat endpoint
        self.chat = (chat_template if isinstance(chat_template, ChatTokenizer) or chat_template is None
                     else dataclasses.replace(ChatTokenizer.of(tokenizer), templates=chat_template))
        check_vocabulary(model, tokenizer)
        self.vocab_limit = vocab_limit(model, tokenizer)
        self.defaults = defaults_for(generation_config, getattr(tokenizer, "eot_id", None),
                                     self.vocab_limit or model.config.vocab_size)
        self.applied, self.not_applied = applied(generation_config), not_served(generation_config)
        weight = next(model.parameters())
        rows = max_batch if cache_rows is None else cache_rows
        if max_batch < 1 or rows < max_batch:
            raise UserError(f"cache rows ({rows}) must be at least the batch ({max_batch}), and the batch >= 1")
        self.max_batch = max_batch
        self.plan = _row_plan(model.config, rows, weight.dtype, weight.device, context)
        self.context = self.plan.tokens
        self.slots = SlotKVCache(model.config, rows, self.context, dtype=weight.dtype, device=weight.device)
        self.prefixes = SlotPrefixes(self.slots, enabled=prefix_cache)
        self.prompt_tokens = self.cached_tokens = 0   # over every request admitted: the prefix cache's hit count
        self.rows_per_step: collections.Counter = collections.Counter()
        self._waiting: collections.deque[_Job] = collections.deque()
        self._active: dict[int, _Job] = {}
        self._session: DecodeSession | None = None   # one per batch composition: renewed as jobs join or leave
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._end_of_turn: tuple[int, ...] | None = None

    @classmethod
    def from_folder(cls, path: str | Path, device: str = "cpu", max_batch: int = 8, **kw) -> Engine:
        """The folder's decoder-only LM, tokenizer, chat template and generation_config.json; another kind of
        model is a UserError naming the command that serves it, before any weights load. `kw`: cache_rows,
        context, prefix_cache."""
        from archlab.runs.hub import resolve_model
        from archlab.runs.model_folder import folder_arch, load_model_and_tokenizer

        resolved = resolve_model(path)
        arch = folder_arch(resolved)
        if arch in _OTHER_COMMAND:
            raise UserError(f"archlab serve serves decoder-only models; {path} holds {_OTHER_COMMAND[arch][0]}: "
                            f"use `{_OTHER_COMMAND[arch][1].format(path=path)}`")
        model, tokenizer = load_model_and_tokenizer(resolved, device, purpose="serve", generation_config=True)
        folder = Path(str(path).split("@")[0])
        return cls(model, tokenizer, folder.resolve().name, chat_tokenizer(Path(resolved), tokenizer), max_batch,
                   generation_config=getattr(model, "generation_config", None), **kw)

    def end_of_turn(self) -> tuple[int, ...]:
        """The ids the chat template writes after an assistant's text (archlab.generation.chat), found once:
        a chat answer stops there, as `archlab chat` stops."""
        if self._end_of_turn is None:
            self._end_of_turn = tuple(end_of_turn_ids(self.chat)) if self.chat is not None else ()
        return self._end_of_turn

    # ---- requests
    def encode(self, request: CompletionRequest) -> list[int]:
        """The prompt's ids, checked against the context: a RequestError names the numbers."""
        return self.prepare(request)[0]

    def prepare(self, request: CompletionRequest) -> tuple[list[int], GenerationConfig]:
        """(prompt ids, the request's settings over the folder's), checked: a RequestError names the numbers."""
        from archlab.serve.settings import request_settings

        _check(request)
        ids = self.tokenizer.encode(request.prompt)
        if not ids:
            raise RequestError("the prompt encodes to no tokens", param="prompt", code="invalid_value")
        settings = request_settings(self.defaults, prompt_tokens=len(ids), max_tokens=request.max_tokens,
                                    temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
                                    min_p=request.min_p, repetition_penalty=request.repetition_penalty,
                                    stop=request.stop)
        settings = stopping_at(settings, request.end_ids)
        new = settings.max_new_tokens or 0
        if new < 1:
            raise RequestError(f"the model's generation_config.json max_length={settings.max_length} leaves no "
                               f"tokens after a prompt of {len(ids)}: pass max_tokens")
        if len(ids) + new > self.context:
            raise RequestError(f"the prompt has {len(ids)} tokens and max_tokens is {new}: "
                               f"{len(ids) + new} tokens do not fit the {'server' if self.plan.cut else 'model'}'s "
                               f"context of {self.context}",
                               param="prompt", code="context_length_exceeded")
        return ids, settings

    def complete(self, request: CompletionRequest, cancel: threading.Event | None = None,
                 prepared: tuple[list[int], GenerationConfig] | None = None) -> Iterator[Delta]:
        """Text deltas of one completion (the last one carries finish_reason and token counts), decoded in
        the shared batch; `prepared`: what prepare(request) gave, so a prompt is encoded once. Stops early, with
        no final delta, once `cancel` is set. A delta never holds text that a stop string may still cut."""
        from archlab.serve.settings import processors_for

        ids, settings = prepared or self.prepare(request)
        job = _Job(ids, settings, cancel or threading.Event(), processors=processors_for(settings, len(ids)))
        if request.seed is not None:
            job.generator = torch.Generator(self.slots.pos.device).manual_seed(request.seed)
        job.head = self._text(job.ids)
        with self._wake:
            self._waiting.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="archlab-batcher", daemon=True)
                self._thread.start()
            self._wake.notify()
        while True:
            item = job.out.get()
            if item is None or job.cancel.is_set():   # cancelled: the scheduler frees the row at its next step
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return

    # ---- the scheduler (its own thread)
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._waiting and not self._active:
                    self._wake.wait()
            # the scheduler alone runs the model
            while self._schedule():
                pass

    def _schedule(self) -> bool:
        """Admit waiting requests into free rows, drop cancelled ones, run one decode step; whether work is left."""
        with self._wake:
            joining = [self._waiting.popleft()
                       for _ in range(min(self.max_batch - len(self._active), len(self._waiting)))]
        for job in joining:               # one at a time: a request may reuse the prefix the one before just wrote
            self._guarded(job, self._prefill)
        for job in [j for j in self._active.values() if j.cancel.is_set()]:
            self._leave(job, None)
        if self._active:
            try:
                self._step()
            except Exception as exc:  # a failed batched forward fails its rows; the scheduler lives on
                for job in list(self._active.values()):
                    self._leave(job, exc)
        with self._wake:
            return bool(self._waiting or self._active)

    def _guarded(self, job: _Job, fn, *args) -> None:
        try:
            fn(job, *args)
        except Exception as exc:  # handed to the request's reader, which raises it there
            self._leave(job, exc)

    @torch.no_grad()
    def _prefill(self, job: _Job) -> None:
        """Place the job in a row (archlab.serve.prefixes) and prefill what of its prompt the row does not hold."""
        free = [r for r in range(len(self.slots.length)) if r not in self._active]
        place = self.prefixes.place(job.ids, free, {r: self._fed(j) for r, j in self._active.items()})
        self.prefixes.apply(place)
        job.row, job.cached = place.row, place.cached
        self._active[place.row] = job
        self._session = None
        self.prompt_tokens += len(job.ids)
        self.cached_tokens += job.cached
        device = self.slots.pos.device
        ids = torch.tensor([job.ids[job.cached:]], device=device)                      # (1, t')
        positions = torch.arange(job.cached, len(job.ids), device=device)[None]        # (1, t')
        logits = self.model(ids, positions=positions, cache=self.slots.view([place.row]))  # (1, t', v)
        self._advance(job, logits[0, -1])

    def _fed(self, job: _Job) -> list[int]:
        """The ids whose keys and values the job's row holds: its prompt and the tokens fed back (the newest one
        is fed at the next step)."""
        return (job.ids + job.new)[:self.slots.length[job.row]]

    @torch.no_grad()
    def _step(self) -> None:
        # in the order their rows sit in the slot cache: the batch's keys are one view of it (moved there once
        # per batch composition, archlab.nn.kv_cache.SlotKVCache.view), not copied every step
        jobs = sorted(self._active.values(), key=lambda j: self.slots.physical(j.row))
        rows = [j.row for j in jobs]
        device = self.slots.pos.device
        last = torch.tensor([[j.new[-1]] for j in jobs], device=device)               # (b, 1)
        positions = torch.tensor([[self.slots.length[r]] for r in rows], device=device)   # (b, 1)
        if self._session is None:  # the model's decode plan and the hook check, once per batch composition
            self._session = decode_session(self.model)
        # the modules decode through the plan's packed weights and, hook-free, direct calls (archlab.nn.fused)
        session = self._session
        logits = call(self.model, session)(last, positions=positions, cache=self.slots.view(rows),
                                           session=session)                                   # (b, 1, v)
        self.rows_per_step[len(rows)] += 1
        for i, job in enumerate(jobs):
            self._guarded(job, self._advance, logits[i, -1])

    def _advance(self, job: _Job, logits: torch.Tensor) -> None:
        from archlab.generation.processors import apply
        from archlab.generation.sampling import SamplingParams, next_token

        cfg = job.settings
        temperature = cfg.temperature if (cfg.temperature or 0.0) >= GREEDY_BELOW else 0.0
        params = SamplingParams(temperature=temperature, top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p)
        if self.vocab_limit is not None:      # a padded embedding: ids the tokenizer cannot decode never win
            logits = logits[:self.vocab_limit]
        scores = logits[None].float()                                                  # (1, v)
        if job.processors:                    # this row's history only: prompt + its own tokens
            seqs = torch.tensor([job.ids + job.new], device=scores.device)             # (1, t)
            scores = apply(job.processors, seqs, scores)
        token = int(next_token(scores, params, generator=job.generator)[0])
        if token in cfg.eos:
            return self._finish(job, "stop")
        job.new.append(token)
        stops = cfg.stop_strings or ()
        job.text = _continuation(self._text(job.ids + job.new), job.head)
        if settled_stop(job.text, stops) is not None:
            return self._finish(job, "stop")
        if len(job.new) >= (cfg.max_new_tokens or 0):
            return self._finish(job, "length")
        ready = job.text[:releasable(job.text, stops)]      # a tail that may still become a stop string waits
        if len(ready) > len(job.sent):
            job.out.put(Delta(ready[len(job.sent):]))
            job.sent = ready

    def _text(self, ids: list[int]) -> str:
        """The text of `ids` as the answer shows it: special tokens left out (transformers' decode with
        skip_special_tokens=True, vLLM's default), so a chat model's <|im_start|> never reaches a client."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _finish(self, job: _Job, reason: str) -> None:
        """The last delta: all the text not yet sent (what was held back for a stop that never came), cut before
        the leftmost stop string, which may have waited for a longer one (serve/stops.settled_stop)."""
        cut = first_stop(job.text, job.settings.stop_strings or ())
        if cut is not None:
            job.text, reason = job.text[:cut], "stop"
        job.out.put(Delta(job.text[len(job.sent):], reason, len(job.ids), len(job.new), job.cached))
        self._leave(job, "done")

    def _leave(self, job: _Job, why) -> None:
        """Free the job's row, its tokens kept for a later prefix (emptied after a failure); tell its reader it was
        cancelled (None) or failed (the exception)."""
        if self._active.get(job.row) is job:
            self.prefixes.release(job.row, None if isinstance(why, BaseException) else self._fed(job))
            del self._active[job.row]
            self._session = None
        if why is None or isinstance(why, BaseException):
            job.out.put(why)


_OTHER_COMMAND = {"encoder_decoder": ("an encoder-decoder", "archlab generate {path} --source TEXT"),
                  "encoder": ("an encoder (a masked LM)", "archlab fill-mask {path} TEXT")}


def _check(request: CompletionRequest) -> None:
    for name, (ok, what) in RANGES.items():
        value = getattr(request, name, None)
        if value is not None and not ok(value):
            raise RequestError(f"{name}={value} must be {what}", param=name, code="invalid_value")
    if any(not s for s in request.stop):
        raise RequestError("stop strings must be non-empty", param="stop", code="invalid_value")


def _continuation(whole: str, head: str) -> str:
    return whole[len(head):] if whole.startswith(head) else whole
