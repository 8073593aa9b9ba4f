"""The gateway: one object holding the pieces (authentication, rate limits, circuit breakers, audit
log, tracing, input guard) and the decisions both protocols share; :mod:`inferd.gateway.http` and
:mod:`inferd.gateway.grpc` apply them to every HTTP request and gRPC call."""

from __future__ import annotations

import logging
import math
import re

from prometheus_client import Counter

from inferd.gateway.auth import ANONYMOUS, AuthError, Authenticator, require_model, require_scope
from inferd.gateway.breaker import Breakers
from inferd.gateway.config import GatewayConfig, check_tls
from inferd.gateway.context import RequestContext
from inferd.gateway.guard import InputGuard
from inferd.gateway.ratelimit import RateLimited, RateLimits

logger = logging.getLogger("inferd.gateway")

TIMEOUT_HEADER = "x-request-timeout"
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_SECONDS = re.compile(r"^[0-9]{1,9}(\.[0-9]{1,9})?$")
_HEALTH_PATHS = frozenset({"/health", "/v2/health/live", "/v2/health/ready"})
_ADMIN_RPCS = frozenset({"RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload"})
_HEALTH_RPCS = frozenset({"ServerLive", "ServerReady"})


class GatewayError(Exception):
    """A request the gateway refuses: HTTP status, message, OpenAI error type and extra headers
    (Retry-After). The protocols render it in their own error shape (gRPC maps the status to a code)."""

    def __init__(self, status: int, message: str, type_: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.headers = {"retry-after": str(retry_after)} if retry_after is not None else {}


def _auth_error(e: AuthError) -> GatewayError:
    return GatewayError(e.status, e.message, "authentication_error" if e.status == 401 else "permission_error")


class Gateway:
    """Everything configured by one :class:`GatewayConfig`.

    Raises:
        ConfigError: (at construction) unreadable keys / secrets / JWKS, a bad storage URI or plugin.
        OSError: the audit file cannot be opened.
    """

    def __init__(self, config: GatewayConfig, registry) -> None:
        self.config = config
        check_tls(config.tls)
        self.auth = Authenticator(config)
        self.limits = RateLimits(config)
        self.breakers = Breakers(config.circuit_breaker.failure_threshold, config.circuit_breaker.reset_timeout_s,
                                 registry)
        self.guard = InputGuard(config.input_guard) if config.input_guard.rules or config.input_guard.plugins \
            else None
        self.audit = None
        if config.audit.file:
            from inferd.gateway.audit import AuditLog

            self.audit = AuditLog(config.audit)
        self.tracing = None
        if config.tracing.otlp_endpoint:
            from inferd.gateway.tracing import Tracing

            self.tracing = Tracing(config.tracing)
        self.rejected = Counter("inferd:gateway_rejected_requests", "Requests refused by the gateway, by reason",
                                ["reason"], registry=registry)

    # -- the request's start ---------------------------------------------------------------------------

    def start(self, ctx: RequestContext, headers: dict[str, str]) -> None:
        """Attach the request to this gateway: its id (the client's ``x-request-id`` when it is 1-128 of
        ``A-Za-z0-9._:-``) and its trace span. Never raises."""
        ctx.gateway = self
        ctx.keep_text = self.audit is not None and self.audit.include_text
        rid = headers.get("x-request-id")
        if rid is not None and _REQUEST_ID.match(rid):
            ctx.request_id = rid
        if self.tracing is not None:
            ctx.span = self.tracing.start(ctx, headers)

    def begin(self, ctx: RequestContext, headers: dict[str, str], default_timeout: bool = True) -> None:
        """Fill in the request's principal, priority and deadline from its headers (lower-case names),
        and check the route's scope (HTTP paths and gRPC method names). ``default_timeout``: apply
        ``request_timeout_s`` when the request sets no ``x-request-timeout``.

        Raises:
            GatewayError: 401 / 403, or 400 for a bad timeout header.
        """
        if ctx.protocol == "http" and ctx.route in self.auth.public_paths:
            ctx.principal = ANONYMOUS
        else:
            try:
                ctx.principal = self.auth.authenticate(headers.get("authorization"), headers.get("x-api-key"))
                scope = self._scope(ctx)
                if scope is not None:
                    require_scope(ctx.principal, scope)
            except AuthError as e:
                self.rejected.labels("unauthenticated" if e.status == 401 else "forbidden").inc()
                raise _auth_error(e) from None
        ctx.priority = self.config.tenant(ctx.principal.tenant).priority
        timeout = self.config.shedding.request_timeout_s if default_timeout else None
        raw = headers.get(TIMEOUT_HEADER)
        if raw is not None:
            timeout = float(raw) if _SECONDS.match(raw.strip()) else math.nan
            limit = self.config.shedding.max_request_timeout_s
            if not 0 < timeout <= limit:
                raise GatewayError(400, f"{TIMEOUT_HEADER}: must be a plain decimal number of seconds in "
                                        f"(0, {limit:g}]", "invalid_request_error")
        if timeout is not None:
            ctx.deadline = ctx.start + timeout

    def _scope(self, ctx: RequestContext) -> str | None:
        if ctx.protocol == "grpc":
            if ctx.route in _ADMIN_RPCS:
                return "admin"
            return None if ctx.route in _HEALTH_RPCS else "infer"
        if ctx.route == "/metrics":
            return "metrics"
        if ctx.route.startswith("/v2/repository"):
            return "admin"
        return None if ctx.route in _HEALTH_PATHS else "infer"

    # -- model resolution ------------------------------------------------------------------------------

    def authorize_model(self, ctx: RequestContext, model: str) -> None:
        """Raises: GatewayError: 403 when the credential is not granted ``model``."""
        try:
            require_model(ctx.principal, model)
        except AuthError as e:
            self.rejected.labels("forbidden").inc()
            raise _auth_error(e) from None

    def admit(self, ctx: RequestContext, model: str) -> None:
        """Let an inference request use ``model``: grant, rate limits, then the circuit breaker.

        Raises:
            GatewayError: 403 not granted, 429 over a limit, 503 the model's breaker is open.
        """
        self.authorize_model(ctx, model)
        ctx.model = model
        try:
            ctx.charged = self.limits.admit(ctx.principal.tenant, model)
        except RateLimited as e:
            self.rejected.labels("rate_limited").inc()
            raise GatewayError(429, str(e), "rate_limit_error", e.retry_after) from None
        br = self.breakers.get(model)
        if not br.allow():
            self.rejected.labels("circuit_open").inc()
            raise GatewayError(503, f"model {model!r} is failing: its circuit breaker is open; retry later",
                               "service_unavailable", br.retry_after())
        ctx.breaker_admitted = True

    def model_ready(self, model: str) -> bool:
        """False while ``model``'s circuit breaker is open."""
        return self.breakers.ready(model)

    def max_waiting(self, model: str) -> int | None:
        """The bound on ``model``'s waiting requests (None = unbounded)."""
        policy = self.config.models.get(model)
        if policy is not None and policy.max_waiting_requests is not None:
            return policy.max_waiting_requests
        return self.config.shedding.max_waiting_requests

    def setup_engine(self, model: str, engine) -> None:
        """Give a newly loaded LLM engine its waiting bound and the input guard."""
        engine.max_waiting = self.max_waiting(model)
        engine.retry_after_s = self.config.shedding.retry_after_s
        engine.input_guard = self.guard

    # -- the request's end -----------------------------------------------------------------------------

    def shed(self, ctx: RequestContext) -> None:
        """A request refused by a waiting bound: give back the requests it took from the limits."""
        self.rejected.labels("shed").inc()
        self.limits.refund(ctx.charged)
        ctx.charged = []

    def finish(self, ctx: RequestContext) -> None:
        """Charge tokens, tell the breaker, write the audit line and end the trace (never raises)."""
        if ctx.finished:
            return
        ctx.finished = True
        try:
            if ctx.principal is not None:
                self.limits.charge(ctx.principal.tenant, ctx.model, ctx.prompt_tokens + ctx.completion_tokens)
            if ctx.breaker_admitted:
                self.breakers.get(ctx.model).record(ctx.outcome)
            if self.audit is not None:
                self.audit.write(ctx)
            if ctx.span is not None:
                self.tracing.end(ctx, ctx.span)
        except Exception:  # noqa: BLE001 - bookkeeping must not fail a request that was served
            logger.exception("gateway bookkeeping failed for request %s", ctx.request_id)

    def rate_headers(self, ctx: RequestContext) -> list[tuple[bytes, bytes]]:
        if ctx.principal is None:
            return []
        return self.limits.headers(ctx.principal.tenant, ctx.model)

    def close(self) -> None:
        if self.tracing is not None:
            self.tracing.shutdown()
        if self.audit is not None:
            self.audit.close()
