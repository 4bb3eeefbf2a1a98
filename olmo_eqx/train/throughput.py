"""Training tokens per second, measured so that asynchronous dispatch cannot fool it."""

import time
from typing import Optional


class Throughput:
    """Tokens/s over windows between *boundaries*: steps whose metrics are fetched at once.

    Every step counted in a window was dispatched after the window began, so the rate is
    right whether the backend runs steps asynchronously (accelerators) or inside the
    dispatch call (often on CPU). The first boundary only opens a window (it includes
    compilation); `pause` restarts the clock (evaluation is not training throughput).
    """

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.step: Optional[int] = None
        self.time = 0.0
        self.tokens, self.seconds = 0, 0.0

    def boundary(self, step: int) -> Optional[float]:
        """Close the window at `step` (its metrics just fetched); its tokens/s, or None for the first."""
        now, rate = time.perf_counter(), None
        if self.step is not None and step > self.step:
            tokens, seconds = (step - self.step) * self.tokens_per_step, now - self.time
            self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds
            rate = tokens / seconds
        self.step, self.time = step, now
        return rate

    def pause(self) -> None:
        self.time = time.perf_counter()

    @property
    def mean(self) -> Optional[float]:
        return self.tokens / self.seconds if self.seconds else None
