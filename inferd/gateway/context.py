"""What the gateway knows about the request being served, shared with the routes through a context
variable (set by the HTTP middleware and the gRPC interceptor, read where the model is resolved and
where tokens are counted)."""

from __future__ import annotations

import contextvars
import time
import uuid
from dataclasses import dataclass, field

from inferd.gateway.auth import Principal


@dataclass
class EngineTimes:
    """One generated sequence's timeline (``time.monotonic()`` seconds): queued at ``arrival``, first
    scheduled (prefill starts) at ``scheduled``, first token at ``first_token``, done at ``finished``."""

    arrival: float
    scheduled: float | None
    first_token: float | None
    finished: float


@dataclass
class RequestContext:
    """One request (an HTTP request or a gRPC call).

    Attributes:
        request_id: from the client's ``x-request-id`` when valid, else a fresh UUID.
        deadline: ``time.monotonic()`` after which the request is aborted, or None.
        model: the model it used, once resolved.
        prompt_tokens, completion_tokens: tokens counted for quotas and the audit log.
        outcome: ``ok`` / ``failure`` of the backend for the circuit breaker, None if it was not reached.
        prompt_text, completion_text: one entry per prompt / choice, kept only when the audit log
            includes text.
        shed: refused by the model's waiting bound (its request is given back to the rate limits).
        charged: the request limits it took one from, as ``(limit, key)`` pairs.
    """

    protocol: str
    method: str
    route: str
    client: str
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    principal: Principal | None = None  # None until authenticated (also when it failed)
    start: float = field(default_factory=time.monotonic)
    deadline: float | None = None
    model: str | None = None
    status: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    outcome: str | None = None
    engine_times: list[EngineTimes] = field(default_factory=list)
    prompt_text: list[str] | None = None
    completion_text: list[str] | None = None
    keep_text: bool = False
    priority: int = 0
    gateway: object = None  # the Gateway serving it
    breaker_admitted: bool = False
    span: object = None  # the OpenTelemetry span, when tracing
    finished: bool = False
    shed: bool = False
    charged: list = field(default_factory=list)


current: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar("inferd_request", default=None)


def record_usage(prompt_tokens: int, completion_tokens: int, prompt_text: list[str] | None = None,
                 completion_text: list[str] | None = None) -> None:
    """Add tokens (and, when the audit keeps text, the texts) to the current request, if any."""
    ctx = current.get()
    if ctx is None:
        return
    ctx.prompt_tokens += prompt_tokens
    ctx.completion_tokens += completion_tokens
    if ctx.keep_text:
        if prompt_text is not None:
            ctx.prompt_text = (ctx.prompt_text or []) + list(prompt_text)
        if completion_text is not None:
            ctx.completion_text = (ctx.completion_text or []) + list(completion_text)


def record_shed() -> None:
    """The current request was refused by a waiting bound (load shedding): it gives back what it took
    from the rate limits at once, so the 503's rate-limit headers are already right."""
    ctx = current.get()
    if ctx is not None and not ctx.shed:
        ctx.shed = True
        if ctx.gateway is not None:
            ctx.gateway.shed(ctx)


def record_outcome(ok: bool) -> None:
    """Tell the circuit breaker whether the backend served the current request (any failure sticks)."""
    ctx = current.get()
    if ctx is not None and ctx.outcome != "failure":
        ctx.outcome = "ok" if ok else "failure"


def record_engine_times(times: EngineTimes) -> None:
    ctx = current.get()
    if ctx is not None:
        ctx.engine_times.append(times)


def priority() -> int:
    """The current request's priority class (0 without a gateway context)."""
    ctx = current.get()
    return 0 if ctx is None else ctx.priority


def admit(model: str) -> None:
    """Let the current request use ``model`` for inference (grants, rate limits, circuit breaker); a
    no-op outside a gateway.

    Raises:
        GatewayError: 403, 429 or 503.
    """
    ctx = current.get()
    if ctx is not None and ctx.gateway is not None:
        ctx.gateway.admit(ctx, model)


def authorize_model(model: str) -> None:
    """Check that the current request may see ``model`` (metadata, readiness); no quota is used.

    Raises:
        GatewayError: 403.
    """
    ctx = current.get()
    if ctx is not None and ctx.gateway is not None:
        ctx.gateway.authorize_model(ctx, model)


def model_ready(model: str) -> bool:
    """False while ``model``'s circuit breaker is open (True outside a gateway)."""
    ctx = current.get()
    return ctx is None or ctx.gateway is None or ctx.gateway.model_ready(model)
