"""Rendering a completion for the client: SSE events as lines arrive, or one JSON body.

Per chunk, bytes come from templates (gateway/surfaces/openai.py), never from models.
Both renderers end the same way whatever happens (success, error, client gone):
their ``end`` callback (close upstreams, settle) runs once, to its end
(:func:`sluice.aftercare.to_the_end`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, Literal

import orjson
from starlette.responses import Response

from gateway.admission.queue import ClientGone, as_sluice_error
from gateway.record import RequestRecord
from gateway.relay.logprobs import RenderedLogprobs
from gateway.relay.logprobs import render as render_logprobs
from gateway.relay.upstream import Line, close_lines
from gateway.relay.whole_answers import WholeAnswers
from gateway.surfaces.openai import (
    DONE,
    ChatCompletionRequest,
    ChunkWriter,
    CompletionRequest,
    PiecedText,
    ToolCallAssembler,
    completion_body,
)
from gateway.surfaces.shape import Shape
from sluice.aftercare import to_the_end
from sluice.errors import SluiceError, Unavailable, error_event

log = logging.getLogger("sluice.gateway")

Kind = Literal["chat", "text", "responses", "messages"]
#: Surfaces with their own typed events (a :class:`Shape` renders them).
TYPED = ("responses", "messages")


async def sse_events(
    kind: Kind, req: ChatCompletionRequest | CompletionRequest, lines: AsyncIterator[tuple[int, Line]],
    record: RequestRecord, end: Callable[[str | SluiceError, bool], Awaitable[None]],
    writer: ChunkWriter | None = None, offsets: dict[int, int] | None = None, *,
    shape: Shape | None = None,
) -> AsyncIterator[bytes]:
    """The SSE bytes of a streamed completion, ending with ``[DONE]`` whatever happens;
    ``end(outcome, completed)`` runs once, shielded, when the lines stop. With a
    ``shape``: that surface's typed events (Responses, Messages) instead of chunks.

    A stream taken over from another gateway passes its ``writer`` (same id) and the
    characters each choice already sent (``offsets``: no second role chunk)."""
    writer = writer or ChunkWriter("text" if kind == "text" else "chat", req.model)
    response = None if shape is None else shape.events()
    completed = False
    offsets = dict(offsets or {})
    outcome: str | SluiceError = "ok"
    try:
        if response is not None:
            for event in response.start():
                yield event
        async for index, line in lines:
            record.add(index, line)
            if response is not None:
                for event in response.line(line):
                    yield event
                continue
            first = index not in offsets
            echo = line.get("echo", "")
            text = line.get("text", "")
            lp = line.get("lp")
            if not (first or text or echo or lp or line.get("tc") or line.get("finish_reason")):
                continue  # tokens that show nothing yet (a tool call's JSON being read): no empty chunk
            rendered = None if lp is None else render_logprobs(writer.kind, lp, offsets.get(index, 0) + len(echo))
            offsets[index] = offsets.get(index, 0) + len(echo) + len(text)
            yield writer.delta(index, echo + text, line.get("finish_reason"), first=first, logprobs=rendered,
                               tool_calls=line.get("tc"))
        if response is not None:
            for event in response.finish(record.usage()):
                yield event
        elif req.include_usage():
            yield writer.usage(record.usage())
        completed = True
    except SluiceError as exc:
        outcome = exc
        log.warning("request %s failed mid-stream: %s", record.request_id, exc.message)
        yield error_event(exc)
    except Exception as exc:  # e.g. Redis down during a migration: still end the stream cleanly
        log.warning("request %s failed mid-stream: %s: %s", record.request_id, type(exc).__name__, exc)
        outcome = Unavailable("the stream could not continue", retry_after_s=2)
        yield error_event(outcome)
    except BaseException:
        outcome = ClientGone("client disconnected mid-stream")
        raise
    finally:
        # closed at one of our yields: the choices stop before their upstreams close
        await to_the_end(_close_then(lines, lambda: end(outcome, completed)))
    yield DONE


async def _close_then(lines: AsyncIterator[tuple[int, Line]], end: Callable[[], Awaitable[None]]) -> None:
    await close_lines(lines)
    await end()


class DeliveredJSON(Response):
    """A whole JSON answer whose ``delivered()`` runs once its body was handed to the client's
    connection (or the handing failed), shielded: where a non-streaming answer is billed.
    Billed before, a gateway killed between its bill and its send left a bill for an answer
    its client never got, and the client's retry was billed again (the nemesis, Cluster: four
    requests billed twice); killed before the send now, the request is unbilled."""

    media_type = "application/json"

    def __init__(self, body: bytes, headers: dict[str, str], delivered: Callable[[], Awaitable[None]]) -> None:
        super().__init__(body, headers=headers)
        self._delivered = delivered

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await to_the_end(self._delivered())


async def json_response(
    kind: Kind, req: ChatCompletionRequest | CompletionRequest, lines: AsyncIterator[tuple[int, Line]],
    record: RequestRecord, headers: dict[str, str], disconnected: Callable[[], Awaitable[bool]] | None,
    choices: int, end: Callable[[], Awaitable[None]], delivered: Callable[[], Awaitable[None]],
    answers: WholeAnswers, shape: Shape | None = None,
) -> Response:
    """A whole completion as one JSON body; ``end()`` runs once, shielded, when the lines stop,
    and ``delivered()`` once the body was sent (:class:`DeliveredJSON`). A client that leaves
    meanwhile cancels the generation, and so does ``answers``' bound on what the process
    builds at once (gateway/relay/whole_answers.py): the answer's lines are counted as they
    arrive, its logprobs held as their JSON."""
    texts = [PiecedText() for _ in range(choices)]
    finishes: list[str | None] = [None] * choices
    stops: list[str | None] = [None] * choices  # the stop string that ended each, if one did
    wants = shape is None and req.logprobs_count() is not None
    logprobs = [RenderedLogprobs("text" if kind == "text" else "chat") for _ in range(choices)]
    calls = [ToolCallAssembler() for _ in range(choices)]
    answer = answers.open()

    async def gather() -> None:
        try:
            async for index, line in lines:
                record.add(index, line)
                text = line.get("echo", "") + line.get("text", "")
                size = 0
                if text:
                    size = len(text) if text.isascii() else len(text.encode())
                    texts[index].add(text)
                tc = line.get("tc")
                if tc:
                    calls[index].add(tc)
                    size += len(orjson.dumps(tc))
                finishes[index] = line.get("finish_reason") or finishes[index]
                stops[index] = line.get("stop_sequence") or stops[index]
                lp = line.get("lp")
                if lp and wants:
                    size += logprobs[index].add(lp)
                answer.add(size)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if answer.ended is not None and task is not None and task.uncancel() == 0:
                raise answer.ended from None  # the process's bound ended it (whole_answers.py)
            raise

    try:
        try:
            await _unless_disconnected(gather(), disconnected)
        except SluiceError as exc:
            record.served_nothing()  # the client gets an error, none of the tokens generated
            record.finish(exc)
            raise
        except Exception as exc:
            record.served_nothing()
            record.finish(as_sluice_error(exc))
            raise
        finally:
            answer.gathered()
            await to_the_end(_close_then(lines, end))
        if shape is not None:
            body = shape.json_body(texts[0].value(), finishes[0], stops[0], calls[0].calls(), record.usage())
            return DeliveredJSON(body, headers, delivered)
        rendered = [
            (text.value(), finish, lp.value() if wants else None, assembled.calls())
            for text, finish, lp, assembled in zip(texts, finishes, logprobs, calls, strict=True)
        ]
        body = completion_body("text" if kind == "text" else "chat", req.model, rendered, record.usage())
        return DeliveredJSON(body, headers, delivered)
    finally:
        answer.close()


async def _unless_disconnected(
    work: Coroutine[Any, Any, None], disconnected: Callable[[], Awaitable[bool]] | None
) -> None:
    """Run ``work`` in this task; if the client goes away first, cancel it (the engine then
    aborts). A watcher task looks for the client every half second; the work itself is not
    a task of its own: waiting on one cost two more turns of a busy event loop per request."""
    if disconnected is None:
        await work
        return
    task = asyncio.current_task()
    assert task is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        while True:
            await asyncio.sleep(0.5)
            if await disconnected():
                gone = True
                task.cancel()
                return

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        await work
    except asyncio.CancelledError:
        if gone and task.uncancel() == 0:
            raise ClientGone("client disconnected while its completion was generated") from None
        raise
    finally:
        watcher.cancel()  # in the step that ends the work: it cannot cancel anything after it
