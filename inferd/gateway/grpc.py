"""The gateway over gRPC: a ``grpc.aio`` server interceptor wrapping every method of the service with
the same checks as HTTP. Credentials come from metadata (``authorization: Bearer ...`` or
``x-api-key``), the request id from ``x-request-id`` (sent back in the initial metadata), the deadline
from the call's own gRPC deadline or the configured default, whichever is sooner. Status mapping:
401 -> UNAUTHENTICATED, 403 -> PERMISSION_DENIED, 429 -> RESOURCE_EXHAUSTED, 503 -> UNAVAILABLE,
504 -> DEADLINE_EXCEEDED, 400 -> INVALID_ARGUMENT. One audit line per call (a ModelStreamInfer stream
is one call).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from inferd.gateway.context import RequestContext, current
from inferd.gateway.gateway import Gateway, GatewayError

CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
         403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
         429: grpc.StatusCode.RESOURCE_EXHAUSTED, 500: grpc.StatusCode.INTERNAL,
         503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}


class GatewayInterceptor(grpc.aio.ServerInterceptor):
    """Applies ``gateway`` to every RPC (unary and bidirectional-streaming methods)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        metadata = {k.lower(): v for k, v in (handler_call_details.invocation_metadata or ())
                    if isinstance(v, str)}
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                async with self._call(method, metadata, context) as ctx:
                    return await self._run(ctx, context, inner(request, context))

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer,
                                                       handler.response_serializer)
        if handler.stream_stream is not None:
            inner_stream = handler.stream_stream

            async def streaming(request_iterator, context):
                async with self._call(method, metadata, context, streaming=True) as ctx:
                    agen = inner_stream(request_iterator, context)
                    while True:
                        try:
                            item = await self._run(ctx, context, anext(agen))
                        except StopAsyncIteration:
                            return
                        yield item

            return grpc.stream_stream_rpc_method_handler(streaming, handler.request_deserializer,
                                                         handler.response_serializer)
        return handler

    @contextlib.asynccontextmanager
    async def _call(self, method: str, metadata: dict, context, streaming: bool = False):
        """The call's gateway context: checked on entry (aborts the call when refused), current while the
        method runs, finished (audit, quotas, trace) on exit. A stream is not held to the default
        per-request timeout (it may stay open between requests); its own gRPC deadline applies."""
        ctx = await self._begin(method, metadata, context, streaming)
        token = current.set(ctx)
        try:
            yield ctx
        except asyncio.CancelledError:  # the client cancelled, or its own deadline passed
            remaining = context.time_remaining()  # gRPC core's timer and ours may differ by a few ms
            ctx.status = "DEADLINE_EXCEEDED" if remaining is not None and remaining < 0.05 else "CANCELLED"
            raise
        finally:
            current.reset(token)
            self._finish(ctx, context)

    async def _begin(self, method: str, metadata: dict, context, streaming: bool) -> RequestContext:
        ctx = RequestContext("grpc", "POST", method, context.peer() or "-")
        self.gateway.start(ctx, metadata)
        try:
            self.gateway.begin(ctx, metadata, default_timeout=not streaming)
        except GatewayError as e:
            ctx.status = CODES.get(e.status, grpc.StatusCode.UNKNOWN).name
            self._finish(ctx, context)
            await context.abort(CODES[e.status], e.message)
        remaining = context.time_remaining()
        if remaining is not None:
            deadline = time.monotonic() + remaining
            ctx.deadline = deadline if ctx.deadline is None else min(ctx.deadline, deadline)
        await context.send_initial_metadata((("x-request-id", ctx.request_id),))
        return ctx

    async def _run(self, ctx: RequestContext, context, awaitable):
        timeout = None if ctx.deadline is None else max(0.0, ctx.deadline - time.monotonic())
        try:
            async with asyncio.timeout(timeout):
                return await awaitable
        except GatewayError as e:
            ctx.status = CODES.get(e.status, grpc.StatusCode.UNKNOWN).name
            await context.abort(CODES[e.status], e.message)
        except TimeoutError:
            self.gateway.rejected.labels("deadline").inc()
            ctx.status = grpc.StatusCode.DEADLINE_EXCEEDED.name
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                "the request did not finish within its deadline and was aborted")

    def _finish(self, ctx: RequestContext, context) -> None:
        if ctx.status is None:
            code = context.code() if hasattr(context, "code") else None
            ctx.status = code.name if isinstance(code, grpc.StatusCode) else "OK"
        self.gateway.finish(ctx)
