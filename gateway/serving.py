"""Serving one completion request: open upstream streams, relay them as SSE or one JSON body."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, Literal

import anyio
from redis.asyncio import Redis
from redis.exceptions import RedisError
from sse_starlette import EventSourceResponse
from starlette.responses import Response

from gateway.admission import ClientGone, as_sluice_error
from gateway.config import GatewaySettings
from gateway.context import RequestContext
from gateway.idempotency import Idempotency
from gateway.journal import JournalWriter, start_producer, stream_key
from gateway.journal_readers import JournalReaders
from gateway.logprobs import render as render_logprobs
from gateway.migration import Migrator
from gateway.protocol import (
    DONE,
    ChatCompletionRequest,
    ChunkWriter,
    CompletionRequest,
    completion_body,
    worker_payloads,
)
from gateway.record import RequestRecord
from gateway.tenancy import Tenancy
from gateway.upstream import Dispatcher, Line, Upstream
from sluice.errors import (
    Conflict,
    RouteNotFound,
    SluiceError,
    Unavailable,
    error_event,
)

log = logging.getLogger("sluice.gateway")

Kind = Literal["chat", "text"]


class Serving:
    def __init__(
        self, settings: GatewaySettings, dispatcher: Dispatcher, idempotency: Idempotency, redis: Redis,
        tenancy: Tenancy, readers: JournalReaders,
    ) -> None:
        self._settings = settings
        self._tenancy = tenancy
        self._readers = readers
        self._dispatcher = dispatcher
        self._migrator = Migrator(settings, dispatcher)
        self._idempotency = idempotency
        self._redis = redis
        self._producers: set[asyncio.Task[None]] = set()
        self._unknown_logged: set[str] = set()

    async def serve(self, req: ChatCompletionRequest | CompletionRequest, ctx: RequestContext) -> Response:
        """A chat or text completion, as one JSON body or an SSE stream."""
        return await self._serve("chat" if isinstance(req, ChatCompletionRequest) else "text", req, ctx)

    def _note_unknown(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        for name in req.unknown_fields():
            if name not in self._unknown_logged:
                self._unknown_logged.add(name)
                log.info("ignoring unknown request field %r (logged once)", name)

    async def _serve(
        self,
        kind: Kind,
        req: ChatCompletionRequest | CompletionRequest,
        ctx: RequestContext,
    ) -> Response:
        self._note_unknown(req)
        key = ctx.idempotency_key
        owned = False
        try:
            if key is not None:
                replay = await self._idempotency.claim(key, ctx.fingerprint, req.stream, ctx.deadline)
                if replay is not None:
                    # Nothing is generated for this caller: refund its charge, close its record.
                    await self._settle_usage(ctx, 0)
                    ctx.record.finish("ok")
                    if replay == "attach":
                        return await self.reattach(key, ctx.last_event_id)
                    return replay
                owned = True
                await self._redis.delete(stream_key(key))  # an earlier failed attempt's journal
            return await self._generate(kind, req, ctx)
        except BaseException:
            with anyio.CancelScope(shield=True):
                if owned and key is not None:
                    await self._idempotency.forget(key)
                await self._settle_usage(ctx, 0)
            raise

    async def _generate(
        self, kind: Kind, req: ChatCompletionRequest | CompletionRequest, ctx: RequestContext
    ) -> Response:
        record = ctx.record
        headers = {"x-request-id": ctx.request_id, **ctx.headers}
        payloads = worker_payloads(req, ctx.internal_id)
        upstreams = await self._open_all(req, payloads, ctx)
        headers["x-sluice-queue-ms"] = str(round(record.queue_wait_s * 1000))
        lines = self._migrator.lines(req.model, upstreams, payloads, ctx)

        async def abandon() -> None:
            """Clean-up when the stream generator never ran (client gone at once, Redis failed)."""
            await self._end_stream(upstreams, record, ctx, ClientGone("the stream ended before it began"), False)

        if req.stream:
            events = self._sse(kind, req, upstreams, lines, record, ctx)
            if ctx.idempotency_key is not None:
                # Resumable: the generation feeds the journal, independent of this client
                # (a migration must not give up because the first reader left), and this
                # client is its first reader.
                ctx.detach_from_client()
                writer = JournalWriter(self._redis, ctx.idempotency_key, ttl_s=self._settings.idempotency_ttl_s)
                first = writer.subscribe(self._readers.tail)  # events as produced, not as flushed
                task = await start_producer(writer, events, abandon)
                self._producers.add(task)
                task.add_done_callback(self._producers.discard)
                return GuardedSSE(first.events(), first.close, ping=self._settings.sse_ping_s, headers=headers)
            return GuardedSSE(events, abandon, ping=self._settings.sse_ping_s, headers=headers)
        try:
            response = await self._collect(kind, req, upstreams, lines, record, headers, ctx)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await abandon()
            raise
        if ctx.idempotency_key is not None:
            await self._idempotency.complete(ctx.idempotency_key, ctx.fingerprint, False, bytes(response.body))
        return response

    async def _open_all(
        self, req: ChatCompletionRequest | CompletionRequest, payloads: list[dict[str, Any]],
        ctx: RequestContext,
    ) -> list[Upstream]:
        """One upstream per generation. Several generations are admitted all at once (one
        grant of ``len(payloads)`` slots), so two requests can never split the slots
        between them and wait for each other."""
        if len(payloads) == 1:
            return [await self._dispatcher.open(req.model, payloads[0], ctx, cost=ctx.cost)]
        leases = await self._dispatcher.admit(req.model, ctx.internal_id, ctx, need=len(payloads), cost=ctx.cost)
        results = await asyncio.gather(
            *(self._dispatcher.open(req.model, p, ctx, lease=lease) for p, lease in zip(payloads, leases, strict=True)),
            return_exceptions=True,
        )
        opened = [r for r in results if isinstance(r, Upstream)]
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            with anyio.CancelScope(shield=True):
                for upstream in opened:
                    await upstream.aclose()
                held = {u.lease.lease_id for u in opened}
                for lease in leases:  # a lease whose open never ran; releasing twice is harmless
                    if lease.lease_id not in held:
                        await self._dispatcher.release(lease)
            raise failure
        return opened

    async def _sse(
        self,
        kind: Kind,
        req: ChatCompletionRequest | CompletionRequest,
        upstreams: list[Upstream],
        lines: AsyncIterator[tuple[int, Line]],
        record: RequestRecord,
        ctx: RequestContext,
    ) -> AsyncIterator[bytes]:
        writer = ChunkWriter(kind, req.model)
        completed = False
        offsets: dict[int, int] = {}
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
                await self._end_stream(upstreams, record, ctx, outcome, completed)
        yield DONE

    async def reattach(self, key: str, after: int) -> Response:
        deadline = time.monotonic() + self._settings.queue_timeout_s + self._settings.ttft_timeout_s
        while True:
            record = await self._idempotency.lookup(key)
            if record is None:
                raise RouteNotFound(f"no resumable stream for Idempotency-Key {key!r}")
            if not record.get("stream"):
                raise Conflict("this Idempotency-Key belongs to a non-streaming request")
            if await self._redis.exists(stream_key(key)):
                break
            if record.get("state") == "done" or time.monotonic() > deadline:
                raise RouteNotFound(f"the stream for Idempotency-Key {key!r} is no longer kept")
            await asyncio.sleep(0.05)  # its first request is still being admitted
        return EventSourceResponse(
            self._readers.tail(key, after), ping=self._settings.sse_ping_s
        )

    async def _end_stream(
        self, upstreams: list[Upstream], record: RequestRecord, ctx: RequestContext,
        outcome: str | SluiceError, completed: bool,
    ) -> None:
        """Close upstreams, finish the record, settle key and charge. Safe to call twice."""
        for upstream in upstreams:
            await upstream.aclose()
        record.finish(outcome)
        if not ctx.stream_settled:
            ctx.stream_settled = True
            await self._settle_stream(ctx, completed)
        await self._settle_usage(ctx, record.prompt_tokens + record.completion_tokens)

    async def _settle_usage(self, ctx: RequestContext, used_tokens: int) -> None:
        """Correct the key's TPM charge with what the request really used; once."""
        charge = ctx.take_charge()
        if charge is None:
            return
        try:
            await self._tenancy.settle(charge, used_tokens)
        except (RedisError, OSError) as exc:
            log.warning("could not settle the rate-limit charge of %s: %s", ctx.request_id, exc)

    async def _settle_stream(self, ctx: RequestContext, completed: bool) -> None:
        if ctx.idempotency_key is None:
            return
        try:
            if completed:
                await self._idempotency.complete(ctx.idempotency_key, ctx.fingerprint, True, None)
            else:
                await self._idempotency.forget(ctx.idempotency_key)
        except (RedisError, OSError) as exc:
            log.warning("could not settle Idempotency-Key %s: %s", ctx.idempotency_key, exc)

    async def _collect(
        self,
        kind: Kind,
        req: ChatCompletionRequest | CompletionRequest,
        upstreams: list[Upstream],
        lines: AsyncIterator[tuple[int, Line]],
        record: RequestRecord,
        headers: dict[str, str],
        ctx: RequestContext,
    ) -> Response:
        texts = [""] * len(upstreams)
        finishes: list[str | None] = [None] * len(upstreams)
        entries: list[list[list[object]]] = [[] for _ in upstreams]

        async def gather() -> None:
            async for index, line in lines:
                record.add(index, line)
                texts[index] += line.get("text", "")
                finishes[index] = line.get("finish_reason") or finishes[index]
                entries[index].extend(line.get("lp") or ())

        try:
            await _unless_disconnected(gather(), ctx.disconnected)
        except SluiceError as exc:
            record.finish(exc)
            raise
        except Exception as exc:
            record.finish(as_sluice_error(exc))
            raise
        finally:
            with anyio.CancelScope(shield=True):
                for upstream in upstreams:
                    await upstream.aclose()
                record.finish()
                await self._settle_usage(ctx, record.prompt_tokens + record.completion_tokens)
        wants = req.logprobs_count() is not None
        choices = [
            (text, finish, render_logprobs(kind, lp) if wants else None)
            for text, finish, lp in zip(texts, finishes, entries, strict=False)
        ]
        body = completion_body(kind, req.model, choices, record.usage())
        return Response(body, media_type="application/json", headers=headers)


class GuardedSSE(EventSourceResponse):
    """An SSE response whose clean-up runs however the response ends, even if its
    generator never started (sse-starlette closes only generators that ran)."""

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._cleanup = cleanup

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
