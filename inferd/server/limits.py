"""Guards on request bodies (HTTP).

A bound on their size, so that no client can make the server buffer an unbounded body in memory: a body whose
``Content-Length`` is over the limit is refused before it is read; a body sent without one (chunked) is counted
as it arrives and refused when it passes the limit. The answer is a 413 with the route's error shape (raised as
an ``HTTPException`` so the app's handlers format it).

And :func:`has_lone_surrogate`: JSON text whose strings hold a lone UTF-16 surrogate (``"\\ud800"`` without its
pair, or the bytes of one): Python's json decodes it, but it is no Unicode text (RFC 8259 section 8.2) and the
tokenizer, the response encoder and the gRPC/protobuf layer all refuse it later. And :func:`decode_error`: bytes
that are not text in the encoding JSON's first bytes announce (UTF-8, UTF-16 or UTF-32, as ``json.loads`` reads
them), named with their offset.
"""

from __future__ import annotations

import codecs
import json
import re

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


# Any surrogate escape (a pair too: an emoji as JSON encoders that escape non-ASCII write it), and the UTF-8-like
# bytes of a surrogate (ED A0-BF), which Python's json decodes too.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE_BYTES = re.compile(rb"\xed[\xa0-\xbf]")
LONE_SURROGATE_MESSAGE = ("the request body is not valid JSON text: a string in it holds a lone UTF-16 surrogate "
                          "(U+D800-U+DFFF)")


def has_lone_surrogate(body: bytes | bytearray) -> bool:
    """Whether JSON text ``body`` (UTF-8, or UTF-16/32 as ``json.loads`` detects them) decodes to a string holding a
    lone surrogate. A regular expression over the bytes clears UTF-8 bodies without any surrogate (nearly all);
    the others are decoded and encoded again (a C-speed pass: 8 ms for 2.4 MB of escaped pairs). False for a body
    that is no JSON at all (its route says so)."""
    if json.detect_encoding(body) == "utf-8" and not _SURROGATE_ESCAPE.search(body) \
            and not _SURROGATE_BYTES.search(body):
        return False
    try:
        json.dumps(json.loads(body), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    except (ValueError, RecursionError):
        pass
    return False


def json_codec(body: bytes | bytearray) -> tuple[str, int]:
    """The codec ``json.loads`` reads JSON bytes with (UTF-8, or the UTF-16 or UTF-32 that the first bytes announce by
    a byte order mark or the zero bytes of an ASCII character; RFC 8259 section 8.1, RFC 7159 section 8.1), and the
    length of a UTF-8 byte order mark to skip (0 or 3)."""
    codec = json.detect_encoding(body)
    return ("utf-8", len(codecs.BOM_UTF8)) if codec == "utf-8-sig" else (codec, 0)


def codec_name(codec: str) -> str:
    """A codec's standard name (IANA's charset names): ``utf-16-le`` -> ``UTF-16LE``."""
    return codec.upper().replace("-LE", "LE").replace("-BE", "BE")


def decode_message(e: UnicodeDecodeError, offset: int = 0, codec: str = "utf-8") -> str:
    """The 400 message for bytes that are not text in ``codec`` (:func:`json_codec`): the offset of the first bad byte
    in the body (``offset``: where the decoded bytes start in it), and that byte (UTF-8) or the bytes of the bad code
    unit (UTF-16, UTF-32)."""
    bad = f"0x{e.object[e.start]:02x}" if codec == "utf-8" else "bytes " + e.object[e.start:e.end].hex(" ")
    return f"the request body is not valid {codec_name(codec)} at byte offset {offset + e.start} ({bad}: {e.reason})"


def decode_error(body: bytes | bytearray) -> str | None:
    """Why JSON text ``body`` is not valid in the encoding ``json.loads`` reads it in (:func:`json_codec`), naming the
    first bad byte and its offset, or None if it decodes. Surrogates pass here as ``json.loads`` lets them pass
    (:func:`has_lone_surrogate` judges those)."""
    codec, bom = json_codec(body)
    try:
        codecs.decode(memoryview(body)[bom:], codec, "surrogatepass")  # no copy of the body
    except UnicodeDecodeError as e:
        return decode_message(e, bom, codec)
    return None
