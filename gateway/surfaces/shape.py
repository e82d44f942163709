"""The seam between the relay and a surface that renders a chat completion its own way.

The Responses and Messages surfaces are chat completions underneath: the relay runs the
chat request and hands each worker line to the surface's :class:`TypedEvents` (streamed)
or the whole answer to :meth:`Shape.json_body`, and the surface writes its own wire shape.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol


class TypedEvents(Protocol):
    """One streamed answer's SSE events, built as worker lines arrive (each already framed)."""

    def start(self) -> list[bytes]: ...

    def line(self, line: dict[str, Any]) -> list[bytes]: ...

    def finish(self, usage: dict[str, Any]) -> list[bytes]: ...


class Shape(Protocol):
    """One request's identity on a typed surface, and the request fields its answer echoes."""

    #: The surface's name (a resumable stream's plan records it).
    kind: Literal["responses", "messages"]

    def events(self) -> TypedEvents: ...

    def json_body(self, text: str, finish_reason: str | None, stop_sequence: str | None,
                  calls: list[dict[str, Any]], usage: dict[str, Any]) -> bytes:
        """The whole answer as one body (``stop_sequence``: the stop string that ended it)."""
        ...
