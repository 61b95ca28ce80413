"""Next-token selection from logits: greedy and filtered sampling.

By default the filters run in this order (the order transformers applies its processors and warpers):

    repetition penalty -> temperature -> top-k -> top-p -> min-p -> sample

`SamplingParams.order` (generation config `sampling_order`, CLI --sampling-order) reorders the four steps
after the penalty: "notes" is the architecture notes' top-k -> top-p -> temperature (-> min-p), where top-p
measures its mass before the temperature flattens or sharpens the distribution, so a different set survives.

  repetition penalty  CTRL (Keskar et al. 2019, arXiv 1909.05858): every token already in the row
                      (prompt included) has its logit divided by the penalty if positive, multiplied
                      if negative.
  temperature         logits / T; T = 0 means greedy (argmax after the repetition penalty).
  top-k               keep the k largest logits (Fan et al. 2018).
  top-p (nucleus)     keep the smallest set of most likely tokens whose mass reaches p
                      (Holtzman et al. 2019, arXiv 1904.09751); the most likely token always stays.
  min-p               keep tokens whose probability is at least min_p x the top probability
                      (Nguyen et al. 2024, arXiv 2407.01082).
The draw itself takes one torch.Generator for the batch, or GroupGenerators: one per block of rows (an RL
rollout's group of completions of one prompt), so a block samples the same whichever rows share its batch.
Shapes: b batch (rows), v vocab.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from archlab.nn.registry import Registry

# step name -> fn(logits (b, v) float, params) -> logits with removed tokens at -inf
SAMPLING_STEPS: Registry[Callable[[torch.Tensor, SamplingParams], torch.Tensor]] = Registry("sampling step")
SAMPLING_ORDERS = {"transformers": ("temperature", "top_k", "top_p", "min_p"),    # the default
                   "notes": ("top_k", "top_p", "temperature", "min_p")}


def sampling_order(order) -> tuple[str, ...]:
    """The full step order from a name in SAMPLING_ORDERS, a comma-separated string or a sequence of step names:
    the named steps first, then the unnamed ones in transformers' order. ValueError for an unknown step.
    Example: sampling_order("top_k,top_p,temperature") -> ("top_k", "top_p", "temperature", "min_p")"""
    if isinstance(order, str):
        order = SAMPLING_ORDERS.get(order) or tuple(s.strip() for s in order.split(",") if s.strip())
    steps = tuple(order)
    known = SAMPLING_ORDERS["transformers"]
    unknown = [s for s in steps if s not in known]
    if unknown or len(set(steps)) != len(steps) or not steps:
        what = f"unknown step {unknown[0]!r}" if unknown else "each step at most once" if steps else "no step"
        raise ValueError(f"sampling order {','.join(steps) or repr(order)}: {what} (steps: {', '.join(known)}; "
                         f"or one of {', '.join(SAMPLING_ORDERS)})")
    return steps + tuple(s for s in known if s not in steps)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    order: tuple[str, ...] = SAMPLING_ORDERS["transformers"]   # see sampling_order

    def __post_init__(self):
        object.__setattr__(self, "order", sampling_order(self.order))
        if not self.temperature >= 0 or math.isinf(self.temperature):   # NaN fails `>= 0`
            raise ValueError(f"temperature={self.temperature} must be a finite number >= 0 (0 means greedy)")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be >= 1 (or None for no top-k)")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if self.repetition_penalty is not None and not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be > 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits (b, v) float, seen (b, v) bool: tokens present in the row so far."""
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p in `params.order`: removed tokens get -inf. (b, v) -> (b, v) float."""
    logits = logits.float()
    for step in params.order:
        logits = SAMPLING_STEPS.get(step)(logits, params)
    return logits


@SAMPLING_STEPS.register("temperature")
def _temperature(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return logits / params.temperature


@SAMPLING_STEPS.register("top_k")
def _top_k(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    if params.top_k is None or params.top_k >= logits.shape[-1]:
        return logits
    kth = logits.topk(params.top_k, dim=-1).values[..., -1:]                      # (b, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


@SAMPLING_STEPS.register("top_p")
def _top_p(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    if params.top_p is None or params.top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs                                        # (b, v)
    drop_sorted = mass_before >= params.top_p     # the set already reached p without it
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


@SAMPLING_STEPS.register("min_p")
def _min_p(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    if params.min_p is None or params.min_p <= 0.0:
        return logits
    probs = logits.softmax(-1)
    threshold = params.min_p * probs.amax(-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


class GroupGenerators:
    """One torch.Generator per block of `size` consecutive rows (an RL rollout's completions of one prompt): a block
    draws from its own generator alone, so what its rows sample does not depend on which other rows share the batch
    (a rollout split over data-parallel ranks samples what the whole batch samples on one process).
    Example: generate(model, ids, 8, temperature=1.0, generator=GroupGenerators.seeded([3, 4], size=2))"""

    def __init__(self, generators: Sequence[torch.Generator], size: int):
        self.generators, self.size = list(generators), size

    @classmethod
    def seeded(cls, seeds: Sequence[int], size: int, device: torch.device | str = "cpu") -> GroupGenerators:
        return cls([torch.Generator(device=device).manual_seed(s) for s in seeds], size)

    def _blocks(self, b: int) -> list[int]:
        if b != self.size * len(self.generators):
            raise ValueError(f"{b} rows for {len(self.generators)} generators of {self.size} rows each")
        return [self.size] * len(self.generators)

    def multinomial(self, probs: torch.Tensor) -> torch.Tensor:
        """One draw per row: probs (b, v) -> (b,) long."""
        blocks = probs.split(self._blocks(probs.shape[0]))
        return torch.cat([torch.multinomial(p, 1, generator=g)[:, 0] for p, g in zip(blocks, self.generators)])

    def rand(self, b: int, device: torch.device | str) -> torch.Tensor:
        """(b,) uniform in [0, 1), each block's from its generator."""
        return torch.cat([torch.rand(n, device=device, generator=g) for n, g in zip(self._blocks(b), self.generators)])


Generator = torch.Generator | GroupGenerators


def draw(probs: torch.Tensor, generator: Generator | None = None) -> torch.Tensor:
    """One token per row from probs (b, v) -> (b,) long, from one generator or one per block of rows."""
    if isinstance(generator, GroupGenerators):
        return generator.multinomial(probs)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def uniform(b: int, device: torch.device | str, generator: Generator | None = None) -> torch.Tensor:
    """(b,) uniform draws in [0, 1), from one generator or one per block of rows."""
    if isinstance(generator, GroupGenerators):
        return generator.rand(b, device)
    return torch.rand(b, device=device, generator=generator)


def next_token(logits: torch.Tensor, params: SamplingParams, *, seen: torch.Tensor | None = None,
               generator: Generator | None = None) -> torch.Tensor:
    """Pick one token per row: logits (b, v) -> (b,) long."""
    if params.repetition_penalty is not None and params.repetition_penalty != 1.0 and seen is not None:
        logits = apply_repetition_penalty(logits.float(), seen, params.repetition_penalty)
    if params.greedy:
        return logits.argmax(-1)
    return draw(filter_logits(logits, params).softmax(-1), generator)
