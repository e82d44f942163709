"""What the gateway knows about one client request besides its body."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.admission.tenancy import Charge
from gateway.config import GatewaySettings
from gateway.record import RequestRecord
from gateway.streams import event_ids
from sluice.errors import InvalidRequest
from sluice.ids import random_hex

if TYPE_CHECKING:
    from starlette.requests import Request

    from gateway.streams.regenerate import Held

#: OpenAI's service tiers as priority classes (lower runs first, as in vLLM).
SERVICE_TIERS = {"priority": -10, "default": 0, "auto": 0, "flex": 10, "scale": -10}


@dataclass
class RequestContext:
    #: The client's X-Request-Id (or a fresh one): for logs and the response header only.
    request_id: str
    priority: int = 0
    #: ``time.monotonic()`` by which the whole request must be done (local to this process).
    deadline: float = field(default_factory=lambda: time.monotonic() + 600)
    disconnected: Callable[[], Awaitable[bool]] | None = None
    idempotency_key: str | None = None
    #: SHA-256 of the raw body, to tell a true retry from a key reused for another request.
    fingerprint: str = ""
    #: The raw body of a resumable request: another gateway may have to continue it.
    body: bytes = b""
    #: SSE ``Last-Event-ID`` of a client re-attaching to a resumable stream, as it sent it
    #: (None: not given, or not one of ours).
    last_event: str | None = None
    #: What such a client holds when its id says so: the stream can be generated again and
    #: checked against it should nobody else have it any more (gateway/streams/regenerate.py).
    held: Held | None = None
    #: Whose fair share of the queue this request draws on: the API key's id, or "-".
    tenant: str = "-"
    #: The request's work in tokens (prompt estimate + output budget, all generations):
    #: what its admission charges to the tenant's fair share of the queue, corrected with
    #: its real usage when its slots are released (gateway/admission/caps.py: queue_cost).
    cost: int = 1
    #: Server-made and unique: names leases and engine requests, so two clients sending
    #: the same X-Request-Id can never share a slot.
    internal_id: str = field(default_factory=random_hex)
    #: The caller's rate-limit charge (None when the gateway runs without API keys);
    #: settled once, through :meth:`take_charges`.
    charge: Charge | None = None
    #: The charge against the model name's own budget, if it has one; settled likewise.
    name_charge: Charge | None = None
    #: The session's routing key (gateway/admission/affinity.py), "" when it names none.
    session: str = ""
    #: Headers every answer to this request carries (rate limits, effective priority).
    headers: dict[str, str] = field(default_factory=dict)
    #: Workers whose connection broke while serving this request (see lost_a_worker).
    workers_lost: set[str] = field(default_factory=set)
    #: When each line that :meth:`first_to_say` let through was said (monotonic).
    said: dict[tuple[str, ...], float] = field(default_factory=dict)
    #: Usage, timings, access log, metrics and trace span of this request.
    record: RequestRecord = field(default=None)  # type: ignore[assignment]

    @property
    def last_event_id(self) -> int:
        """The number of the last event the client has (0: none)."""
        return event_ids.parse(self.last_event)[0]

    @property
    def last_event_tag(self) -> bytes | None:
        """The tag of that event's producer (gateway/streams/event_ids.py; None: unknown)."""
        return event_ids.parse(self.last_event)[1]

    def lost_a_worker(self, worker_id: str) -> bool:
        """Count a worker that broke off while serving this request (its connection died).
        False from the second worker on: a request that kills workers is not handed to a
        third (a query of death). One worker's death counts once, however many of the
        request's choices it served (it counted per choice: an ``n=4`` request whose two
        choices were on one killed worker was refused as a query of death, 41 of the 46 in
        the nemesis)."""
        self.workers_lost.add(worker_id)
        return len(self.workers_lost) < 2

    def first_to_say(self, *what: str) -> bool:
        """Whether a log line about ``what`` is this request's first within a second: the
        choices of an ``n > 1`` request that one fault hits together log it once (the
        nemesis: an ``n=16`` stream wrote each migration's line 16 times)."""
        now = time.monotonic()
        if now - self.said.get(what, -math.inf) < 1.0:
            return False
        self.said[what] = now
        return True

    def take_charges(self) -> list[Charge]:
        """The charges to settle (the key's, the model name's: gateway/admission/name_limits.py),
        exactly once: every later call gets none."""
        charges = [c for c in (self.charge, self.name_charge) if c is not None]
        self.charge = self.name_charge = None
        return charges

    def detach_from_client(self) -> None:
        """The generation now outlives this client (a resumable stream): stop watching it."""
        self.disconnected = None

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()


def headers_of(request: Request) -> dict[str, str]:
    """The request's headers as a plain dict (names in lower case, as ASGI gives them; a
    repeated header's first value, as Starlette's ``Headers.get``), made once per request.
    A completion reads a dozen headers, most of them absent: Starlette's ``Headers`` scans
    its list for each, about 1 µs a lookup, 13 µs a request (timeit; loadtest/peers/README.md)."""
    scope = request.scope
    headers: dict[str, str] | None = scope.get("sluice.headers")
    if headers is None:
        headers = scope["sluice.headers"] = {name.decode("latin-1"): value.decode("latin-1")
                                             for name, value in reversed(scope["headers"])}
    return headers


def resolve_priority(
    body_priority: int | None, service_tier: str | None, headers: Mapping[str, str], s: GatewaySettings,
    default: int | None = None,
) -> int:
    """Body ``priority``, else header ``X-Sluice-Priority``, else ``service_tier``, else
    ``default`` (the model name's); clamped."""
    priority = body_priority
    if priority is None and "x-sluice-priority" in headers:
        raw = headers["x-sluice-priority"]
        try:
            priority = int(raw)
        except ValueError:
            raise InvalidRequest(f"X-Sluice-Priority must be an integer, got {raw!r}") from None
    if priority is None and service_tier is not None:
        if service_tier not in SERVICE_TIERS:
            raise InvalidRequest(
                f"unknown service_tier {service_tier!r}; one of {sorted(SERVICE_TIERS)}",
                param="service_tier",
            )
        priority = SERVICE_TIERS[service_tier]
    if priority is None:
        priority = default
    return max(s.min_priority, min(s.max_priority, priority or 0))


def resolve_deadline(headers: Mapping[str, str], s: GatewaySettings) -> float:
    """Monotonic deadline from ``X-Sluice-Timeout-Ms`` (capped), else the configured default."""
    timeout_s = s.request_timeout_s
    raw = headers.get("x-sluice-timeout-ms")
    if raw is not None:
        try:
            timeout_s = int(raw) / 1000
        except ValueError:
            raise InvalidRequest(f"X-Sluice-Timeout-Ms must be an integer, got {raw!r}") from None
        if timeout_s <= 0:
            raise InvalidRequest("X-Sluice-Timeout-Ms must be positive")
        timeout_s = min(timeout_s, s.max_request_timeout_s)
    return time.monotonic() + timeout_s
