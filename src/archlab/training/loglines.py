"""Plain progress lines for runs without a progress bar (batch jobs, CI, `archlab train --no-progress`): the
first loss line at once, then at most one every `every_s` seconds, and always the last step's."""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, TextIO

__all__ = ["LogLines", "EVERY_S"]

EVERY_S = 30.0      # as the progress bar redraws when stderr is not a terminal (archlab.progress)


class LogLines:
    """`step(...)` prints `step 120/1,000  loss 3.412  lr 3.0e-04  4,210 tok/s  mfu 12.3%  0:42` when due.
    Example: lines = LogLines(total_steps=1000); lines.step(10, loss=5.1, lr=3e-4, tokens_per_s=900.0, mfu=0.1)"""

    def __init__(self, total_steps: int | None, every_s: float = EVERY_S, file: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total_steps, self.every_s, self.clock = total_steps, every_s, clock
        self.file = file if file is not None else sys.stderr
        self.started = clock()
        self.last: float | None = None

    def step(self, step: int, *, loss: float, lr: float, tokens_per_s: float, mfu: float, **extra: Any) -> bool:
        """Print this step's line if the first, the last, or `every_s` after the previous one; whether it did."""
        now = self.clock()
        last_step = self.total_steps is not None and step >= self.total_steps
        if self.last is not None and now - self.last < self.every_s and not last_step:
            return False
        self.last = now
        of = f"/{self.total_steps:,}" if self.total_steps is not None else ""
        elapsed = int(now - self.started)
        parts = [f"step {step:,}{of}", f"loss {loss:.4f}", f"lr {lr:.2e}", f"{tokens_per_s:,.0f} tok/s",
                 f"mfu {mfu:.1%}", *(f"{key} {value}" for key, value in extra.items()),
                 f"{elapsed // 60}:{elapsed % 60:02d}"]
        print("  ".join(parts), file=self.file, flush=True)
        return True
