"""CircuitBreaker: stop calling a dead Redis, retry it now and then, log state changes once.

closed --failure--> open (calls skipped for `cooldown_s`) --cooldown over--> one trial call
  trial succeeds -> closed (logged once: "reachable again"); trial fails -> open again.
Thread-safe enough for counters: the worst race is one extra trial call.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger("llmserve.cache")


@dataclass(slots=True)
class CircuitBreaker:
    name: str
    cooldown_s: float = 1.0
    open_until: float = 0.0
    is_open: bool = False
    errors: int = 0
    clock: object = field(default=time.monotonic, repr=False)

    def allow(self) -> bool:
        return not self.is_open or self.clock() >= self.open_until  # type: ignore[operator]

    def success(self) -> None:
        if self.is_open:
            self.is_open = False
            logger.warning("%s: Redis is reachable again", self.name)

    def failure(self, error: BaseException) -> None:
        self.errors += 1
        if not self.is_open:
            logger.warning("%s: Redis unavailable (%s); serving without it, retrying every %.0f s", self.name, error, self.cooldown_s)
        self.is_open = True
        self.open_until = self.clock() + self.cooldown_s  # type: ignore[operator]
