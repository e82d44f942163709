"""Rendering a completion for the client: SSE events as lines arrive, or one JSON body.

Per chunk, bytes come from templates (gateway/protocol.py), never from models.
Both renderers end the same way whatever happens (success, error, client gone):
their ``end`` callback (close upstreams, settle) runs once, shielded from cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, Literal

import anyio
from sse_starlette import EventSourceResponse
from starlette.responses import Response

from gateway.admission import ClientGone, as_sluice_error
from gateway.logprobs import render as render_logprobs
from gateway.protocol import (
    DONE,
    ChatCompletionRequest,
    ChunkWriter,
    CompletionRequest,
    completion_body,
)
from gateway.record import RequestRecord
from gateway.upstream import Line
from sluice.errors import SluiceError, Unavailable, error_event

log = logging.getLogger("sluice.gateway")

Kind = Literal["chat", "text"]


async def sse_events(
    kind: Kind, req: ChatCompletionRequest | CompletionRequest, lines: AsyncIterator[tuple[int, Line]],
    record: RequestRecord, end: Callable[[str | SluiceError, bool], Awaitable[None]],
    writer: ChunkWriter | None = None, offsets: dict[int, int] | None = None,
) -> AsyncIterator[bytes]:
    """The SSE bytes of a streamed completion, ending with ``[DONE]`` whatever happens;
    ``end(outcome, completed)`` runs once, shielded, when the lines stop.

    A stream taken over from another gateway passes its ``writer`` (same id) and the
    characters each choice already sent (``offsets``: no second role chunk)."""
    writer = writer or ChunkWriter(kind, req.model)
    completed = False
    offsets = dict(offsets or {})
    outcome: str | SluiceError = "ok"
    try:
        async for index, line in lines:
            record.add(index, line)
            first = index not in offsets
            text = line.get("text", "")
            lp = line.get("lp")
            rendered = None if lp is None else render_logprobs(kind, lp, offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + len(text)
            yield writer.delta(index, text, line.get("finish_reason"), first=first, logprobs=rendered)
        if req.include_usage():
            yield writer.usage(record.usage())
        completed = True
    except SluiceError as exc:
        outcome = exc
        log.warning("request %s failed mid-stream: %s", record.request_id, exc.message)
        yield error_event(exc)
    except Exception as exc:  # e.g. Redis down during a migration: still end the stream cleanly
        log.warning("request %s failed mid-stream: %r", record.request_id, exc)
        outcome = Unavailable("the stream could not continue", retry_after_s=2)
        yield error_event(outcome)
    except BaseException:
        outcome = ClientGone("client disconnected mid-stream")
        raise
    finally:
        with anyio.CancelScope(shield=True):
            await end(outcome, completed)
    yield DONE


async def json_response(
    kind: Kind, req: ChatCompletionRequest | CompletionRequest, lines: AsyncIterator[tuple[int, Line]],
    record: RequestRecord, headers: dict[str, str], disconnected: Callable[[], Awaitable[bool]] | None,
    choices: int, end: Callable[[], Awaitable[None]],
) -> Response:
    """A whole completion as one JSON body; ``end()`` runs once, shielded, when the lines stop.
    A client that leaves meanwhile cancels the generation."""
    texts = [""] * choices
    finishes: list[str | None] = [None] * choices
    entries: list[list[list[object]]] = [[] for _ in range(choices)]

    async def gather() -> None:
        async for index, line in lines:
            record.add(index, line)
            texts[index] += line.get("text", "")
            finishes[index] = line.get("finish_reason") or finishes[index]
            entries[index].extend(line.get("lp") or ())

    try:
        await _unless_disconnected(gather(), disconnected)
    except SluiceError as exc:
        record.finish(exc)
        raise
    except Exception as exc:
        record.finish(as_sluice_error(exc))
        raise
    finally:
        with anyio.CancelScope(shield=True):
            await end()
    wants = req.logprobs_count() is not None
    rendered = [
        (text, finish, render_logprobs(kind, lp) if wants else None)
        for text, finish, lp in zip(texts, finishes, entries, strict=True)
    ]
    body = completion_body(kind, req.model, rendered, record.usage())
    return Response(body, media_type="application/json", headers=headers)


class GuardedSSE(EventSourceResponse):
    """An SSE response whose clean-up runs however the response ends, even if its
    generator never started (sse-starlette closes only generators that ran)."""

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._cleanup = cleanup

    async def _send_with_timeout(self, send: Any, message: Any) -> None:
        # Per chunk: without a send timeout (ours never sets one) the base class still opens
        # and closes a cancel scope around every send; the profile of a saturated gateway put
        # that at ~5% of its CPU. Stalled clients are bounded by the stall/request deadlines.
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._cleanup()


async def _unless_disconnected(
    work: Coroutine[Any, Any, None], disconnected: Callable[[], Awaitable[bool]] | None
) -> None:
    """Run ``work``; if the client goes away first, cancel it (the engine then aborts)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if disconnected is not None and await disconnected():
                raise ClientGone("client disconnected while its completion was generated")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
