"""OpenTelemetry set-up shared by gateway and worker.

Configured from the standard ``OTEL_*`` variables: with ``OTEL_EXPORTER_OTLP_ENDPOINT``
(or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) spans go to that collector over OTLP/HTTP;
``OTEL_SERVICE_NAME`` overrides the service name. ``SLUICE_TRACE_FILE`` also writes
every finished span as one JSON line (for tests and local debugging). With neither,
the tracer is OpenTelemetry's no-op and costs next to nothing.

Trace context travels as W3C ``traceparent`` headers: gateway -> worker (httpx
headers) -> engine (vLLM's ``trace_headers``).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)


class JsonLinesExporter(SpanExporter):
    """Appends each span as a JSON object per line."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for span in spans:
            ctx = span.get_span_context()
            lines.append(json.dumps({
                "name": span.name,
                "service": span.resource.attributes.get("service.name"),
                "trace_id": format(ctx.trace_id, "032x"),
                "span_id": format(ctx.span_id, "016x"),
                "parent_id": format(span.parent.span_id, "016x") if span.parent else None,
                "attributes": dict(span.attributes or {}),
                "events": [e.name for e in span.events],
                "start": span.start_time, "end": span.end_time,
            }, default=str))
        with self._lock, open(self._path, "a") as f:
            f.write("\n".join(lines) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def setup_tracing(default_service: str) -> TracerProvider | None:
    """Install a tracer provider if something will receive the spans; else leave the no-op."""
    otlp = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    trace_file = os.environ.get("SLUICE_TRACE_FILE")
    if not otlp and not trace_file:
        return None
    service = os.environ.get("OTEL_SERVICE_NAME", default_service)
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if otlp:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter,
        )

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if trace_file:
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(trace_file)))
    trace.set_tracer_provider(provider)
    return provider


def extract(headers: Mapping[str, str]) -> Context:
    """The trace context a request's headers carry. A request without any header the
    W3C propagators read (the common case) gets an empty context without copying its
    headers into a dict for them: that copy was most of this call's cost."""
    textmap = propagate.get_global_textmap()
    global _fields_of
    if _fields_of[0] is not textmap:
        _fields_of = (textmap, frozenset(textmap.fields))
    fields = _fields_of[1]
    if fields <= _W3C_FIELDS and not any(name in headers for name in fields):
        return Context()
    return propagate.extract(dict(headers))


#: What the default propagators (W3C trace context and baggage) read; another propagator
#: configured (``OTEL_PROPAGATORS``) always gets every header.
_W3C_FIELDS = frozenset({"traceparent", "tracestate", "baggage"})
#: The global propagator last seen and the header names it reads (its ``fields`` is a new
#: set per call for a composite one).
_fields_of: tuple[object, frozenset[str]] = (None, frozenset())


def inject(context: Context) -> dict[str, str]:
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier
