"""The gateway over HTTP: a pure ASGI middleware around the whole app (every route, present and
future), so streaming responses and client disconnects pass through untouched.

Per request: request id (``x-request-id``, echoed), authentication and the route's scope, priority,
deadline (``x-request-timeout`` seconds, or the configured default: past it the request is cancelled,
which aborts its engine requests and frees their KV blocks, and answers 504 — or, when a stream has
already started, ends it with an error event), rate-limit headers on every response, and at the end
token charging, the circuit breaker's outcome, the audit line and the trace. Refusals use the route's
error shape: ``{"error": "..."}`` under /v2 (KServe), OpenAI's elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import time

from inferd.gateway.context import RequestContext, current
from inferd.gateway.gateway import Gateway, GatewayError


def error_body(path: str, status: int, message: str, type_: str) -> bytes:
    """The error body of a route: KServe's under /v2, OpenAI's elsewhere."""
    if path.startswith("/v2"):
        return json.dumps({"error": message}).encode()
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": status}}).encode()


class GatewayMiddleware:
    """Pure ASGI middleware applying ``gateway`` to every HTTP request."""

    def __init__(self, app, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        gw = self.gateway
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        client = scope.get("client")
        ctx = RequestContext("http", scope["method"], scope["path"], f"{client[0]}:{client[1]}" if client else "-")
        gw.start(ctx, headers)
        token = current.set(ctx)
        state = {"started": False, "completed": False, "sse": False, "client_gone": False}

        async def watch_receive():
            message = await receive()
            if message["type"] == "http.disconnect":
                state["client_gone"] = True
            return message

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                state["started"] = True
                ctx.status = message["status"]
                state["sse"] = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                   for k, v in message.get("headers", []))
                extra = [(b"x-request-id", ctx.request_id.encode())] + gw.rate_headers(ctx)
                message = dict(message, headers=[*message.get("headers", []), *extra])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["completed"] = True
            await send(message)

        try:
            try:
                gw.begin(ctx, headers)
            except GatewayError as e:
                return await self._refuse(send_with_headers, scope["path"], e)
            try:
                timeout = None if ctx.deadline is None else max(0.0, ctx.deadline - time.monotonic())
                async with asyncio.timeout(timeout):
                    await self.app(scope, watch_receive, send_with_headers)
            except GatewayError as e:  # raised where the model is resolved: 403, 429, 503
                if state["started"]:
                    raise
                await self._refuse(send_with_headers, scope["path"], e)
            except TimeoutError:
                gw.rejected.labels("deadline").inc()
                await self._end(send_with_headers, scope["path"], state, ctx, GatewayError(
                    504, "the request did not finish within its deadline and was aborted", "timeout_error"))
            except asyncio.CancelledError:
                # The server is shutting down and the drain timeout ran out: the request is cut (its
                # engine requests were aborted by the cancellation); answer it rather than leave a traceback.
                await self._end(send_with_headers, scope["path"], state, ctx, GatewayError(
                    503, "the server is shutting down; the request was aborted", "service_unavailable"))
            except Exception:
                ctx.status = 500
                raise
            if state["started"] and not state["completed"] and state["client_gone"]:
                ctx.status = 499  # the client went away mid-response
        finally:
            current.reset(token)
            gw.finish(ctx)

    async def _end(self, send, path: str, state: dict, ctx: RequestContext, e: GatewayError) -> None:
        """Answer ``e``, or end a response already under way (an SSE stream gets ``e`` as its last event)."""
        if not state["started"]:
            return await self._refuse(send, path, e)
        ctx.status = 499 if state["client_gone"] else e.status
        if state["completed"] or state["client_gone"]:
            return
        tail = b""
        if state["sse"]:
            err = {"error": {"message": e.message, "type": e.type, "param": None, "code": e.status}}
            tail = f"data: {json.dumps(err)}\n\n".encode()
        try:
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        except Exception:  # noqa: BLE001 - the connection is already gone
            pass

    @staticmethod
    async def _refuse(send, path: str, e: GatewayError) -> None:
        body = error_body(path, e.status, e.message, e.type)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.encode(), v.encode()) for k, v in e.headers.items()]
        if e.status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="inferd"'))
        await send({"type": "http.response.start", "status": e.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
