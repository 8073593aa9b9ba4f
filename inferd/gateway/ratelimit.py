"""Requests and tokens per minute, per tenant and per model, with the ``limits`` library.

Every limit is a fixed one-minute window (``limits``' FixedWindowRateLimiter) in the configured storage
(``memory://`` in process; ``redis://host:port`` shares the counters between replicas, with the
``redis`` package installed). A request is admitted when every request limit that applies has room
(it then takes one from each) and no token limit is used up; its prompt and generated tokens are
charged when it ends, so a long answer may overdraw the minute and the next request waits for the next
window. Headers follow OpenAI's: ``x-ratelimit-limit-requests``, ``-remaining-requests``,
``-reset-requests`` and the same for ``-tokens`` (the tightest limit that applies; reset in seconds).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from limits import RateLimitItemPerMinute
from limits.storage import storage_from_string
from limits.strategies import FixedWindowRateLimiter

from inferd.gateway.config import ConfigError, GatewayConfig


@dataclass
class RateLimited(Exception):
    """A limit is used up: which (``requests`` or ``tokens``), whose, and seconds until it resets."""

    kind: str
    scope: str
    retry_after: int

    def __str__(self) -> str:
        return f"rate limit reached: {self.kind} per minute for {self.scope}; retry in {self.retry_after} s"


class RateLimits:
    """The per-tenant and per-model limits of a :class:`GatewayConfig`.

    Raises:
        ConfigError: (at construction) an unusable storage URI.
    """

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        try:
            self.window = FixedWindowRateLimiter(storage_from_string(config.rate_limit_storage))
        except Exception as e:  # noqa: BLE001 - limits raises ConfigurationError, ImportError...
            raise ConfigError(f"rate_limit_storage {config.rate_limit_storage!r}: {e}") from None

    def _limits(self, tenant: str, model: str | None, kind: str) -> list[tuple[RateLimitItemPerMinute, tuple]]:
        attr = f"{kind}_per_minute"
        out = []
        amount = getattr(self.config.tenant(tenant), attr)
        if amount:
            out.append((RateLimitItemPerMinute(amount, namespace="inferd"), (kind, "tenant", tenant)))
        policy = self.config.models.get(model) if model else None
        amount = getattr(policy, attr) if policy else None
        if amount:
            out.append((RateLimitItemPerMinute(amount, namespace="inferd"), (kind, "model", model)))
        return out

    def _retry_after(self, item, key) -> int:
        reset = self.window.get_window_stats(item, *key).reset_time
        return max(1, math.ceil(reset - time.time()))

    def admit(self, tenant: str, model: str) -> list:
        """Take one request from each request limit of ``tenant`` and ``model``; returns what was taken,
        for :meth:`refund`.

        Raises:
            RateLimited: a request limit is reached or a token limit is used up (nothing is taken then).
        """
        for item, key in self._limits(tenant, model, "tokens"):
            if not self.window.test(item, *key):
                raise RateLimited("tokens", f"{key[1]} {key[2]!r}", self._retry_after(item, key))
        requests = self._limits(tenant, model, "requests")
        for item, key in requests:
            if not self.window.test(item, *key):
                raise RateLimited("requests", f"{key[1]} {key[2]!r}", self._retry_after(item, key))
        for item, key in requests:
            self.window.hit(item, *key)
        return requests

    def refund(self, taken: list) -> None:
        """Give back the requests :meth:`admit` took (the request was shed before it ran)."""
        for item, key in taken:
            self.window.storage.incr(item.key_for(*key), item.get_expiry(), amount=-1)

    def charge(self, tenant: str, model: str | None, tokens: int) -> None:
        """Charge a finished request's tokens (prompt + generated) to every token limit that applies."""
        if tokens > 0:
            for item, key in self._limits(tenant, model, "tokens"):
                self.window.hit(item, *key, cost=tokens)

    def headers(self, tenant: str, model: str | None) -> list[tuple[bytes, bytes]]:
        """OpenAI's rate-limit headers for the tightest request and token limits (none if unlimited)."""
        out = []
        now = time.time()
        for kind in ("requests", "tokens"):
            best = None
            for item, key in self._limits(tenant, model, kind):
                stats = self.window.get_window_stats(item, *key)
                reset = 0 if stats.remaining >= item.amount else max(0, math.ceil(stats.reset_time - now))
                if best is None or stats.remaining < best[1]:
                    best = (item.amount, stats.remaining, reset)
            if best is not None:
                out += [(f"x-ratelimit-limit-{kind}".encode(), str(best[0]).encode()),
                        (f"x-ratelimit-remaining-{kind}".encode(), str(best[1]).encode()),
                        (f"x-ratelimit-reset-{kind}".encode(), f"{best[2]}s".encode())]
        return out
