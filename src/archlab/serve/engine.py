"""The model behind the server, with continuous batching: concurrent requests share one batched decode.

Each request gets a row of a `SlotKVCache` (archlab.nn.kv_cache): it joins between decode steps (its prompt
prefilled into its row), every step runs ONE forward over all active rows (each at its own position), and a
finished or cancelled request leaves its row to the next one in the queue. Rows of different lengths mask
their empty slots through the positions the cache returns, so a row's tokens are those it would get alone.
The scheduler runs on its own thread: the event loop (health, model list, other connections) never waits
on a forward. `rows_per_step` counts how many rows each decode step carried.
"""
from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from archlab.errors import UserError
from archlab.nn.fused import DecodeSession

__all__ = ["Engine", "CompletionRequest", "RequestError"]


class RequestError(UserError):
    """A request the model cannot serve (an HTTP 400): the message says what and by how much."""


@dataclass
class CompletionRequest:
    prompt: str
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class Delta:
    text: str                              # new text since the previous delta ("" on the last one)
    finish_reason: str | None = None       # "stop" (EOS or a stop string) | "length" on the last one
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class _Job:
    ids: list[int]
    request: CompletionRequest
    cancel: threading.Event
    out: queue.Queue = field(default_factory=queue.Queue)
    row: int = -1
    new: list[int] = field(default_factory=list)
    sent: str = ""
    head: str = ""
    generator: torch.Generator | None = None


class Engine:
    """A loaded model and tokenizer serving up to `max_batch` requests at once.
    Example: Engine.from_folder("runs/demo").complete(CompletionRequest("ROMEO:", max_tokens=8))"""

    def __init__(self, model, tokenizer, name: str, chat_template: str | None = None, max_batch: int = 8):
        from archlab.nn.kv_cache import SlotKVCache

        self.model, self.tokenizer, self.name, self.chat_template = model, tokenizer, name, chat_template
        from archlab.generation.stepper import vocab_limit
        self.vocab_limit = vocab_limit(model, tokenizer)
        self.context = model.config.max_seq_len
        self.eos = getattr(tokenizer, "eot_id", None)
        weight = next(model.parameters())
        self.slots = SlotKVCache(model.config, max_batch, self.context, dtype=weight.dtype, device=weight.device)
        self.rows_per_step: collections.Counter = collections.Counter()
        self._waiting: collections.deque[_Job] = collections.deque()
        self._active: dict[int, _Job] = {}
        self._session: DecodeSession | None = None   # one per batch composition: renewed as jobs join or leave
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_folder(cls, path: str | Path, device: str = "cpu", max_batch: int = 8) -> Engine:
        from archlab.model_folder import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(path, device, purpose="serve")
        folder = Path(str(path).split("@")[0])
        return cls(model, tokenizer, folder.resolve().name, _chat_template(Path(path)), max_batch)

    # ---- requests
    def encode(self, request: CompletionRequest) -> list[int]:
        """The prompt's ids, checked against the context: a RequestError names the numbers."""
        _check(request)
        ids = self.tokenizer.encode(request.prompt)
        if not ids:
            raise RequestError("the prompt encodes to no tokens")
        if len(ids) + request.max_tokens > self.context:
            raise RequestError(f"the prompt has {len(ids)} tokens and max_tokens is {request.max_tokens}: "
                               f"{len(ids) + request.max_tokens} tokens do not fit the model's context of "
                               f"{self.context}")
        return ids

    def complete(self, request: CompletionRequest, cancel: threading.Event | None = None) -> Iterator[Delta]:
        """Text deltas of one completion (the last one carries finish_reason and token counts), decoded in
        the shared batch. Stops early, with no final delta, once `cancel` is set."""
        job = _Job(self.encode(request), request, cancel or threading.Event())
        if request.seed is not None:
            job.generator = torch.Generator(self.slots.pos.device).manual_seed(request.seed)
        job.head = self.tokenizer.decode(job.ids)
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
                free = [r for r in range(len(self.slots.length)) if r not in self._active]
                joining = [self._waiting.popleft() for _ in range(min(len(free), len(self._waiting)))]
            for row, job in zip(free, joining):
                self._guarded(job, self._prefill, row)
            for job in [j for j in self._active.values() if j.cancel.is_set()]:
                self._leave(job, None)
            if self._active:
                self._step()

    def _guarded(self, job: _Job, fn, *args) -> None:
        try:
            fn(job, *args)
        except Exception as exc:  # handed to the request's reader, which raises it there
            self._leave(job, exc)

    @torch.no_grad()
    def _prefill(self, job: _Job, row: int) -> None:
        job.row = row
        self.slots.reset(row)
        self._active[row] = job
        self._session = None
        ids = torch.tensor([job.ids], device=self.slots.pos.device)                  # (1, t)
        logits = self.model(ids, positions=torch.arange(ids.shape[1], device=ids.device)[None],
                            cache=self.slots.view([row]))                            # (1, t, v)
        self._advance(job, logits[0, -1])

    @torch.no_grad()
    def _step(self) -> None:
        jobs = list(self._active.values())
        rows = [j.row for j in jobs]
        device = self.slots.pos.device
        last = torch.tensor([[j.new[-1]] for j in jobs], device=device)               # (b, 1)
        positions = torch.tensor([[self.slots.length[r]] for r in rows], device=device)   # (b, 1)
        if self._session is None:  # packed weights and the hook check, once per batch composition
            self._session = DecodeSession(self.model)
        # the modules decode through the session's packed weights (archlab.nn.fused)
        logits = self.model(last, positions=positions, cache=self.slots.view(rows), session=self._session)  # (b, 1, v)
        self.rows_per_step[len(rows)] += 1
        for i, job in enumerate(jobs):
            self._guarded(job, self._advance, logits[i, -1])

    def _advance(self, job: _Job, logits: torch.Tensor) -> None:
        from archlab.generation.sampling import SamplingParams, next_token

        request = job.request
        params = SamplingParams(temperature=request.temperature, top_p=request.top_p)
        if self.vocab_limit is not None:      # a padded embedding: ids the tokenizer cannot decode never win
            logits = logits[:self.vocab_limit]
        token = int(next_token(logits[None].float(), params, generator=job.generator)[0])
        if token == self.eos:
            return self._finish(job, "stop")
        job.new.append(token)
        text = _continuation(self.tokenizer.decode(job.ids + job.new), job.head)
        cut = _first_stop(text, request.stop)
        if cut is not None:
            return self._finish(job, "stop", text[:cut])
        if len(job.new) >= request.max_tokens:
            return self._finish(job, "length", text)
        if not text.endswith("\ufffd"):                  # hold back a partly decoded character
            job.out.put(Delta(text[len(job.sent):]))
            job.sent = text

    def _finish(self, job: _Job, reason: str, text: str | None = None) -> None:
        text = job.sent if text is None else text
        job.out.put(Delta(text[len(job.sent):], reason, len(job.ids), len(job.new)))
        self._leave(job, "done")

    def _leave(self, job: _Job, why) -> None:
        """Free the job's row; tell its reader it was cancelled (None) or failed (the exception)."""
        if self._active.get(job.row) is job:
            del self._active[job.row]
            self.slots.reset(job.row)
            self._session = None
        if why is None or isinstance(why, BaseException):
            job.out.put(why)


def _check(request: CompletionRequest) -> None:
    if not 1 <= request.max_tokens:
        raise RequestError(f"max_tokens={request.max_tokens} must be at least 1")
    if not 0 <= request.temperature <= 2:
        raise RequestError(f"temperature={request.temperature} must be in [0, 2]")
    if request.top_p is not None and not 0 < request.top_p <= 1:
        raise RequestError(f"top_p={request.top_p} must be in (0, 1]")


def _continuation(whole: str, head: str) -> str:
    return whole[len(head):] if whole.startswith(head) else whole


def _first_stop(text: str, stops: list[str]) -> int | None:
    found = [text.find(s) for s in stops if s and s in text]
    return min(found) if found else None


def _chat_template(folder: Path) -> str | None:
    """The chat template of an HF tokenizer (tokenizer_config.json), if the folder has one."""
    import json
    for candidate in (folder / "tokenizer_config.json", folder / "tokenizer" / "tokenizer_config.json"):
        if candidate.is_file():
            try:
                template = json.loads(candidate.read_text()).get("chat_template")
            except (ValueError, AttributeError):
                return None
            return template if isinstance(template, str) else None
    return None
