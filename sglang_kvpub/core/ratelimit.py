"""Rate limits that keep bad peers and noisy failures bounded: HTTP token buckets, rate-limited warnings.

Engine-neutral (standard library only); the HTTP service, the fan-in, the dispatch feed and
the stream subscriber share these two classes.
"""

from __future__ import annotations

import logging
import time

__all__ = ["RateLimitedLog", "RateLimiter"]


class RateLimiter:
    """Token buckets per client key (the HTTP service keys by peer IP).

    ``rate`` tokens per second, up to ``burst``; ``allow`` takes one token.  At most
    ``max_clients`` buckets are kept (the least recently refilled go first), so a flood
    of source addresses cannot grow memory without bound.
    """

    def __init__(self, rate: float, burst: int, max_clients: int = 10_000) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate = rate
        self.burst = float(burst)
        self.max_clients = max_clients
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, last refill)
        self.refused = 0

    def allow(self, key: str, now: float) -> bool:
        tokens, last = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        allowed = tokens >= 1.0
        if allowed:
            tokens -= 1.0
        else:
            self.refused += 1
        self._buckets[key] = (tokens, now)  # re-inserted: dict order is recency order
        if len(self._buckets) > self.max_clients:
            del self._buckets[next(iter(self._buckets))]
        return allowed

    def __len__(self) -> int:
        return len(self._buckets)


class RateLimitedLog:
    """Warnings a flood of bad input cannot turn into a flood of log lines.

    Two cadences, per ``key``: with ``interval_s`` at most one line per interval, the
    suppressed ones counted into the next line; without it (``None``) the first ten
    occurrences, then every thousandth, each line numbered.
    """

    def __init__(self, logger: logging.Logger, interval_s: float | None = 10.0) -> None:
        self._log = logger
        self._interval = interval_s
        self._next: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self.counts: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: object) -> None:
        count = self.counts[key] = self.counts.get(key, 0) + 1
        if self._interval is None:
            if count <= 10 or count % 1000 == 0:
                self._log.warning(msg + " (occurrence %d)", *args, count)
            return
        now = time.monotonic()
        if now < self._next.get(key, 0.0):
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._next[key] = now + self._interval
        skipped = self._suppressed.pop(key, 0)
        suffix = f" ({skipped} similar suppressed)" if skipped else ""
        self._log.warning(msg + suffix, *args)
