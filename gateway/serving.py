"""Serving one completion request: open upstream streams, relay them as SSE or one JSON body."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from opentelemetry.context import Context
from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.responses import Response

from gateway.admission import ClientGone
from gateway.config import GatewaySettings
from gateway.context import RequestContext
from gateway.idempotency import Idempotency
from gateway.journal import (
    JournalCommitter,
    JournalWriter,
    start_producer,
    stream_key,
)
from gateway.journal_quota import JournalQuota, journal_events
from gateway.journal_readers import JournalReaders
from gateway.metrics import GatewayMetrics
from gateway.migration import Migrator
from gateway.protocol import (
    ChatCompletionRequest,
    ChunkWriter,
    CompletionRequest,
    worker_payloads,
)
from gateway.record import RequestRecord
from gateway.rendering import Kind, json_response, sse_events
from gateway.responses import ResponseShape
from gateway.sse import Keepalive, SSEResponse
from gateway.takeover import LineTap, Plan, recover
from gateway.tenancy import Tenancy
from gateway.upstream import Dispatcher, Line, Upstream
from sluice.errors import (
    Conflict,
    RouteNotFound,
    SluiceError,
)

log = logging.getLogger("sluice.gateway")



class Serving:
    def __init__(
        self, settings: GatewaySettings, dispatcher: Dispatcher, idempotency: Idempotency, redis: Redis,
        tenancy: Tenancy, readers: JournalReaders, metrics: GatewayMetrics,
    ) -> None:
        self._metrics = metrics
        self._committer = JournalCommitter(redis)  # writes every journal this process produces
        self._quota = JournalQuota(redis, settings)  # bounds their memory per API key and in total
        self._settings = settings
        self._tenancy = tenancy
        self._readers = readers
        self._dispatcher = dispatcher
        self._migrator = Migrator(settings, dispatcher)
        self._idempotency = idempotency
        self._redis = redis
        self._producers: set[asyncio.Task[None]] = set()
        self._keepalive = Keepalive(settings.sse_ping_s)

    async def close(self) -> None:
        await self._keepalive.close()
        await self._committer.close()

    async def serve(
        self, req: ChatCompletionRequest | CompletionRequest, ctx: RequestContext, shape: ResponseShape | None = None,
    ) -> Response:
        """A chat or text completion, as one JSON body or an SSE stream; with a ``shape``,
        a chat completion rendered as the Responses API's ``response``."""
        kind: Kind = "responses" if shape is not None else "chat" if isinstance(req, ChatCompletionRequest) else "text"
        return await self._serve(kind, req, ctx, shape)

    def _note_unknown(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        """One capped log line per request that carries fields we do not know."""
        names = req.unknown_fields()
        if names:
            shown = ", ".join(sorted(names)[:8])[:200]
            log.info("ignoring %d unknown request field(s): %s%s", len(names), shown, " ..." if len(names) > 8 else "")

    async def _serve(
        self,
        kind: Kind,
        req: ChatCompletionRequest | CompletionRequest,
        ctx: RequestContext,
        shape: ResponseShape | None,
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
            return await self._generate(kind, req, ctx, shape)
        except BaseException:
            with anyio.CancelScope(shield=True):
                if owned and key is not None:
                    await self._idempotency.forget(key)
                await self._settle_usage(ctx, 0)
            raise

    async def _generate(
        self, kind: Kind, req: ChatCompletionRequest | CompletionRequest, ctx: RequestContext,
        shape: ResponseShape | None,
    ) -> Response:
        record = ctx.record
        headers = {"x-request-id": ctx.request_id, **ctx.headers}
        payloads = worker_payloads(req, ctx.internal_id)
        upstreams: list[Upstream | None] = list(await self._open_all(req, payloads, ctx))
        headers["x-sluice-queue-ms"] = str(round(record.queue_wait_s * 1000))
        lines = self._migrator.lines(req.model, upstreams, payloads, ctx)

        async def abandon() -> None:
            """Clean-up when the stream generator never ran (client gone at once, Redis failed)."""
            await self._end_stream(upstreams, record, ctx, ClientGone("the stream ended before it began"), False)

        if req.stream:
            async def end(outcome: str | SluiceError, completed: bool) -> None:
                await self._end_stream(upstreams, record, ctx, outcome, completed)

            if ctx.idempotency_key is not None:
                return await self._produce(kind, req, ctx, upstreams, lines, end, abandon, headers, shape)
            events = sse_events(kind, req, lines, record, end, shape=shape)
            return SSEResponse(events, self._keepalive, abandon, headers)
        try:
            response = await json_response(kind, req, lines, record, headers, ctx.disconnected, len(upstreams),
                                           lambda: self._end_json(upstreams, ctx), shape)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await abandon()
            raise
        if ctx.idempotency_key is not None:
            await self._idempotency.complete(ctx.idempotency_key, ctx.fingerprint, False, bytes(response.body))
        return response

    async def _produce(
        self, kind: Kind, req: ChatCompletionRequest | CompletionRequest, ctx: RequestContext,
        upstreams: list[Upstream | None], lines: AsyncIterator[tuple[int, Line]],
        end: Callable[[str | SluiceError, bool], Awaitable[None]], abandon: Callable[[], Awaitable[None]],
        headers: dict[str, str], shape: ResponseShape | None,
    ) -> Response:
        """A resumable stream: the generation feeds the journal, independent of this client
        (a migration must not give up because the first reader left), and this client is
        its first reader. The plan lets another gateway continue it if this one dies."""
        assert ctx.idempotency_key is not None
        ctx.detach_from_client()
        chunks = ChunkWriter("text" if kind == "text" else "chat", req.model)
        plan = Plan(
            kind=kind, body=ctx.body.decode(), internal_id=ctx.internal_id, request_id=ctx.request_id,
            chunk_id=chunks.id, created=chunks.created, priority=ctx.priority, tenant=ctx.tenant, cost=ctx.cost,
            deadline_unix=time.time() + ctx.remaining_s(), fingerprint=ctx.fingerprint, choices=len(upstreams),
        )
        budget = None
        try:
            raw_plan = plan.dumps()
            budget = await self._quota.open(ctx.idempotency_key, ctx.tenant, len(raw_plan),
                                            hold_s=ctx.remaining_s() + self._settings.idempotency_ttl_s)
            writer = JournalWriter(
                self._committer, ctx.idempotency_key, ttl_s=self._settings.idempotency_ttl_s, owner=ctx.internal_id,
                max_events=journal_events(req, self._settings, typed=kind == "responses"), head=chunks.head,
                done_ttl_s=self._settings.journal_done_ttl_s, budget=budget, plan_bytes=len(raw_plan))
            if not await writer.claim(plan=raw_plan):  # an earlier attempt's producer still writes it
                raise Conflict("the stream with this Idempotency-Key is still being produced; re-attach with "
                               "GET /v1/streams/{Idempotency-Key}")
        except BaseException:
            with anyio.CancelScope(shield=True):
                await abandon()
                if budget is not None:
                    with contextlib.suppress(RedisError, OSError):
                        await budget.release()
            raise
        first = writer.subscribe(self._readers.tail)
        tap = LineTap(lines)
        events = sse_events(kind, req, tap.lines(), ctx.record, end, chunks, shape=shape)
        self._keep(await start_producer(writer, events, abandon, tap.take))
        return SSEResponse(first.events(), self._keepalive, first.close, headers)

    def _keep(self, producer: asyncio.Task[None]) -> None:
        self._producers.add(producer)
        producer.add_done_callback(self._producers.discard)

    async def take_over(self, key: str) -> bool:
        """Continue the resumable stream ``key`` whose producer is gone (gateway/takeover.py).
        True while some gateway produces it (this one now, or another that was faster);
        False when it cannot be continued."""
        owner = uuid.uuid4().hex
        claim = JournalWriter(self._committer, key, ttl_s=self._settings.idempotency_ttl_s, owner=owner)
        if not await claim.claim(take_over=True):
            return True
        try:
            found = await recover(self._redis, key)  # HistoryLost: not from a partial history
            if found is None or found[1].done or found[0].kind == "responses":
                # A Responses stream's typed events (item ids, sequence numbers) live only in the
                # dead gateway: it is journaled and re-attachable, but not continued elsewhere.
                await claim.release()
                return found is not None and found[1].done
            plan, state = found
            model = ChatCompletionRequest if plan.kind == "chat" else CompletionRequest
            req = model.model_validate_json(plan.body)
            budget = await self._quota.open(key, plan.tenant, 0, taken_over=state.stored_bytes + state.plan_bytes,
                                            hold_s=plan.deadline_unix - time.time() + self._settings.idempotency_ttl_s)
        except BaseException:
            await claim.release()
            raise
        chunks = ChunkWriter("chat" if plan.kind == "chat" else "text", req.model, id=plan.chunk_id,
                             created=plan.created)
        writer = JournalWriter(
            self._committer, key, ttl_s=self._settings.idempotency_ttl_s, owner=owner,
            max_events=journal_events(req, self._settings), head=chunks.head,
            done_ttl_s=self._settings.journal_done_ttl_s, budget=budget, stored_bytes=state.stored_bytes,
            plan_bytes=state.plan_bytes)
        kind: Kind = "chat" if plan.kind == "chat" else "text"
        record = RequestRecord.begin(plan.request_id, self._metrics, Context(), "takeover")
        record.describe(req.model, req.n, plan.priority, None if plan.tenant == "-" else plan.tenant)
        record.known_model()  # admitted once already
        record.completion_tokens, record.prompt_tokens = state.completion_tokens, state.prompt_tokens
        ctx = RequestContext(
            request_id=plan.request_id, priority=plan.priority, idempotency_key=key,
            deadline=time.monotonic() + max(0.0, plan.deadline_unix - time.time()),
            fingerprint=plan.fingerprint, tenant=plan.tenant, cost=plan.cost,
            internal_id=f"{plan.internal_id}-t{owner[:6]}", record=record,
        )
        log.info("request %s: taking over its resumable stream after event %d (%d choice(s) to continue)",
                 plan.request_id, state.last, len(state.progress))
        payloads = worker_payloads(req, ctx.internal_id)
        upstreams: list[Upstream | None] = [None] * len(payloads)
        tap = LineTap(self._migrator.lines(req.model, upstreams, payloads, ctx, state.progress))

        async def end(outcome: str | SluiceError, completed: bool) -> None:
            await self._end_stream(upstreams, record, ctx, outcome, completed)

        async def abandon() -> None:
            await end(ClientGone("the take-over ended before it began"), False)

        events = sse_events(kind, req, tap.lines(), record, end, chunks, state.offsets)
        writer.continue_after(state.last)
        self._keep(await start_producer(writer, events, abandon, tap.take))
        return True

    async def _open_all(
        self, req: ChatCompletionRequest | CompletionRequest, payloads: list[dict[str, Any]],
        ctx: RequestContext,
    ) -> list[Upstream]:
        """One upstream per generation. Several generations are admitted all at once (one
        grant of ``len(payloads)`` slots), so two requests can never split the slots
        between them and wait for each other."""
        if len(payloads) == 1:
            return [await self._dispatcher.open(req.model, payloads[0], ctx, cost=ctx.cost)]
        leases = await self._dispatcher.admit(req.model, ctx.internal_id, ctx, need=len(payloads), cost=ctx.cost,
                                              prefix=self._dispatcher.prefix_of(payloads[0]))
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
        return SSEResponse(self._readers.tail(key, after), self._keepalive)

    async def _end_stream(
        self, upstreams: list[Upstream | None], record: RequestRecord, ctx: RequestContext,
        outcome: str | SluiceError, completed: bool,
    ) -> None:
        """Close upstreams, finish the record, settle key and charge. Safe to call twice."""
        await _close(upstreams)
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

    async def _end_json(self, upstreams: list[Upstream | None], ctx: RequestContext) -> None:
        """A JSON answer's clean-up: close upstreams, finish the record, settle the charge."""
        await _close(upstreams)
        ctx.record.finish()
        await self._settle_usage(ctx, ctx.record.prompt_tokens + ctx.record.completion_tokens)


async def _close(upstreams: list[Upstream | None]) -> None:
    """Close every upstream opened so far (a take-over's choice may have none yet)."""
    for upstream in upstreams:
        if upstream is not None:
            await upstream.aclose()
