"""OpenTelemetry tracing: a server span per request, with child spans ``queue`` (arrival until first
scheduled), ``prefill`` (until the first token) and ``decode`` (until the last token) for each sequence
the engine generated, exported over OTLP/HTTP (protobuf) in batches. A W3C ``traceparent`` header (or
gRPC metadata) makes the request span a child of the caller's span.

Sources: W3C Trace Context; the OpenTelemetry specification (trace API, OTLP/HTTP exporter).
"""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from inferd.gateway.config import TracingConfig
from inferd.gateway.context import RequestContext


class Tracing:
    """A tracer provider of its own (the global one is left alone) exporting to ``otlp_endpoint``."""

    def __init__(self, config: TracingConfig) -> None:
        exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint.rstrip("/") + "/v1/traces")
        self.provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=config.export_delay_ms))
        self.tracer = self.provider.get_tracer("inferd")
        self.propagator = TraceContextTextMapPropagator()

    def start(self, ctx: RequestContext, carrier: dict[str, str]):
        """The request's span, a child of the caller's ``traceparent`` if it sent one."""
        parent = self.propagator.extract(carrier)
        span = self.tracer.start_span(f"{ctx.method} {ctx.route}", context=parent, kind=SpanKind.SERVER)
        span.set_attribute("inferd.request_id", ctx.request_id)
        span.set_attribute("rpc.system" if ctx.protocol == "grpc" else "http.request.method",
                           "grpc" if ctx.protocol == "grpc" else ctx.method)
        return span

    def end(self, ctx: RequestContext, span) -> None:
        """Add the engine's queue / prefill / decode spans and end the request span."""
        to_ns = time.time_ns() - time.monotonic_ns()  # monotonic -> epoch
        parent = trace.set_span_in_context(span)
        for i, t in enumerate(ctx.engine_times):
            scheduled = t.scheduled if t.scheduled is not None else t.finished
            first = t.first_token if t.first_token is not None else t.finished
            for name, a, b in (("queue", t.arrival, scheduled), ("prefill", scheduled, first),
                               ("decode", first, t.finished)):
                child = self.tracer.start_span(name, context=parent, start_time=int(a * 1e9) + to_ns)
                child.set_attribute("inferd.sequence", i)
                child.end(end_time=int(b * 1e9) + to_ns)
        if ctx.principal is not None:
            span.set_attribute("inferd.tenant", ctx.principal.tenant)
        if ctx.model:
            span.set_attribute("gen_ai.request.model", ctx.model)
        span.set_attribute("gen_ai.usage.input_tokens", ctx.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", ctx.completion_tokens)
        if isinstance(ctx.status, int):
            span.set_attribute("http.response.status_code", ctx.status)
            if ctx.status >= 500:
                span.set_status(Status(StatusCode.ERROR))
        elif ctx.status is not None:
            span.set_attribute("rpc.grpc.status_code", str(ctx.status))
            if ctx.status != "OK":
                span.set_status(Status(StatusCode.ERROR))
        span.end()

    def shutdown(self) -> None:
        """Export what is left and stop."""
        self.provider.shutdown()
