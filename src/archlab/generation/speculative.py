"""Speculative decoding: a draft proposes k tokens, the target checks them all in one forward over its KV cache,
and the cache is cropped back to what was accepted (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023,
arXiv 2302.01318).

    stats = SpeculativeStats()
    ids = archlab.generate(model, prompt, 64, draft="prompt_lookup", draft_tokens=8, stats=stats)
    stats.alpha, stats.tokens_per_round, stats.theory            # acceptance rate, measured, predicted

One round, for drafts d_1..d_k (b rows):
    target forward over [last token, d_1 .. d_k]            -> logits at k + 1 positions (b, k+1, v)
    greedy:   accept d_i while it is the target's argmax; then the target's own token      (plain greedy's tokens)
    sampling: accept d_i with probability min(1, p(d_i) / q(d_i)); at the first rejection draw from
              norm(max(0, p - q)); when all k are accepted draw one more from p             (the target's law)
where p and q are the target's and the draft's distributions after the same processing (logits processors,
temperature, top-k, top-p, min-p). A draft with no distribution (prompt lookup) has q one-hot on its token.

A batch (left padding allowed) advances by the *minimum* accepted run over its unfinished rows, each row then
taking the target's token at that position (its correction, or its accepted draft there, or the next draw). Every
row's tokens are still exactly its own greedy tokens (or a draw from its own distribution: a token accepted by the
rule is a draw from p given the prefix, so stopping a row earlier than its own rejection keeps the law). The
reason: a StaticKVCache writes every row at one count (padding takes slots too), so one crop serves the batch and
the cache stays contiguous; per-row lengths would need holes in the cache or a slot cache. The cost: a batch moves
at its slowest row's pace (a lower tokens per round than each row alone would get).

draft_tokens: k, or "auto" (transformers' heuristic schedule: start at AUTO_START, +2 after a round where every
draft was accepted, -1 otherwise, at least 1). Each round drafts at most what max_new_tokens leaves minus one (the
target's own token), so the cache never holds more than plain decoding's.
The expected tokens per round for a constant acceptance rate alpha is (1 - alpha^(k+1)) / (1 - alpha) (Leviathan
et al., eq. 1): `stats.theory` averages it over the rounds' k beside the measured `stats.tokens_per_round`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from archlab.generation.drafts import Draft, ModelDraft, Setup
from archlab.generation.processors import Processor
from archlab.generation.processors import apply as apply_processors
from archlab.generation.sampling import Generator, SamplingParams, draw, filter_logits, uniform
from archlab.generation.stepper import Stepper

AUTO_START = 5      # "auto": the first round's draft length (transformers starts its assistant at 20 by default;
                    # prompt lookup and n-gram drafts are cheap but each draft token widens the check forward)


@dataclass
class SpeculativeStats:
    """What a speculative generation measured (filled in by generate/stream(..., stats=...); passed to several
    calls, it adds them up)."""
    draft: str = ""
    rounds: int = 0                 # target forwards after the prefill (a round with no draft is a plain step)
    drafted: int = 0                # draft tokens proposed, over rows
    accepted: int = 0               # of them, accepted by each row's own rule
    rejected: int = 0               # row-rounds whose own accepted run stopped at a rejection (not all k kept)
    new_tokens: int = 0             # tokens produced per row (the first, from the prefill, included)
    target_forwards: int = 0        # the prefill + every round
    draft_lengths: list[int] = field(default_factory=list)   # k of each round (0: no draft that round)
    seconds: float = 0.0            # wall time of the whole generation

    @property
    def alpha(self) -> float:
        """Acceptance rate, Leviathan et al.'s alpha: the chance that a draft token the rule checks is accepted,
        accepted / (accepted + rejected). A row's check stops at its first rejection, so the drafts after it
        were never checked and do not count (accepted / drafted, `kept`, would be lower the longer k is)."""
        checked = self.accepted + self.rejected
        return self.accepted / checked if checked else 0.0

    @property
    def kept(self) -> float:
        """The share of drafted tokens kept: accepted / drafted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def prefills(self) -> int:
        return self.target_forwards - self.rounds

    @property
    def tokens_per_forward(self) -> float:
        """New tokens per target forward, the prefill counted (plain decoding: 1.0)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_round(self) -> float:
        """New tokens per checking forward (the prefill's token aside): what the theory predicts."""
        return (self.new_tokens - self.prefills) / self.rounds if self.rounds else 0.0

    @property
    def theory(self) -> float:
        """(1 - alpha^(k+1)) / (1 - alpha), averaged over the rounds' k: tokens per round if every draft token
        were accepted independently with probability alpha."""
        if not self.draft_lengths:
            return 0.0
        a = self.alpha
        per = [(k + 1.0) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a) for k in self.draft_lengths]
        return sum(per) / len(per)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> str:
        """One line: alpha, tokens per target forward, tokens per round beside the theory."""
        mean_k = sum(self.draft_lengths) / len(self.draft_lengths) if self.draft_lengths else 0.0
        return (f"draft {self.draft}: acceptance rate {self.alpha:.2f} ({self.accepted} of "
                f"{self.accepted + self.rejected} checked; {self.drafted} drafted), "
                f"{self.tokens_per_forward:.2f} tokens per target forward; per check round {self.tokens_per_round:.2f} "
                f"(theory (1-a^(k+1))/(1-a) = {self.theory:.2f} at mean k {mean_k:.1f}); "
                f"{self.tokens_per_second:.1f} tokens/s")


class Schedule:
    """The draft length: a fixed k, or "auto" (transformers' heuristic: +2 when a round accepted every draft,
    -1 otherwise, never below 1)."""

    def __init__(self, draft_tokens: int | str | None):
        if draft_tokens is None:
            draft_tokens = "auto"
        if draft_tokens == "auto":
            self.k, self.auto = AUTO_START, True
        elif isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int):
            raise ValueError(f"draft_tokens={draft_tokens!r} must be a whole number >= 1 or 'auto'")
        elif draft_tokens < 1:
            raise ValueError(f"draft_tokens={draft_tokens} must be >= 1 (or 'auto')")
        else:
            self.k, self.auto = draft_tokens, False

    def update(self, drafted: int, accepted: int) -> None:
        if self.auto and drafted:
            self.k = self.k + 2 if accepted == drafted else max(1, self.k - 1)


class Scorer:
    """The target's selection rule, shared by the draft (its proposals) and the check: processors, then greedy
    argmax or the filtered distribution (archlab.generation.sampling)."""

    def __init__(self, params: SamplingParams, processors: list[Processor], generator: Generator | None):
        self.params, self.processors, self.generator = params, processors, generator

    def scores(self, logits: torch.Tensor, seqs: torch.Tensor) -> torch.Tensor:        # (b, v) -> (b, v)
        logits = logits.float()
        return apply_processors(self.processors, seqs, logits) if self.processors else logits

    def probs(self, scores: torch.Tensor) -> torch.Tensor:                              # (b, v) -> (b, v)
        return filter_logits(scores, self.params).softmax(-1)

    def draw(self, probs: torch.Tensor) -> torch.Tensor:                                # (b, v) -> (b,)
        return draw(probs, self.generator)

    def choose(self, logits: torch.Tensor, seqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        scores = self.scores(logits, seqs)
        if self.params.greedy:
            return scores.argmax(-1), None
        probs = self.probs(scores)
        return self.draw(probs), probs

    def uniform(self, b: int, device) -> torch.Tensor:
        return uniform(b, device, self.generator)


def check(scorer: Scorer, logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, seqs: torch.Tensor,
          active: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """One round's verdict. logits (b, k+1, v) after [last, d_1..d_k], drafts (b, k), q (b, k, v) or None (one-hot),
    seqs (b, t) the rows before the drafts, active (b,) rows still generating.
    -> (m, tokens (b, m+1), accepted (b,)): every row takes the drafts d_1..d_m (m = the shortest accepted run over
    active rows) and then its token at m+1; accepted is each row's own accepted run."""
    b, k = drafts.shape
    rows = torch.arange(b, device=drafts.device)
    greedy = scorer.params.greedy
    if greedy and not scorer.processors:
        picks = logits.float().argmax(-1)                                                  # (b, k+1)
        accept = drafts == picks[:, :k]
        probs = None
    else:
        picks_list, probs_list, so_far = [], [], seqs
        for i in range(k + 1):
            scores = scorer.scores(logits[:, i], so_far)
            if greedy:
                picks_list.append(scores.argmax(-1))
            else:
                probs_list.append(scorer.probs(scores))
            if i < k:
                so_far = torch.cat((so_far, drafts[:, i:i + 1]), 1)
        if greedy:
            picks = torch.stack(picks_list, 1)
            accept = drafts == picks[:, :k]
            probs = None
        else:
            probs = torch.stack(probs_list, 1)                                             # (b, k+1, v)
            p_x = probs[:, :k].gather(-1, drafts[..., None])[..., 0]                       # (b, k)
            q_x = torch.ones_like(p_x) if q is None else q.gather(-1, drafts[..., None])[..., 0]
            r = torch.stack([scorer.uniform(b, drafts.device) for _ in range(k)], 1) if k else p_x
            accept = r * q_x < p_x                                 # probability min(1, p / q)
    accepted = accept.long().cumprod(-1).sum(-1) if k else torch.zeros(b, dtype=torch.long, device=drafts.device)
    m = int(torch.where(active, accepted, k).min()) if bool(active.any()) else k
    if greedy:
        last = picks[:, m]
    else:
        assert probs is not None
        p = probs[:, m]                                                                    # (b, v)
        if m < k:
            if q is None:
                residual = p.clone()
                residual[rows, drafts[:, m]] = 0.0
            else:
                residual = (p - q[:, m]).clamp_min(0.0)
            total = residual.sum(-1, keepdim=True)
            residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p)
            drawn = scorer.draw(residual)
            last = torch.where(accepted > m, drafts[:, m], drawn)
        else:
            last = scorer.draw(p)
    tokens = torch.cat((drafts[:, :m], last[:, None]), 1)                                  # (b, m+1)
    return m, tokens, accepted


def steps(stepper: Stepper, draft: Draft, schedule: Schedule, max_new_tokens: int, scorer: Scorer,
          prompt: torch.Tensor, mark: Callable[[torch.Tensor], torch.Tensor], done: Callable[[], bool],
          active: Callable[[], torch.Tensor], stats: SpeculativeStats, eos: tuple[int, ...] = ()
          ) -> Iterator[torch.Tensor]:
    """The speculative decode loop: yields (b,) tokens one position at a time, as decode's plain loop does.
    mark(tokens) -> the tokens shown (finished rows: pad) and records EOS / stop strings; done(): every row finished;
    active(): (b,) rows still generating."""
    start = time.perf_counter()
    device = stepper.ids.device
    seqs = prompt.to(device)                                                  # (b, t): the rows so far
    logits = stepper.prefill()
    stats.target_forwards += 1
    first, _ = scorer.choose(logits, seqs)
    draft.start(stepper.ids, stepper.mask, Setup(vocab=logits.shape[-1], max_new_tokens=max_new_tokens,
                                                 sampling=not scorer.params.greedy, eos=eos))
    produced = 1
    stats.new_tokens += 1
    yield mark(first)
    seqs = torch.cat((seqs, first[:, None]), 1)
    try:
        while produced < max_new_tokens and not done():
            k = min(schedule.k, max_new_tokens - produced - 1)
            proposal = draft.propose(seqs, k, scorer.choose) if k > 0 else None
            drafts = proposal.tokens if proposal is not None else seqs[:, :0]
            k = drafts.shape[1]
            logits = stepper.extend(torch.cat((seqs[:, -1:], drafts), 1))                    # (b, k+1, v)
            stats.target_forwards += 1
            stats.rounds += 1
            now = active()
            m, tokens, accepted = check(scorer, logits, drafts, proposal.probs if proposal else None, seqs, now)
            stepper.rewind(k - m)
            draft.commit(seqs.shape[1] + m)
            stats.draft_lengths.append(k)
            if k:
                rows = int(now.sum())
                stats.drafted += k * rows
                stats.accepted += int(accepted[now].sum())
                stats.rejected += int((accepted[now] < k).sum())
                schedule.update(k, int(accepted[now].min()) if rows else k)
            for j in range(m + 1):
                produced += 1
                stats.new_tokens += 1
                yield mark(tokens[:, j])
                if done():
                    return
            seqs = torch.cat((seqs, tokens), 1)
    finally:
        stats.seconds += time.perf_counter() - start


def check_target(model) -> None:
    """A ValueError when `model` cannot check drafts exactly: its int8 layers quantize a forward's tokens together
    (nn/int8.rows_quantized_together), so checking k drafts in one forward would not give plain decoding's tokens."""
    from archlab.nn.int8 import rows_quantized_together

    if rows_quantized_together(model):
        raise ValueError("speculative decoding checks the drafted tokens in one forward, and this model's int8 "
                         "layers quantize the activations of a forward's tokens together: its output would not be "
                         "plain decoding's; draft for the float run it was quantized from (the draft may be int8)")


def prepare(draft: Draft, model, prompt_width: int, max_new_tokens: int, draft_tokens) -> Schedule:
    """Checks before anything runs: the target, the draft length, and for a draft model its vocabulary and context."""
    check_target(model)
    schedule = Schedule(draft_tokens)
    context = getattr(getattr(model, "config", None), "max_seq_len", None)
    if not schedule.auto and context is not None and schedule.k >= context:
        raise ValueError(f"draft_tokens={schedule.k} is longer than the model's context max_seq_len={context}")
    if isinstance(draft, ModelDraft):
        draft.check(model, prompt_width, max_new_tokens)
    return schedule
