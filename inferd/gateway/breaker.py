"""Circuit breaker per model (Nygard, "Release It!", ch. 5; the closed / open / half-open machine).

Closed: requests pass; ``failure_threshold`` backend failures in a row open it. Open: requests get a 503
at once, with Retry-After, for ``reset_timeout_s``; then it is half-open: one request passes as a probe
(the others still get 503) and its outcome closes or re-opens it. Client errors (4xx) count as neither.
The state is the gauge ``inferd:circuit_breaker_state`` (0 closed, 1 open, 2 half-open), and a model
whose breaker is open is not ready (KServe model readiness).
"""

from __future__ import annotations

import math
import time

from prometheus_client import Gauge

CLOSED, OPEN, HALF_OPEN = 0, 1, 2
STATE_NAMES = {CLOSED: "closed", OPEN: "open", HALF_OPEN: "half-open"}


class CircuitBreaker:
    """One model's breaker. Used from the event loop only (not thread-safe)."""

    def __init__(self, failure_threshold: int, reset_timeout_s: float, on_change=None) -> None:
        self.failure_threshold = failure_threshold
        self.reset_timeout_s = reset_timeout_s
        self.state = CLOSED
        self.failures = 0
        self.opened_at = 0.0
        self.probing = False
        self._on_change = on_change

    def _set(self, state: int) -> None:
        self.state = state
        if self._on_change is not None:
            self._on_change(state)

    def allow(self) -> bool:
        """Whether a request may reach the backend now (a half-open breaker lets one probe through)."""
        if self.failure_threshold == 0 or self.state == CLOSED:
            return True
        if self.state == OPEN and time.monotonic() - self.opened_at >= self.reset_timeout_s:
            self._set(HALF_OPEN)
        if self.state == HALF_OPEN and not self.probing:
            self.probing = True
            return True
        return False

    def retry_after(self) -> int:
        """Seconds until an open breaker lets a probe through (at least 1)."""
        return max(1, math.ceil(self.opened_at + self.reset_timeout_s - time.monotonic()))

    def record(self, outcome: str | None) -> None:
        """The outcome of a request let through: ``ok``, ``failure``, or None (it did not tell: a client
        error, or it never reached the backend)."""
        if self.failure_threshold == 0:
            return
        probe, self.probing = self.probing, False
        if outcome == "ok":
            self.failures = 0
            if self.state != CLOSED:
                self._set(CLOSED)
        elif outcome == "failure":
            self.failures += 1
            if probe or self.state == HALF_OPEN or self.failures >= self.failure_threshold:
                self.opened_at = time.monotonic()
                self._set(OPEN)

    @property
    def ready(self) -> bool:
        """False while open and not yet due for a probe."""
        return self.state != OPEN or time.monotonic() - self.opened_at >= self.reset_timeout_s


class Breakers:
    """The breakers of all models, created on first use, with their state gauge."""

    def __init__(self, failure_threshold: int, reset_timeout_s: float, registry) -> None:
        self.failure_threshold = failure_threshold
        self.reset_timeout_s = reset_timeout_s
        self.gauge = Gauge("inferd:circuit_breaker_state", "Circuit breaker per model: 0 closed, 1 open, "
                           "2 half-open", ["model_name"], registry=registry)
        self._by_model: dict[str, CircuitBreaker] = {}

    def get(self, model: str) -> CircuitBreaker:
        br = self._by_model.get(model)
        if br is None:
            gauge = self.gauge.labels(model)
            gauge.set(CLOSED)
            br = CircuitBreaker(self.failure_threshold, self.reset_timeout_s, gauge.set)
            self._by_model[model] = br
        return br

    def ready(self, model: str) -> bool:
        br = self._by_model.get(model)
        return br is None or br.ready
