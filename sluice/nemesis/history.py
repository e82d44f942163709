"""What a client saw: the history the checker judges. Nothing here interprets it.

One :class:`History` per logical request; one :class:`Attempt` per HTTP request it made
(first POST, retries, re-attaches with ``GET /v1/streams/{key}``, re-POSTs with the same
``Idempotency-Key``). Times are seconds since the run's start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ErrorSeen:
    """An error as the client got it: an HTTP status with a body, or an in-band SSE event."""

    status: int
    in_band: bool
    type: str | None
    code: str | None
    message: str

    @classmethod
    def from_body(cls, status: int, body: Any, in_band: bool) -> ErrorSeen:
        err = body.get("error") if isinstance(body, dict) else None
        if not isinstance(err, dict):
            return cls(status, in_band, None, None, f"not OpenAI-shaped: {str(body)[:200]}")
        return cls(status, in_band, err.get("type"), err.get("code"), str(err.get("message"))[:300])


@dataclass(slots=True)
class Chunk:
    """One choice's piece of one event (or of a JSON body)."""

    event_id: int | None
    chunk_id: str | None
    index: int
    text: str
    finish: str | None


@dataclass(slots=True)
class Attempt:
    how: str  # "post", "get" (re-attach), "repost" (same Idempotency-Key again)
    port: int
    started_s: float
    last_event_id: int = 0  # the Last-Event-ID it sent
    ended_s: float = 0.0
    status: int = 0  # 0: no response at all
    first_byte_s: float | None = None
    chunks: list[Chunk] = field(default_factory=list)
    #: Event ids in arrival order (resumable streams), data events only.
    event_ids: list[int] = field(default_factory=list)
    #: The last data event's id as sent (``N.tag``: what a re-attach sends back).
    last_id: str = ""
    errors: list[ErrorSeen] = field(default_factory=list)
    done: bool = False  # "data: [DONE]" seen
    usage: dict[str, Any] | None = None
    #: Transport failure: the exception's class name ("ConnectError", "RemoteProtocolError", ...).
    broke: str | None = None
    #: No byte for the client's read timeout: it gave up on this attempt.
    stalled: bool = False
    #: The client left on purpose (its plan, or a client_cut fault).
    left: str | None = None
    retry_after_s: float | None = None


@dataclass(slots=True)
class History:
    index: int
    started_s: float
    attempts: list[Attempt] = field(default_factory=list)
    ended_s: float = 0.0
    #: Still without an outcome past its deadline and the grace period.
    hung: bool = False
