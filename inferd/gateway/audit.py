"""The audit log: one JSON line per request (HTTP request or gRPC call), written with the standard
logging module to a size-rotated file (``logging.handlers.RotatingFileHandler``).

Fields: ``time`` (ISO 8601, UTC), ``request_id``, ``tenant``, ``key_id``, ``protocol`` (http / grpc),
``method``, ``route`` (the path or the gRPC method), ``model``, ``status`` (HTTP status or gRPC code
name), ``prompt_tokens``, ``completion_tokens``, ``latency_s`` (seconds), ``client`` (address:port).
Prompt and output text (``prompt``, ``completion``) only with ``include_text: true``.
"""

from __future__ import annotations

import datetime
import json
import logging
import logging.handlers
import time

from inferd.gateway.config import AuditConfig
from inferd.gateway.context import RequestContext


class AuditLog:
    """Writes audit lines to ``config.file``.

    Raises:
        OSError: the file cannot be opened.
    """

    def __init__(self, config: AuditConfig) -> None:
        self.include_text = config.include_text
        self.logger = logging.getLogger(f"inferd.audit.{id(self)}")
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False  # never into the server log
        self.handler = logging.handlers.RotatingFileHandler(config.file, maxBytes=config.max_bytes,
                                                            backupCount=config.backup_count, encoding="utf-8")
        self.handler.setFormatter(logging.Formatter("%(message)s"))
        self.logger.addHandler(self.handler)

    def write(self, ctx: RequestContext) -> None:
        line = {
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "request_id": ctx.request_id, "tenant": ctx.principal.tenant if ctx.principal else None,
            "key_id": ctx.principal.key_id if ctx.principal else None, "protocol": ctx.protocol,
            "method": ctx.method, "route": ctx.route, "model": ctx.model, "status": ctx.status,
            "prompt_tokens": ctx.prompt_tokens, "completion_tokens": ctx.completion_tokens,
            "latency_s": round(time.monotonic() - ctx.start, 6), "client": ctx.client,
        }
        if self.include_text:
            line["prompt"] = ctx.prompt_text
            line["completion"] = ctx.completion_text
        self.logger.info(json.dumps(line, ensure_ascii=False))

    def close(self) -> None:
        self.logger.removeHandler(self.handler)
        self.handler.close()
