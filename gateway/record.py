"""One request's record: usage, timings, the access log line, metrics and its trace span.

Created when the request arrives, finished exactly once when it ends (success,
error, or client gone), wherever that happens.

Billing: the record's usage, in the access log line and in the settlement of the API
key's TPM charge, is what this attempt *served*, each generation once:

- a stream bills every token it sent its client, also when it then ended with an error
  (as OpenAI bills the delivered tokens of a failed stream); a resumable stream bills its
  journal, once, by the gateway that ends it (gateway/relay/serving.py, ``_Ending``); a
  re-attach bills nothing;
- a non-streaming request bills its body; one answered with an error served nothing and
  bills nothing (:meth:`RequestRecord.served_nothing`), whatever it generated first;
- so a client's retry after a failed attempt is billed its own answer, and the failed
  attempt what it delivered (nemesis seed 7: 20 non-streaming requests were billed the
  tokens of a 502/503 attempt their client never got).

One case no gateway can see: a resumable stream's producer ends and bills it, dies, and
Redis then loses the stream's record and journal (a FLUSHALL, a restart without
persistence); the client's re-sent POST has the stream generated again, from the account
in its ``Last-Event-ID``, and the gateway that ends it bills it again (nemesis, Cluster:
nem-509, nem-3046). Nothing that lives in Redis or in the dead producer survives that, so
the fence is in the bill: such a stream's access line carries ``usage_id``, a name of the
generation (its key and the account of all its client has at the end,
gateway/streams/event_ids.py ``usage_id``), the same in both lines. **A meter charges
each ``usage_id`` once** (the line with the most tokens); a line without one is charged
as it is.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from gateway.metrics import Gaps, GatewayMetrics, priority_class
from gateway.surfaces.openai import usage_dict
from sluice.errors import SluiceError
from sluice.roles import DECODE, PREFILL

access = logging.getLogger("sluice.access")
tracer = trace.get_tracer("sluice.gateway")

#: Error codes that mean "turned away", for the rejection counter.
REJECTIONS = {"queue_full", "queue_timeout", "rate_limit_exceeded", "service_unavailable"}


@dataclass
class RequestRecord:
    request_id: str
    metrics: GatewayMetrics
    span: Span
    model: str = "-"
    #: The metrics' model label: "unknown" until admission has seen the model exist, so
    #: invented model names cannot add label values (series) to /metrics.
    model_label: str = "unknown"
    #: Choices per prompt: the prompt is billed once per prompt, not once per choice.
    n: int = 1
    priority: int = 0
    key_id: str = "-"
    started: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    queue_wait_s: float = 0.0
    retries: int = 0
    migrations: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    #: Workers whose streams the client got (each migration adds one).
    workers: list[str] = field(default_factory=list)
    #: Prefill/decode disaggregation: the workers that ran its prefill hops (gateway/relay/disagg.py).
    prefill_workers: list[str] = field(default_factory=list)
    #: Cache routing: leading prompt blocks the index expected on the chosen worker (last
    #: attempt), the prompt's blocks, and the tokens it expected cached vs the error.
    route_matched_blocks: int = 0
    route_prompt_blocks: int = 0
    route_expected_tokens: int = 0
    route_error_tokens: int = 0
    #: A resumable stream's generation, for its bill (see the module's billing rule).
    usage_id: str | None = None
    _last_line: float = 0.0
    _done: bool = False
    #: Whether any line carried token ids; a server that gives none (an ``openai``
    #: worker fronting a generic server) is counted from its usage lines instead.
    _ids_seen: bool = False
    #: The stream's inter-token gaps, for its model's histogram (made at the second line).
    _gaps: Gaps | None = None

    @classmethod
    def begin(cls, request_id: str, metrics: GatewayMetrics, parent: Context, route: str) -> RequestRecord:
        span = tracer.start_span(route, context=parent, kind=SpanKind.SERVER)
        span.set_attribute("sluice.request_id", request_id)
        metrics.in_flight.inc()
        return cls(request_id=request_id, metrics=metrics, span=span)

    def known_model(self) -> None:
        """Admission found the model: from now on it may be a metrics label."""
        self.model_label = self.model

    def describe(self, model: str, n: int, priority: int, key_id: str | None) -> None:
        self.model, self.n, self.priority, self.key_id = model, n, priority, key_id or "-"
        self.span.set_attributes({"gen_ai.request.model": model, "sluice.priority": priority,
                                  "sluice.key_id": self.key_id})

    def child(self, name: str, kind: SpanKind = SpanKind.INTERNAL) -> Span:
        """A span under the request's. With tracing off that is the request's own span, as
        OpenTelemetry's no-op tracer would return it, without building a context to ask it
        (a few µs a span, two spans a request); callers set attributes only on a span that
        records them."""
        if not self.span.is_recording():
            return self.span
        return tracer.start_span(name, context=trace.set_span_in_context(self.span), kind=kind)

    def queued(self, wait_s: float) -> None:
        """Time spent waiting for slots (summed over admissions: first, retries, migrations)."""
        self.queue_wait_s += wait_s

    def admitted(self, attempts: int, worker_id: str, matched_blocks: int = 0, prompt_blocks: int = 0,
                 role: str = "") -> None:
        """``role``: the hop of a disaggregated request this admission was, "" for a whole one."""
        self.retries += attempts - 1
        (self.prefill_workers if role == PREFILL else self.workers).append(worker_id)
        if role != DECODE:  # a decode hop is not routed on the prompt: its KV comes from the prefill hop
            self.route_matched_blocks, self.route_prompt_blocks = matched_blocks, prompt_blocks

    def route_checked(self, expected_tokens: int, error_tokens: int) -> None:
        """The router expected ``expected_tokens`` cached; the engine's report differed by
        ``error_tokens``."""
        self.route_expected_tokens += expected_tokens
        self.route_error_tokens += error_tokens

    def add(self, index: int, line: dict[str, Any]) -> None:
        now = time.monotonic()
        if self.first_token_s is None:
            self.first_token_s = now - self.started
            self.span.add_event("first_token")
        else:
            gaps = self._gaps
            if gaps is None or gaps.label != self.model_label:
                if gaps is not None:
                    gaps.flush()
                # One labels() lookup per request, not per chunk.
                gaps = self._gaps = Gaps(self.metrics.itl.labels(self.model_label), self.model_label)
            gaps.add(now - self._last_line)
            if self._done:
                gaps.flush()  # a line after the record's end (its gaps were added then)
        self._last_line = now
        ids = line.get("ids")
        if ids:
            self.completion_tokens += len(ids)
            self._ids_seen = True
        usage = line.get("usage")
        if usage and not self._ids_seen:
            self.completion_tokens += int(usage.get("completion_tokens", 0))
        if usage and index % self.n == 0:
            self.prompt_tokens += int(usage.get("prompt_tokens", 0))
            self.cached_tokens += int(usage.get("cached_tokens", 0))

    def migrated(self, worker_id: str) -> None:
        """A stream moved to ``worker_id`` (its admission, :meth:`admitted`, named it already)."""
        self.migrations += 1
        self.span.add_event("migration", {"sluice.worker_id": worker_id})

    def usage(self) -> dict[str, object]:
        return usage_dict(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def served_nothing(self) -> None:
        """No token of this attempt reached its client (an error answered it, or another
        gateway bills its stream): it bills none (see the module's billing rule)."""
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0

    def finish(self, status: str | SluiceError = "ok") -> None:
        """Log, count and close the span; only the first call counts."""
        if self._done:
            return
        self._done = True
        m, model = self.metrics, self.model_label
        total = time.monotonic() - self.started
        if isinstance(status, SluiceError):
            error: SluiceError | None = status
            status = str(status.status)
        else:
            error = None
        m.in_flight.dec()
        if self._gaps is not None:
            self._gaps.flush()
        series = m.series(model)  # its series exist from the model's first request on, at 0 (a priority class's queue wait: from its first)
        (series.ok if status == "ok" else m.requests.labels(model, status)).inc()
        if error is not None:
            m.errors.labels(model, error.type).inc()
            if error.code in REJECTIONS:
                m.rejections.labels(model, error.code).inc()
            self.span.set_status(Status(StatusCode.ERROR, error.message))
        if self.first_token_s is not None:
            series.ttft.observe(self.first_token_s)
        if self.workers or self.prefill_workers:
            series.waited(priority_class(self.priority)).observe(self.queue_wait_s)
        series.e2e.observe(total)
        for counter, amount in ((series.prompt_tokens, self.prompt_tokens),
                                (series.completion_tokens, self.completion_tokens),
                                (series.cached_tokens, self.cached_tokens),
                                (series.route_expected_tokens, self.route_expected_tokens),
                                (series.route_error_tokens, self.route_error_tokens),
                                (series.retries, self.retries), (series.migrations, self.migrations)):
            if amount:
                counter.inc(amount)
        self.span.set_attributes({
            "http.response.status_code": int(status) if status.isdigit() else 200,
            "sluice.status": status, "gen_ai.usage.input_tokens": self.prompt_tokens,
            "gen_ai.usage.output_tokens": self.completion_tokens, "sluice.migrations": self.migrations,
            "sluice.usage.cached_tokens": self.cached_tokens, "sluice.route.matched_blocks": self.route_matched_blocks,
            "sluice.route.prompt_blocks": self.route_prompt_blocks,
            "sluice.route.expected_cached_tokens": self.route_expected_tokens,
        })
        self.span.end()
        if not access.isEnabledFor(logging.INFO):
            return  # nobody reads the access line (a gateway logging at WARNING): not built
        fields = {
            "request_id": self.request_id, "model": model, "priority": self.priority, "key_id": self.key_id,
            "status": status, "queue_wait_ms": round(self.queue_wait_s * 1000, 1),
            "ttft_ms": None if self.first_token_s is None else round(self.first_token_s * 1000, 1),
            "total_ms": round(total * 1000, 1), "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens,
            "retries": self.retries, "migrations": self.migrations, "workers": ",".join(self.workers) or "-",
            **({"prefill_workers": ",".join(self.prefill_workers)} if self.prefill_workers else {}),
            "route_matched_blocks": self.route_matched_blocks, "route_prompt_blocks": self.route_prompt_blocks,
            "route_expected_cached": self.route_expected_tokens,
        }
        if error is not None:
            fields["error"] = error.code or error.type
        if self.usage_id is not None:
            fields["usage_id"] = self.usage_id
        access.info("access " + " ".join(f"{k}={v}" for k, v in fields.items()), extra={"fields": fields})
