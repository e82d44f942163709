"""Serving one completion request: open upstream streams, relay them as SSE or one JSON body."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from opentelemetry.context import Context
from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.responses import Response

from gateway.admission.queue import ClientGone, Lease
from gateway.admission.tenancy import Charge, Tenancy
from gateway.config import GatewaySettings
from gateway.context import RequestContext
from gateway.loss_watch import LossWatch
from gateway.metrics import GatewayMetrics
from gateway.record import RequestRecord
from gateway.relay.rendering import TYPED, Kind, json_response, sse_events
from gateway.relay.whole_answers import WholeAnswers
from gateway.relay.sse import Keepalive, SSEResponse
from gateway.relay.upstream import Dispatcher, Line, Upstream
from gateway.streams import event_ids
from gateway.streams.event_ids import DONE, usage_id
from gateway.streams.idempotency import Idempotency
from gateway.streams.producers import wait_for_producer_s
from gateway.streams.journal import (
    JournalCommitter,
    JournalLost,
    JournalWriter,
    now_ms,
    start_producer,
    stream_key,
)
from gateway.streams.journal_keeper import WRITE_BACK_S
from gateway.streams.journal_quota import JournalQuota, StreamBudget, journal_events
from gateway.streams.journal_readers import JournalReaders
from gateway.streams.journal_history import JournalHistory
from gateway.streams.migration import Migrator
from gateway.streams.regenerate import Held, chunk_id, digestible
from gateway.streams.takeover import RESEND_POST, HistoryLost, LineTap, Plan, Recovered, recover
from gateway.surfaces.openai import (
    ChatCompletionRequest,
    ChunkWriter,
    CompletionRequest,
    worker_payloads,
)
from gateway.surfaces.shape import Shape
from sluice import keys
from sluice.aftercare import detach, to_the_end
from sluice.errors import (
    Conflict,
    DeadlineExceeded,
    RouteNotFound,
    SluiceError,
    Unavailable,
    error_event,
)

log = logging.getLogger("sluice.gateway")



class Serving:
    def __init__(
        self, settings: GatewaySettings, dispatcher: Dispatcher, idempotency: Idempotency, redis: Redis,
        tenancy: Tenancy, readers: JournalReaders, metrics: GatewayMetrics, watch: LossWatch | None = None,
    ) -> None:
        self._metrics = metrics
        # Writes every journal this process produces, its events tagged with the process's name.
        self._committer = JournalCommitter(redis, watch, idempotency.producers.instance, runner=idempotency.runner,
                                           keep_bytes=settings.journal_keep_max_bytes)
        self._quota = JournalQuota(idempotency.runner, settings)  # bounds their memory per API key and in total
        self._settings = settings
        self._tenancy = tenancy
        self._readers = readers
        self._dispatcher = dispatcher
        self._migrator = Migrator(settings, dispatcher)
        self._idempotency = idempotency
        self._redis = redis
        #: Seconds since this process saw Redis lose writes (inf: never, or no watcher).
        self._since_loss_s = watch.since_loss_s if watch is not None else (lambda: math.inf)
        self._producers: set[asyncio.Task[None]] = set()
        #: Streams a take-over found without a plan, and since when (monotonic): see take_over.
        self._planless: dict[str, float] = {}
        self._keepalive = Keepalive(settings.sse_ping_s)
        #: Non-streaming answers being built, bounded per process (embeddings answers too).
        self.answers = WholeAnswers(settings.max_answer_bytes)

    async def close(self) -> None:
        await self._keepalive.close()
        await self._committer.close()
        await self._idempotency.close()  # (the connection the committer wrote on, last)

    async def serve(
        self, req: ChatCompletionRequest | CompletionRequest, ctx: RequestContext, shape: Shape | None = None,
    ) -> Response:
        """A chat or text completion, as one JSON body or an SSE stream; with a ``shape``,
        a chat completion rendered as that surface's answer (a ``response``, a ``message``)."""
        kind: Kind = shape.kind if shape is not None else "chat" if isinstance(req, ChatCompletionRequest) else "text"
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
        shape: Shape | None,
    ) -> Response:
        self._note_unknown(req)
        key = ctx.idempotency_key
        owned = False
        try:
            if key is not None:
                held = ctx.held if req.stream else None
                replay = await self._idempotency.claim(key, ctx.fingerprint, req.stream, ctx.deadline,
                                                       ctx.internal_id, ctx.last_event_id if req.stream else 0,
                                                       regenerate=held is not None, tag=ctx.last_event_tag)
                if replay == "regenerate":
                    owned = True
                    log.warning("request %s: Redis and its producer lost the stream whose event %d its client "
                                "holds; running it again from the start and checking it against the client's",
                                ctx.request_id, ctx.last_event_id)
                    return await self._generate(kind, req, ctx, shape, held)
                if replay is not None:
                    # Nothing is generated for this caller: refund its charge, close its record.
                    await self._settle_usage(ctx, 0)
                    ctx.record.finish("ok")
                    if replay == "attach":  # a POST: told to send again (503), never 404
                        return await self.reattach(key, ctx.last_event, retry=True, until=ctx.deadline)
                    return replay
                owned = True
            return await self._generate(kind, req, ctx, shape)
        except BaseException:
            # Failed before its stream began: a retry runs again, and nothing is billed. On
            # its own: the error goes out now, whatever Redis is doing (sluice/aftercare.py).
            detach(self._let_go(key if owned else None, ctx, ctx.take_charges()),
                   f"letting go of failed request {ctx.request_id}")
            raise

    async def _let_go(self, key: str | None, ctx: RequestContext, charges: list[Charge]) -> None:
        """A request that failed before its stream began: its Idempotency-Key (if it held one)
        is free again, its charges refunded."""
        if key is not None:
            await self._idempotency.settle(key, ctx.internal_id, completed=False)
        await self._tenancy.settle_all(charges, 0, ctx.request_id)

    async def _generate(
        self, kind: Kind, req: ChatCompletionRequest | CompletionRequest, ctx: RequestContext,
        shape: Shape | None, held: Held | None = None,
    ) -> Response:
        record = ctx.record
        headers = {"x-request-id": ctx.request_id, **ctx.headers}
        payloads = worker_payloads(req, ctx.internal_id, self._settings.whole_max_tokens)
        digest = digestible(payloads, shape is not None)
        if held is not None and not digest:  # (an id we never gave)
            raise HistoryLost(f"the stream this Last-Event-ID ({held.after}) belongs to is no longer known (Redis "
                              "lost it) and cannot be run again: send the request without Last-Event-ID")
        upstreams: list[Upstream | None] = list(await self._open_all(req, payloads, ctx))
        headers["x-sluice-queue-ms"] = str(round(record.queue_wait_s * 1000))
        lines = self._migrator.lines(req.model, upstreams, payloads, ctx)

        ended = False

        async def abandon() -> None:
            """Clean-up when the stream generator never ran (client gone at once, Redis failed)."""
            if not ended:  # it ran to its end, which did all of this (again, it changed nothing)
                await self._end_stream(upstreams, record, ctx, ClientGone("the stream ended before it began"))

        if req.stream:
            if ctx.idempotency_key is not None:
                return await self._produce(kind, req, ctx, upstreams, lines, abandon, headers, shape, digest, held)

            async def end(outcome: str | SluiceError, completed: bool) -> None:
                nonlocal ended
                await self._end_stream(upstreams, record, ctx, outcome)
                ended = True

            events = sse_events(kind, req, lines, record, end, shape=shape)
            return SSEResponse(events, self._keepalive, abandon, headers)
        try:
            response = await json_response(kind, req, lines, record, headers, ctx.disconnected, len(upstreams),
                                           lambda: _close(upstreams), lambda: self._bill_json(ctx), self.answers,
                                           shape)
        except BaseException:
            record.served_nothing()  # no body reached the client (a cancelled one too)
            await to_the_end(abandon())
            raise
        if ctx.idempotency_key is not None:
            await self._keep_answer(ctx, ctx.idempotency_key, bytes(response.body))
        return response

    async def _keep_answer(self, ctx: RequestContext, key: str, body: bytes) -> None:
        """A keyed non-streaming answer, kept in Redis for its retries once the journal quota
        holds its bytes (gateway/streams/journal_quota.py); past a bound it is sent but not
        kept: its key is forgotten, so a retry runs it again."""
        try:
            kept = await self._quota.keep(key, ctx.tenant, len(body), hold_s=self._settings.idempotency_ttl_s)
        except (RedisError, OSError):
            kept = True  # the settling meets Redis's failure too, and says so
        if kept:
            await self._idempotency.settle(key, ctx.internal_id, True, body)
            return
        log.warning("request %s: its answer (%d bytes) is not kept for Idempotency-Key %s: the journal memory of "
                    "its API key or of all is at its bound; a retry runs it again", ctx.request_id, len(body), key)
        await self._idempotency.settle(key, ctx.internal_id, False)

    async def _produce(
        self, kind: Kind, req: ChatCompletionRequest | CompletionRequest, ctx: RequestContext,
        upstreams: list[Upstream | None], lines: AsyncIterator[tuple[int, Line]],
        abandon: Callable[[], Awaitable[None]], headers: dict[str, str], shape: Shape | None,
        digest: int, held: Held | None,
    ) -> Response:
        """A resumable stream: the generation feeds the journal, independent of this client
        (a migration must not give up because the first reader left), and this client is
        its first reader. The plan lets another gateway continue it if this one dies.
        ``digest``: its choices, if its ids carry what the client has (else 0); ``held``: a stream generated again,
        whose client has events 1..``held.after`` (gateway/streams/regenerate.py)."""
        assert ctx.idempotency_key is not None
        ctx.detach_from_client()
        chunks = ChunkWriter("text" if kind == "text" else "chat", req.model,
                             id=chunk_id(kind, ctx.idempotency_key) if digest else None)
        plan = Plan(
            kind=kind, body=ctx.body.decode(), internal_id=ctx.internal_id, request_id=ctx.request_id,
            chunk_id=chunks.id, created=chunks.created, priority=ctx.priority, tenant=ctx.tenant, cost=ctx.cost,
            deadline_unix=time.time() + ctx.remaining_s(), fingerprint=ctx.fingerprint, choices=len(upstreams),
        )
        key, owner = ctx.idempotency_key, ctx.internal_id
        raw_plan = plan.dumps()
        # The stream begins with its journal's first write, in one round trip: the claim
        # becomes the key's stream (its plan stored), and its journal memory is reserved
        # (a 429 here: the caller, _serve, forgets the key).
        claimed = self._idempotency.hand_over(key, owner)  # its producer renews :live from here on
        budget = self._quota.budget(key, ctx.tenant, len(raw_plan), holder=owner,
                                    hold_s=ctx.remaining_s() + self._settings.idempotency_ttl_s)
        writer = JournalWriter(
            self._committer, key, ttl_s=self._settings.idempotency_ttl_s, owner=owner,
            max_events=journal_events(req, self._settings, typed=kind in TYPED), head=chunks.head,
            done_ttl_s=self._settings.journal_done_ttl_s, budget=budget, plan=raw_plan,
            fingerprint=ctx.fingerprint, claimed_ms=claimed,
            promotion_ttl_ms=self._idempotency.record_ttl_ms(ctx.remaining_s()))
        first = writer.subscribe(self._readers.tail)
        ending = _Ending(lambda: _close(upstreams), lambda outcome: self._end_stream(upstreams, ctx.record, ctx, outcome),
                         ctx.record, owner)
        if held is None:
            tap = LineTap(lines, digest=digest)
            events = sse_events(kind, req, tap.lines(), ctx.record, ending.end, chunks, shape=shape)
        else:
            writer.continue_after(held.after, JournalHistory(base=held.after), held.tag)
            tap = LineTap(held.rest(lines, [req.token_limit()] * digest), digest=digest,
                          chars=dict(enumerate(held.chars)))
            events = sse_events(kind, req, tap.lines(), ctx.record, ending.end, chunks, held.offsets())
        try:
            failure = await self._start_producer(writer, events, tap, ending)
        except BaseException:  # cancelled before its stream began
            await to_the_end(self._unstarted(key, owner, budget, ctx.record, abandon))
            raise
        if isinstance(failure, JournalLost):
            # This gateway stalled past its claim's TTL and a retry claimed the key: that one
            # generates it. This client follows it rather than a second generation.
            log.warning("request %s: lost its Idempotency-Key to a retry; following that one", ctx.request_id)
            with contextlib.suppress(RedisError, OSError):
                await budget.undo_opening()  # never the retry's reservation
            ctx.record.served_nothing()
            await self._end_stream(upstreams, ctx.record, ctx, "ok")  # served, by the retry's stream
            # A client re-sending its POST holds events 1..held.after of one history: it
            # follows from there, in that history only (nemesis, Sentinel: two streams
            # regenerated here lost their key to their own producer, back after Redis lost
            # its data, and their clients were sent that stream again from event 1).
            return await self.reattach(key, None if held is None else ctx.last_event, retry=True, until=ctx.deadline)
        if failure is not None:  # the quota's 429, or Redis failing: what its first write did goes
            await to_the_end(self._unstarted(key, owner, budget, ctx.record, abandon))
            raise failure
        return SSEResponse(first.events(), self._keepalive, first.close, headers)

    async def _unstarted(self, key: str, owner: str, budget: StreamBudget, record: RequestRecord,
                         abandon: Callable[[], Awaitable[None]]) -> None:
        """A resumable stream that did not begin: its start undone, nothing billed, its
        generation's clean-up run."""
        await self._undo_start(key, owner, budget)
        record.served_nothing()
        await abandon()

    async def _undo_start(self, key: str, owner: str, budget: StreamBudget) -> None:
        """Undo what a stream's first write did, or may have done, when the stream did not
        begin: its promotion and events (the key goes with them, while this request holds
        ``:live``), and its first reservation (only while it is still the key's)."""
        try:
            await self._idempotency.abandon_stream(key, owner)
            await budget.undo_opening()
        except (RedisError, OSError) as exc:
            log.warning("request %s: could not undo its stream's start: %s", key, exc)

    async def _start_producer(self, writer: JournalWriter, events: AsyncIterator[bytes], tap: LineTap,
                              ending: _Ending) -> BaseException | None:
        """Produce the stream; once it has begun (:meth:`JournalWriter.started`: None, else
        why not, and the producer has ended), and once its journal is written, bill it (see
        :class:`_Ending`) and its owner settles the key (done, or forgotten after a failure),
        if it still owns it: a producer that lost the stream to a take-over leaves the key
        to the gateway that produces it now."""
        producer = await start_producer(writer, events, ending.abandon, tap.take, tap.digest)
        self._keep(producer)
        try:
            failure = await writer.started()
        except BaseException:
            await to_the_end(_aborted(writer, producer))
            raise
        if failure is not None:
            await asyncio.wait([producer])  # its generation's clean-up has run
            return failure

        async def settle() -> None:
            drained = asyncio.ensure_future(writer.settled())
            await asyncio.wait([producer, drained], return_when=asyncio.FIRST_COMPLETED)
            drained.cancel()
            await ending.bill(writer.ended, usage_id(writer.key, tap.digest()))
            await asyncio.wait([producer])
            if producer.cancelled() or producer.exception() is not None or not writer.ended:
                # Lost to a take-over (JournalLost), or its journal failed or was cut short
                # (Redis unreachable past the drain): the key, and the plan, stay with the
                # journal, for a reader's take-over to continue (was: a generation that
                # completed marked the key done over a journal without its end, and a
                # re-attach got 404 "no longer kept").
                return
            if not await self._idempotency.settle(writer.key, ending.owner, ending.completed) and ending.completed:
                # Redis lost the record (or another owns it: then this writes nothing): write
                # it back done now, with the journal if that went too, rather than at the next
                # loss the keeper sees; a re-sent request would find the key free meanwhile.
                with contextlib.suppress(RedisError, OSError):
                    await self._committer.keeper.restore(writer.key)

        self._keep(asyncio.create_task(settle(), name="idempotency-settle"))
        return None

    def _keep(self, producer: asyncio.Task[None]) -> None:
        self._producers.add(producer)
        producer.add_done_callback(self._producers.discard)

    def produces(self, key: str) -> bool:
        """Whether this process produces the resumable stream ``key`` (its journal's writer runs here)."""
        return self._committer.produces(key)

    async def take_over(self, key: str, last_id: str = "0") -> bool:
        """Continue the resumable stream ``key`` whose producer is gone (gateway/streams/takeover.py).
        True while some gateway produces it (this one now, or another that was faster);
        False when it cannot be continued. ``last_id``: the id of the last event of the
        client following it that holds the most. A journal with fewer events (Redis lost the
        rest with the producer's copy) is not continued from, as a partial one is not: the
        stream is generated again, checked against the account in that id, if it has one."""
        holds = event_ids.parse(last_id)[0]
        owner = uuid.uuid4().hex
        claimed = now_ms()  # take_stream sets :live after this
        # Redis lost the plan with its data (a finished stream needs none: its journal ends
        # with [DONE]). Its producer may still run, stalled or cut off from Redis: it writes
        # the journal and the plan back once it can, unless a taker holds ``:live`` (nemesis,
        # Sentinel: 9 of 12 streams lost this way had a producer that came back a second
        # later and found its stream taken; a CI run: one that came back and met a reader's
        # claim of a moment, TAKE). So such a stream is not claimed, and its readers wait, as
        # a re-attach does, for as long as such a producer may take; then they are told (was:
        # "producer is gone"), and the key is forgotten, so a retry runs again. (Not ended
        # early by the producer's beat, gateway/streams/producers.py: with it, a loaded CI
        # run told the readers of a producer stopped 5 s across a FLUSHALL that their stream
        # was lost, tests/gateway/test_resumable_data_loss.py.)
        waited = self._waited_for_producer(key)
        took = await self._idempotency.take_stream(key, owner, planless=waited)
        if took == "planless":
            self._planless.setdefault(key, time.monotonic())
            return True
        if took == "held":
            return True
        try:
            found = await recover(self._redis, key)
            if found is not None and found[1].done:
                # Its producer journaled the end but died before settling the key.
                await self._idempotency.settle(key, owner, completed=True)
                return True
            if found is None and not waited:  # Redis lost the plan since TAKE found it
                self._planless.setdefault(key, time.monotonic())
                await self._committer.release(key, owner)
                return True
            self._planless.pop(key, None)
            if found is None:
                raise HistoryLost(f"the stream's plan is no longer in Redis (it lost data): it cannot be continued; "
                                  f"{RESEND_POST}")
            if found[0].kind in TYPED:
                # A Responses or Messages stream, whose typed events (item ids, sequence
                # numbers, open content blocks) lived only in the dead gateway: journaled and
                # re-attachable, not continued elsewhere. Its readers get an error; the key
                # is forgotten, so a retry runs again.
                await self._idempotency.settle(key, owner, completed=False)
                return False
            plan, state = found
            model = ChatCompletionRequest if plan.kind == "chat" else CompletionRequest
            req = model.model_validate_json(plan.body)
            internal_id = f"{plan.internal_id}-t{owner[:6]}"
            payloads = worker_payloads(req, internal_id)
            digest = digestible(payloads, False)
            if state.last < holds:
                # Continued from here, the stream would go on as another history than the one
                # its client holds 1..``holds`` of (nemesis, Sentinel: nem-1360, a journal of 2
                # events taken over while its client held 60). So it is generated again,
                # checked against what that client holds, as its re-sent POST would have it
                # (was: the client was told to re-send it, and one whose re-sent POST's
                # gateway died before its first event was told so again: nem-1188).
                again = Held.of(last_id) if digest else None
                if again is None:
                    raise HistoryLost(f"the stream's journal lacks events {state.last + 1}..{holds} that its client "
                                      f"holds (Redis lost data): it cannot be continued; {RESEND_POST}")
                await self._redis.delete(stream_key(key))  # what is left is of no use to anyone
                state = Recovered(last=again.after, plan=state.plan, tag=again.tag,
                                  history=JournalHistory(base=again.after), base=again.after)
            else:
                again = _held_by_journal(state, digest)  # a stream generated again: once more (takeover.py)
            budget = await self._quota.open(key, plan.tenant, 0, taken_over=state.stored_bytes + len(state.plan),
                                            hold_s=plan.deadline_unix - time.time() + self._settings.idempotency_ttl_s)
        except HistoryLost:  # never continued from a partial history; a retry runs again
            await self._idempotency.abandon_stream(key, owner)
            raise
        except BaseException:
            await self._committer.release(key, owner)
            raise
        chunks = ChunkWriter("chat" if plan.kind == "chat" else "text", req.model, id=plan.chunk_id,
                             created=plan.created)
        writer = JournalWriter(
            self._committer, key, ttl_s=self._settings.idempotency_ttl_s, owner=owner,
            max_events=journal_events(req, self._settings), head=chunks.head,
            done_ttl_s=self._settings.journal_done_ttl_s, budget=budget, stored_bytes=state.stored_bytes,
            plan=state.plan, fingerprint=plan.fingerprint, claimed_ms=claimed)
        kind: Kind = "chat" if plan.kind == "chat" else "text"
        record = RequestRecord.begin(plan.request_id, self._metrics, Context(), "takeover")
        record.describe(req.model, req.n, plan.priority, None if plan.tenant == "-" else plan.tenant)
        record.known_model()  # admitted once already
        if again is None:  # (generated again, its new generation's lines count every token)
            record.completion_tokens = state.completion_tokens
            record.prompt_tokens, record.cached_tokens = state.prompt_usage(req.n)
        ctx = RequestContext(
            request_id=plan.request_id, priority=plan.priority, idempotency_key=key,
            deadline=time.monotonic() + max(0.0, plan.deadline_unix - time.time()),
            fingerprint=plan.fingerprint, tenant=plan.tenant, cost=plan.cost, internal_id=internal_id, record=record,
        )
        # Billed once (see _Ending): if this gateway ends the stream, the tenant's TPM is
        # charged for all of it; the producer before it refunded its charge.
        with contextlib.suppress(RedisError, OSError):
            ctx.charge = await self._tenancy.charge_after(plan.tenant, ctx.internal_id)
        upstreams: list[Upstream | None] = [None] * len(payloads)
        if again is None:
            log.info("request %s: taking over its resumable stream after event %d (%d choice(s) to continue)",
                     plan.request_id, state.last, len(state.progress))
            # A regenerable stream's ids carry what its client has, from the journal's account on.
            tap = LineTap(self._migrator.lines(req.model, upstreams, payloads, ctx, state.progress),
                          digest=digest, ids=state.sent, chars=state.offsets)
            offsets = state.offsets
        else:
            log.info("request %s: taking over its resumable stream after event %d, generated again (its journal "
                     "starts at event %d): running it again, checked against what its client holds", plan.request_id,
                     state.last, state.base + 1)
            tap = LineTap(again.rest(self._migrator.lines(req.model, upstreams, payloads, ctx),
                                     [req.token_limit()] * digest),
                          digest=digest, chars=dict(enumerate(again.chars)))
            offsets = again.offsets()
        ending = _Ending(lambda: _close(upstreams), lambda outcome: self._end_stream(upstreams, record, ctx, outcome),
                         record, owner)
        events = sse_events(kind, req, tap.lines(), record, ending.end, chunks, offsets)
        writer.continue_after(state.last, state.history, state.tag)
        await self._start_producer(writer, events, tap, ending)
        return True

    def _waited_for_producer(self, key: str) -> bool:
        """Whether take-overs have found ``key``'s stream without its plan for
        ``wait_for_producer_s()`` (see ``take_over``)."""
        now = time.monotonic()
        window = wait_for_producer_s()
        for stale in [k for k, since in self._planless.items() if now - since > 2 * window]:
            del self._planless[stale]
        since = self._planless.get(key)
        return since is not None and now - since >= window

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
                                              prefix=await self._dispatcher.prefix_of(payloads[0]))
        for more in payloads[1:]:  # one prompt: its ids, when the gateway tokenized it, are every choice's
            more.update((k, payloads[0][k]) for k in ("gateway_prompt_ids", "gateway_tokenizer") if k in payloads[0])
        results = await asyncio.gather(
            *(self._dispatcher.open(req.model, p, ctx, lease=lease) for p, lease in zip(payloads, leases, strict=True)),
            return_exceptions=True,
        )
        opened = [r for r in results if isinstance(r, Upstream)]
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            await to_the_end(self._give_back(opened, leases))
            raise failure
        return opened

    async def _give_back(self, opened: list[Upstream], leases: list[Lease]) -> None:
        """The generations of a request one of whose opens failed: closed, and the slots of
        those never opened released (releasing twice is harmless)."""
        for upstream in opened:
            await upstream.aclose()
        held = {u.lease.lease_id for u in opened}
        for lease in leases:
            if lease.lease_id not in held:
                await self._dispatcher.release(lease)

    async def reattach(self, key: str, last_event: str | None, *, retry: bool = False,
                       until: float | None = None) -> Response:
        """The stream of ``key`` after the event whose id the client gave as ``last_event``
        (its number, and its producer's tag, gateway/streams/event_ids.py: only that history
        goes on; None: from the start). ``retry``: the caller is a POST
        (it found the key another attempt's, or lost it to one): if that attempt stopped
        before its stream began, or Redis lost its record since, the POST is told to come
        again (503), not that there is nothing (404: the nemesis found re-sent POSTs told
        "send the request again" and "no resumable stream"). ``until``: the request's deadline,
        where the stream it follows ends for it with the in-band timeout (:func:`_until`)."""
        after, tag = event_ids.parse(last_event)
        deadline = time.monotonic() + self._settings.queue_timeout_s + self._settings.ttft_timeout_s
        deadline = deadline if until is None else min(deadline, until)
        # A client that holds events (``after``) of a stream Redis lost waits for its producer
        # to write the journal again, if it runs (gateway/streams/producers.py), before being
        # told there is none.
        unknown_until = time.monotonic() + (wait_for_producer_s() if after else 0.0)
        while True:
            record = await self._idempotency.lookup(key)
            if (record is None or (record.get("state", "pending") == "pending" and not record["live"])) \
                    and await self._redis.exists(stream_key(key)):
                # Redis lost the record (and ``:live``) of a stream whose journal it kept: follow
                # the journal; its reader takes the stream over if its producer is gone.
                break
            if record is None:
                if time.monotonic() < unknown_until and not await self._idempotency.producers.gone(tag):
                    await asyncio.sleep(0.05)
                    continue
                if after:  # the client holds events of it: its history is what was lost
                    raise HistoryLost(f"the stream this Last-Event-ID ({after}) belongs to is no longer known "
                                      f"(Redis lost it): it cannot be resumed here; {RESEND_POST}")
                if retry:  # the key was claimed moments ago: Redis lost it since (nemesis, Cluster)
                    raise Unavailable(f"the attempt that held Idempotency-Key {key!r} is no longer known (Redis "
                                      "lost it); send this request again", retry_after_s=1)
                if self._since_loss_s() < keys.REGISTRY_REBUILD_S:
                    # Redis lost data moments ago: the stream may have been there (nemesis,
                    # Cluster: a client holding no event of its stream got 404 after a FLUSHALL).
                    raise Unavailable(f"no stream is known for Idempotency-Key {key!r}, but Redis lost data moments "
                                      "ago: send the request again with its body", retry_after_s=1)
                raise RouteNotFound(f"no resumable stream for Idempotency-Key {key!r}")
            if record.get("stream", "1") != "1":
                raise Conflict("this Idempotency-Key belongs to a non-streaming request")
            state = record.get("state", "pending")  # none: Redis lost the record; its live owner restores it
            if state != "pending":
                break
            if not record["live"] and retry:
                raise Unavailable(f"the attempt that held Idempotency-Key {key!r} stopped before its stream began; "
                                  "send this request again", retry_after_s=1)
            if not record["live"]:
                raise RouteNotFound(f"the request with Idempotency-Key {key!r} stopped before its stream began "
                                    "(its gateway is gone); send the request again to run it")
            if time.monotonic() > deadline:
                raise DeadlineExceeded(f"the stream for Idempotency-Key {key!r} has not begun yet")
            await asyncio.sleep(0.05)  # its first request is still being admitted
        if record is not None and record.get("state") == "done":
            await self._finished_journal(key, after)
        # The client's whole id only when it carries a valid account (the take-over's use of
        # it): a header of any length is not kept for the reader's life.
        account = last_event if after and Held.of(last_event) is not None else None
        events = self._readers.tail(key, after, chain=tag, last_id=account)
        return SSEResponse(events if until is None else _until(events, until), self._keepalive)

    async def _finished_journal(self, key: str, after: int) -> None:
        """A finished stream's journal, which Redis may have lost while keeping its record:
        its producer's keeper writes it back within ``WRITE_BACK_S`` of noticing the loss
        (gateway/streams/journal_keeper.py). If it does not, a client holding events is told
        its history is lost (it got 404 "no longer kept": nemesis, Cluster), one holding
        none that nothing is kept."""
        until = time.monotonic() + WRITE_BACK_S
        while not await self._redis.exists(stream_key(key)):
            if time.monotonic() >= until:
                if after:
                    raise HistoryLost(f"the finished stream this Last-Event-ID ({after}) belongs to is no longer "
                                      "in Redis (it lost data): it cannot be resumed")
                raise RouteNotFound(f"the stream for Idempotency-Key {key!r} is no longer kept")
            await asyncio.sleep(0.1)

    async def _end_stream(
        self, upstreams: list[Upstream | None], record: RequestRecord, ctx: RequestContext,
        outcome: str | SluiceError,
    ) -> None:
        """Close upstreams, finish the record, settle the charge. Safe to call twice. (The
        Idempotency-Key's fate is its owner's, decided once the journal is written.)"""
        await _close(upstreams)
        record.finish(outcome)
        await self._settle_usage(ctx, record.prompt_tokens + record.completion_tokens)

    async def _settle_usage(self, ctx: RequestContext, used_tokens: int) -> None:
        """Correct the key's and the model name's TPM charges with what the request really
        used; once."""
        await self._tenancy.settle_all(ctx.take_charges(), used_tokens, ctx.request_id)

    async def _bill_json(self, ctx: RequestContext) -> None:
        """A JSON answer handed to its client's connection: finish the record (the access line
        bills it) and settle the charge (rendering.DeliveredJSON)."""
        ctx.record.finish()
        await self._settle_usage(ctx, ctx.record.prompt_tokens + ctx.record.completion_tokens)


class _Ending:
    """How a resumable stream's generation ended, and who bills it.

    Billing rule: the gateway whose producer writes a stream's ``[DONE]`` to its journal
    bills the whole stream, once: every token in the journal, its own and those of the
    producers before it (a take-over's record starts with the journal's counts). A
    producer whose journal did not end (it lost the stream to a take-over, its journal
    writes failed, it was cut off) bills none of it, in its access-log line and in its
    caller's TPM charge (refunded): whoever ends the stream later bills those tokens, and
    tokens that never reached the journal reached no client. So across gateways each
    token a client was served is billed exactly once (a stream nobody ends is not billed).

    ``end`` (the generation's end, from the renderer) closes the upstreams at once, so
    their slots go back; the record is finished, and the charge settled, only by ``bill``,
    once the journal's fate is known."""

    def __init__(self, close: Callable[[], Awaitable[None]], finish: Callable[[str | SluiceError], Awaitable[None]],
                 record: RequestRecord, owner: str) -> None:
        self._close = close
        self._finish = finish
        self._record = record
        self.owner = owner
        self.completed = False
        self._outcome: str | SluiceError | None = None

    async def end(self, outcome: str | SluiceError, completed: bool) -> None:
        self.completed = self.completed or completed  # a later clean-up call does not undo it
        self._outcome = self._outcome or outcome
        await self._close()

    async def abandon(self) -> None:
        """The generation's clean-up (also when it never ran): close its upstreams."""
        self._outcome = self._outcome or ClientGone("the stream ended before it began")
        await self._close()

    async def bill(self, ended: bool, generation: str | None = None) -> None:
        """``generation``: the stream's name for its bill (event_ids.usage_id), if it has one."""
        if not ended:
            self._record.served_nothing()
        else:
            self._record.usage_id = generation
        await self._finish(self._outcome or "ok")


def _held_by_journal(state: Recovered, digest: int) -> Held | None:
    """What the clients of a stream generated again have, by its journal's last event (its
    journal starts past event 1: gateway/streams/takeover.py); None for any other stream.
    Raises :class:`HistoryLost` for one whose ids keep no account (it cannot be checked),
    or whose request cannot be generated again (``digest``: its choices, else 0)."""
    if not state.base:
        return None
    held = Held.of(f"{state.last}.{(state.account or b'').decode()}") if digest else None
    if held is None:
        raise HistoryLost(f"the stream's journal lacks events 1..{state.base} (Redis lost data): it cannot be "
                          f"continued; {RESEND_POST}")
    return held


async def _aborted(writer: JournalWriter, producer: asyncio.Task[None]) -> None:
    """A producer whose request left before its stream began: stopped, and waited for."""
    await writer.abort()
    await asyncio.wait([producer])


async def _close(upstreams: list[Upstream | None]) -> None:
    """Close every upstream opened so far (a take-over's choice may have none yet). One
    that fails to close does not keep the others, and their slots, open."""
    failure: Exception | None = None
    for upstream in upstreams:
        if upstream is not None:
            try:
                await upstream.aclose()
            except Exception as exc:  # re-raised once every upstream had its turn
                failure = failure or exc
    if failure is not None:
        raise failure


async def _until(events: AsyncIterator[bytes], deadline: float) -> AsyncIterator[bytes]:
    """A followed stream's events until the following request's deadline; then the in-band
    timeout and ``[DONE]``. A re-sent POST that attached to a stream whose producer never
    went on (a take-over waiting on a Cluster in failover) had keep-alives and nothing else
    for 33 s past its deadline (the nemesis, Cluster: nem-3832). The stream itself goes on
    for whoever re-attaches later."""
    try:
        while (left := deadline - time.monotonic()) > 0:
            try:
                async with asyncio.timeout(left):
                    event = await anext(events)
            except StopAsyncIteration:
                return
            except TimeoutError:
                break
            yield event
        yield error_event(DeadlineExceeded("the request's deadline passed while it followed its stream; "
                                           "re-attach with its Last-Event-ID to go on"))
        yield DONE
    finally:
        await events.aclose()  # type: ignore[attr-defined]
