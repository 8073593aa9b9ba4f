"""The HTTP/1.1 connection protocol: uvicorn's h11 protocol, with its answer to a request it cannot parse in the
server's JSON error shape.

A malformed request line or header, or a head still unfinished past h11's 16 KiB bound
(``max_incomplete_event_size``, which keeps one client from making the server buffer unbounded headers), never
reaches the app: uvicorn answers it itself, in plain text ("Invalid HTTP request received."). Here that answer
is a 400 with the same JSON body as every other error (OpenAI's ``{"error": {...}}``; the request's path is not
known, so KServe's shape cannot be chosen), and the connection is closed as before.
"""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from inferd.gateway.http import error_body

MALFORMED_MESSAGE = ("malformed HTTP request: it could not be parsed as HTTP/1.1 (request line, headers or body "
                     "framing), or its unfinished head passed 16 KiB")


class JSONErrorH11Protocol(H11Protocol):
    """uvicorn's ``H11Protocol`` (pass as ``uvicorn.Config(http=...)``) whose 400 for an unparsable request has
    a JSON body."""

    def send_400_response(self, msg: str) -> None:
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):  # the app has answered already: only close
            self.transport.close()
            return
        body = error_body("", 400, MALFORMED_MESSAGE, "invalid_request_error")
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
