"""A bound on the size of request bodies (HTTP), so that no client can make the server buffer an
unbounded body in memory.

A body whose ``Content-Length`` is over the limit is refused before it is read; a body sent without
one (chunked) is counted as it arrives and refused when it passes the limit. The answer is a 413 with
the route's error shape (raised as an ``HTTPException`` so the app's handlers format it).
"""

from __future__ import annotations

from starlette.exceptions import HTTPException

from inferd.gateway.http import error_body


class BodySizeLimit:
    """Pure ASGI middleware refusing request bodies over ``max_bytes`` (0 = no limit)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self) -> str:
        return f"the request body is larger than the server's limit of {self.max_bytes} bytes"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.max_bytes:
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(scope, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)

    async def _refuse(self, scope, send) -> None:
        data = error_body(scope["path"], 413, self._message(), "invalid_request_error")
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": data})
