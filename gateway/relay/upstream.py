"""Talking to workers: open an NDJSON stream, retry before the first token, read lines.

    Dispatcher.open()  -> Upstream (first line already read)
    Upstream.lines()   -> parsed lines until the one with ``finish_reason``
    Upstream.aclose()  -> closes the connection (the worker aborts) and frees the lease

Retries happen only before the first token: a connection error, a worker 5xx,
a draining worker or a first-token stall moves the request to another worker
(the failed one excluded) with exponential backoff and jitter. Once a token has
been relayed, the client has seen output and a failure is reported in-band.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import httpx
import orjson
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from gateway.admission.queue import REGISTRY_REBUILDING, Admission, Ask, Lease, QueueCharge
from gateway.admission.prompt_tokens import PromptTokenizer
from gateway.admission.adapters import AdapterDirectory
from gateway.admission.routing import IndexCorrections, PromptPrefix, RouteCheck
from gateway.config import GatewaySettings
from gateway.context import RequestContext
from gateway.record import RequestRecord
from gateway.relay.direct import DeltaLines, DirectRelay
from gateway.relay.disagg import Disaggregation
from sluice import ticks
from sluice.engine_server import RELAY_SCHEME
from sluice.errors import (
    DeadlineExceeded,
    InvalidRequest,
    ModelNotFound,
    SluiceError,
    Unavailable,
    UpstreamFailed,
    from_body,
)
from sluice.http1 import Http1Pool, Http1Response, drain
from sluice.lines import RAW_KEY, RAW_MARK, LineCutter
from sluice.roles import DECODE
from sluice.tasks import GENERATE, Task
from sluice.telemetry import inject

log = logging.getLogger("sluice.gateway")

Line = dict[str, Any]


async def close_lines(lines: AsyncIterator[Any]) -> None:
    """Close ``lines`` if it is a generator (one that ended or never started: nothing happens).

    Closing a generator at its ``yield`` does not close what it was reading: every layer
    that reads lines closes its source when it ends, so that closing the outermost stops
    the merge of several choices (its pump tasks, each inside its worker's stream) before
    the upstreams are closed under them (gateway/streams/migration.py ``_merge``)."""
    aclose = getattr(lines, "aclose", None)
    if aclose is not None:
        await aclose()


class _Retryable(Exception):
    """This attempt failed in a way another worker may not. ``lost``: the worker's
    connection died (a crash, perhaps caused by this very request)."""

    def __init__(self, reason: str, *, lost: bool = False) -> None:
        super().__init__(reason)
        self.lost = lost


def query_of_death() -> UpstreamFailed:
    return UpstreamFailed("two workers died while serving this request; it is not sent to another",
                          code="query_of_death")


@dataclass(frozen=True, slots=True)
class RouteFacts:
    """What an attempt was routed on, checked against the engine's ``cached_tokens``."""

    prefix: PromptPrefix
    resumed: int
    record: RequestRecord
    corrections: IndexCorrections


class WorkerLines:
    """A worker's NDJSON response as parsed lines (the raw lines before one given to it, as its
    ``RAW_KEY``: sluice/lines.py). ``weigh``, if given, is told how many of
    the body's bytes it holds before they are held: all of them before it is read when the
    response says its length (a pooling answer does), else the pieces' sum so far at each;
    it may refuse them by raising (gateway/relay/whole_answers.py)."""

    def __init__(self, response: Http1Response | httpx.Response, weigh: Callable[[int], None] | None = None) -> None:
        self._response = response
        self._raw = response.aiter_raw()
        if weigh is not None:
            name = b"content-length" if isinstance(response, Http1Response) else "content-length"
            length = response.headers.get(name)
            if length is not None and length.isdigit():
                weigh(int(length))
                weigh = None
        self._lines = self._parse(weigh)

    async def _parse(self, weigh: Callable[[int], None] | None) -> AsyncIterator[Line]:
        cut = LineCutter()
        held = 0
        raw: list[memoryview] = []
        async for chunk in self._raw:
            if weigh is not None:
                held += len(chunk)
                weigh(held)
            for line in cut.feed(chunk):
                if line:
                    if line[0] == RAW_MARK:  # (not tried as JSON: orjson reads all of a line before failing)
                        raw.append(memoryview(line)[1:])  # for the next line (sluice/lines.py)
                        continue
                    parsed = orjson.loads(line)
                    if raw:
                        parsed[RAW_KEY], raw = raw, []
                    yield parsed

    def __aiter__(self) -> AsyncIterator[Line]:
        return self._lines

    async def aclose(self, finished: bool = False) -> None:
        """``finished``: the finishing line arrived and the body's end follows at once;
        reading it lets the connection be reused instead of closed."""
        try:
            if finished:
                await drain(self._response, self._raw)
        finally:
            await self._lines.aclose()  # type: ignore[attr-defined]
            await self._response.aclose()


class _StallWatch:
    """Deadlines for the reads of one stream without a timer per read: one timer, moved
    only when it fires. Per line a read costs two attribute writes; ``asyncio.timeout``
    around every read was a tenth of a relaying gateway's CPU.

    When a read has waited ``stall_s``, or the request's ``deadline`` passes during one,
    the reading task is cancelled and :meth:`expired` says why."""

    __slots__ = ("_deadline", "_handle", "_loop", "_reading", "_since", "_stall_s", "_task", "why")

    def __init__(self, stall_s: float, deadline: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._stall_s = stall_s
        self._deadline = deadline - time.monotonic() + self._loop.time()  # on the loop's clock
        self._handle: asyncio.TimerHandle | None = None
        self._reading = False
        self._since = 0.0
        self.why: str | None = None

    def reading(self) -> None:
        self._since = self._loop.time()
        self._reading = True
        if self._handle is None:
            self._handle = self._loop.call_at(min(self._since + self._stall_s, self._deadline), self._fire)

    def done_reading(self) -> None:
        self._reading = False

    def _fire(self) -> None:
        self._handle = None
        if not self._reading or self._task is None:
            return  # armed again by the next read
        limit = min(self._since + self._stall_s, self._deadline)
        if self._loop.time() < limit:
            self._handle = self._loop.call_at(limit, self._fire)
            return
        self.why = "deadline" if limit >= self._deadline else "stall"
        self._task.cancel()

    def expired(self) -> bool:
        """After a CancelledError: True when it was this watch's (then it is absorbed)."""
        return self.why is not None and self._task is not None and self._task.uncancel() == 0

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class Upstream:
    """One open stream from a worker, holding its lease until closed."""

    def __init__(
        self, admission: Admission, lease: Lease, lines: WorkerLines | DeltaLines,
        span: Span | None = None, route: RouteFacts | None = None,
    ) -> None:
        self.lease = lease
        self._route = route
        self._admission = admission
        self._span = span
        self._source = lines
        self._lines = aiter(lines)
        self._closed = False
        #: The finishing line arrived: the body's end follows at once, and reading it lets
        #: the connection be reused for the next request instead of closed.
        self._finished = False
        #: The finishing line's usage: it corrects the lease's fair-share charge at release.
        self._usage: dict[str, Any] | None = None
        self.first: Line | None = lines.first if isinstance(lines, DeltaLines) else None

    async def read_first(self) -> Line | None:
        if self.first is None:
            self.first = await anext(self._lines, None)
        return self.first

    async def lines(self, stall_timeout_s: float, deadline: float) -> AsyncIterator[Line]:
        """Yield lines, the first one included, until the finishing line.

        Raises :class:`UpstreamFailed` when the worker breaks off or sends an
        error line, :class:`DeadlineExceeded` when it stalls or the request's
        ``deadline`` (``time.monotonic()``) passes.
        """
        line = self.first
        watch = _StallWatch(stall_timeout_s, deadline)
        next_line = self._lines.__anext__  # not anext(lines, None): no wrapper awaitable per line
        try:
            while True:
                if line is None:
                    raise UpstreamFailed("the worker closed the stream before it finished", code="worker_lost")
                if "error" in line:
                    raise _error_line(line)
                if "usage" in line:
                    self._usage = line["usage"]
                    self._check_route(line["usage"])
                yield line
                if line.get("finish_reason") is not None:
                    self._finished = True
                    return
                watch.reading()
                try:
                    line = await next_line()
                except StopAsyncIteration:
                    line = None
                except asyncio.CancelledError:
                    if not watch.expired():
                        raise
                    if watch.why == "deadline":
                        raise DeadlineExceeded("the request ran past its deadline", code="request_timeout") from None
                    raise DeadlineExceeded(
                        f"no token for {stall_timeout_s:g}s from the worker", code="stall_timeout"
                    ) from None
                except (httpx.TransportError, orjson.JSONDecodeError) as exc:
                    raise UpstreamFailed(f"the worker stream broke: {type(exc).__name__}", code="worker_lost") from None
                except Exception as exc:
                    if not isinstance(self._source, DeltaLines):
                        raise
                    line = self._source.failed(exc)  # an engine server's failure: its error line, as a worker's
                finally:
                    watch.done_reading()
        finally:
            watch.stop()

    def _check_route(self, usage: dict[str, Any]) -> None:
        """The engine's cached tokens against the router's guess: the accuracy metric, and
        blocks the worker did not hold leave the index."""
        route, lease = self._route, self.lease
        if route is None:
            return
        check = RouteCheck.of(route.prefix, lease.matched_blocks, usage, route.resumed)
        route.record.route_checked(check.expected, check.error)
        route.corrections.worker_lacks(lease.model, lease.worker_id, route.prefix, check.held_blocks,
                                       lease.matched_blocks)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._source.aclose(self._finished)
        finally:
            if self._span is not None:
                self._span.end()
            await self._admission.release(self.lease, self._usage)

    def hand_over_charge(self) -> QueueCharge | None:
        """Take the fair-share charge off this stream's lease, for another stream of the same
        request to correct with its usage (:meth:`carry_charge`): a disaggregated request's
        prefill hop was charged, its decode hop's usage is the request's."""
        charge, self.lease = self.lease.charge, replace(self.lease, charge=None)
        return charge

    def carry_charge(self, charge: QueueCharge | None) -> None:
        """Correct ``charge`` (another hop's) with this stream's usage at its release."""
        self.lease = replace(self.lease, charge=charge)

    @property
    def worker_id(self) -> str:
        return self.lease.worker_id


def _error_line(line: Line) -> SluiceError:
    err = line.get("error") or {}
    return UpstreamFailed(str(err.get("message") or "engine error"))


class Dispatcher:
    def __init__(
        self, settings: GatewaySettings, admission: Admission, http: httpx.AsyncClient, workers: Http1Pool,
        corrections: IndexCorrections, adapters: AdapterDirectory, disagg: Disaggregation,
        tokenizer: PromptTokenizer | None = None,
    ) -> None:
        self._settings = settings
        #: Prefill/decode pairs, for models with workers of both roles (gateway/relay/disagg.py).
        self._disagg = disagg
        self._adapters = adapters
        self._corrections = corrections
        #: ``SLUICE_GATEWAY_TOKENIZER``'s: this gateway tokenizes prompts (for the precise index,
        #: and for the workers, which then need not: ``send_prompt_ids``).
        self._tokenizer = tokenizer
        self._admission = admission
        self._http = http
        self._workers = workers
        #: Engine servers registered by ``--relay direct`` workers, called from here.
        self._direct = DirectRelay(http, workers)
        self._auth = {"authorization": f"Bearer {settings.internal_token}"} if settings.internal_token else {}

    async def release(self, lease: Lease) -> None:
        await self._admission.release(lease)

    async def prefix_of(self, payload: dict[str, Any]) -> PromptPrefix:
        """The prompt's blocks when routing by cache (hashing costs nothing otherwise).

        With a tokenizer the prompt's token ids go into ``payload`` as well, with the
        tokenizer's digest, for the worker to take instead of tokenizing again (unless
        ``send_prompt_ids`` is off), whatever the routing; the precise index routes by them."""
        s = self._settings
        precise = s.routing == "cache" and s.prefix_index == "precise" and self._tokenizer is not None
        ids = None
        if self._tokenizer is not None and (precise or s.send_prompt_ids):
            ids = payload.get("gateway_prompt_ids") or await self._tokenizer.ids(payload)
            if ids is not None and s.send_prompt_ids:
                payload["gateway_prompt_ids"], payload["gateway_tokenizer"] = ids, self._tokenizer.digest
        if s.routing != "cache":
            return PromptPrefix((), 0)
        if not precise:
            return PromptPrefix.of(payload)
        if ids is None:
            return PromptPrefix((), 0, precise=True)
        return PromptPrefix.of_tokens(ids)

    async def admit(
        self, model: str, request_id: str, ctx: RequestContext, *, need: int = 1, cost: int = 1,
        exclude: list[str] | tuple[str, ...] = (), boost: bool = False, prefix: PromptPrefix | None = None,
        task: Task = GENERATE, role: str = "",
    ) -> list[Lease]:
        """``need`` slots for this request, all at once (queueing if they are not free),
        on workers serving ``task`` (and of ``role``, for one hop of a disaggregated request),
        chosen by the gateway's routing (``prefix``: the prompt, for cache routing)."""
        waited = time.monotonic()
        # An adapter waits in its parent model's queue for its slots (gateway/admission/adapters.py).
        parent = await self._adapters.parent(model)
        model, adapter = (parent, model) if parent is not None else (model, "")
        if adapter and task != GENERATE:  # the workers' adapters generate; pooling runs the base model
            raise InvalidRequest(f"'{adapter}' is a LoRA adapter of '{model}': it serves generation only, "
                                 f"not task '{task}'", param="model", code="task_not_served")
        # Started, not made current: nothing inside reads the current span, and
        # ``start_as_current_span`` (a context manager, a context attached and detached) cost
        # about 25 µs of each request's CPU with tracing off (loadtest/peers/README.md).
        queue_span = ctx.record.child("queue.wait")
        tracing = queue_span.is_recording()
        if tracing:
            queue_span.set_attribute("sluice.priority", ctx.priority)
        try:
            try:
                leases = await self._admission.acquire(
                    Ask(model=model, request_id=request_id, priority=ctx.priority, need=need,
                        timeout_s=max(0.001, min(self._settings.queue_timeout_s, ctx.remaining_s())),
                        tenant=ctx.tenant, cost=cost, boost=boost, exclude=tuple(exclude),
                        # Not an adapter's: engines cache its blocks apart from the base
                        # model's, and the index (per base model) has no name for them.
                        blocks=prefix.blocks if prefix is not None and not adapter else (),
                        task=task, session=ctx.session, adapter=adapter, role=role),
                    ctx.disconnected,
                )
            except ModelNotFound:
                raise
            except SluiceError as exc:
                if exc.code != REGISTRY_REBUILDING:  # full, timed out, no live worker: the model exists
                    ctx.record.known_model()
                if exc.code == "queue_timeout" and ctx.remaining_s() <= 0:
                    # The request's own deadline ended the wait, not the queue timeout: a 504,
                    # as for every deadline (a re-sent POST whose claim had used up its time
                    # was told 429 "queue timeout" after no wait at all: the nemesis, Sentinel).
                    raise DeadlineExceeded(f"the request's deadline passed while it waited for a slot of "
                                           f"'{model}'") from None
                raise
            ctx.record.known_model()
            if tracing:
                queue_span.set_attributes({"sluice.worker_id": ",".join(sorted({x.worker_id for x in leases})),
                                           "sluice.role": role or "both",
                                           "sluice.route": self._settings.routing,
                                           "sluice.route.matched_blocks": max(x.matched_blocks for x in leases)})
        except Exception as exc:  # as start_as_current_span records it (not a cancellation)
            if tracing:
                queue_span.record_exception(exc)
                queue_span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            queue_span.end()
        ctx.record.queued(time.monotonic() - waited)
        return leases

    async def open(
        self,
        model: str,
        payload: dict[str, Any],
        ctx: RequestContext,
        *,
        lease: Lease | None = None,
        exclude: list[str] | tuple[str, ...] = (),
        boost: bool = False,
        cost: int = 1,
        task: Task = GENERATE,
        role: str = "",
        weigh: Callable[[int], None] | None = None,
    ) -> Upstream:
        """Admit, route and connect, retrying on other workers until a first line arrives.

        ``lease``: a slot already granted for the first attempt (this call owns it);
        ``boost`` puts the request ahead of the queue (a migration); ``exclude``
        names workers that already failed it. Retries and migrations are routed on the
        same prompt prefix, so they too prefer a worker that holds it. ``task``: a worker
        serving it answers ``POST /internal/generate`` (generate) or ``/internal/pool``;
        ``weigh`` is told what a worker's answer holds before it is held, each attempt's
        in place of the last's (:class:`WorkerLines`).

        A model with prefill and decode workers serves a generation in two hops (``role``:
        this call is one of them; gateway/relay/disagg.py). A ``lease`` granted beforehand
        (the choices of ``n > 1``, admitted together) is served whole on its worker.
        """
        if not role and lease is None and task == GENERATE and await self._disagg.applies(model):
            return await self._disagg.open(self, model, payload, ctx, exclude=exclude, boost=boost, cost=cost)
        s = self._settings
        payload["priority"] = ctx.priority
        # A decode hop's prompt arrives as KV from its prefill worker: its own cache is not routed on.
        prefix = await self.prefix_of(payload) if task == GENERATE and role != DECODE else PromptPrefix((), 0)
        body = orjson.dumps(payload)
        path = "/internal/generate" if task == GENERATE else "/internal/pool"
        # Only cache routing expects anything of the engine's cache: the others are not checked.
        route = None if s.routing != "cache" or task != GENERATE or role == DECODE else RouteFacts(
            prefix, len(payload.get("resume_token_ids") or ()), ctx.record, self._corrections)
        excluded: list[str] = list(exclude)
        reason = "no attempt made"
        record = ctx.record
        for attempt in range(1, s.max_attempts + 1):
            if lease is None:
                (lease,) = await self.admit(model, f"{payload['request_id']}~{attempt}", ctx, cost=cost,
                                            exclude=excluded, boost=boost or attempt > 1, prefix=prefix,
                                            task=task, role=role)
            span = record.child("upstream", SpanKind.CLIENT)
            if span.is_recording():
                span.set_attributes({"sluice.worker_id": lease.worker_id, "sluice.attempt": attempt,
                                     "sluice.role": role or "both", "sluice.route": s.routing,
                                     "sluice.route.matched_blocks": lease.matched_blocks,
                                     "sluice.route.prompt_blocks": len(prefix.blocks)})
            try:
                upstream = await self._attempt(lease, body, ctx.deadline, span, route, path, weigh)
                self._admission.prefilled(lease)
                record.admitted(attempt, lease.worker_id, lease.matched_blocks, len(prefix.blocks), role)
                return upstream
            except _Retryable as exc:
                reason = str(exc)
                # Past the deadline, a worker's lost connection may be the worker ending the
                # request at the deadline: 504 below, not a query of death (the route's timer
                # fires up to a tick late, and the nemesis met a 502 inside that tick).
                if exc.lost and not ctx.lost_a_worker(lease.worker_id) and time.monotonic() < ctx.deadline:
                    log.error("request %s: worker %s died too; not retrying a probable query of death",
                              ctx.request_id, lease.worker_id)
                    raise query_of_death() from None
                record.span.add_event("retry", {"sluice.worker_id": lease.worker_id, "sluice.reason": reason})
                log.warning(
                    "attempt %d/%d on worker %s failed before the first token: %s",
                    attempt, s.max_attempts, lease.worker_id, reason,
                )
                excluded.append(lease.worker_id)
                if time.monotonic() >= ctx.deadline:
                    # Past the deadline, a failed attempt is the deadline's doing as much as
                    # the worker's (the worker ends a request at its deadline too, and may
                    # answer before the gateway's own timer fires): 504, not "every worker
                    # failed" once the next admission finds the one worker excluded.
                    raise DeadlineExceeded(f"the request ran past its deadline ({reason})",
                                           code="request_timeout") from None
            lease = None
            if attempt < s.max_attempts:
                backoff = s.retry_backoff_ms / 1000 * 2 ** (attempt - 1)
                await asyncio.sleep(backoff * random.uniform(0.5, 1.5))
        raise Unavailable(
            f"no worker could serve the request after {s.max_attempts} attempts ({reason})",
            retry_after_s=1,
        )

    async def _attempt(
        self, lease: Lease, body: bytes, deadline: float, span: Span, route: RouteFacts | None,
        path: str = "/internal/generate", weigh: Callable[[int], None] | None = None,
    ) -> Upstream:
        s = self._settings
        left_s = deadline - time.monotonic()
        ttft_s = max(0.0, min(s.ttft_timeout_s, left_s))
        # The timer set by the deadline is the deadline: checked against the clock after it
        # fired, it may read a hair early (the loop's cached time), and the attempt went on as
        # a worker's failure: 503 "every live worker failed" instead of 504 (a CI flake).
        by_deadline = left_s <= s.ttft_timeout_s
        upstream: Upstream | None = None
        try:
            async with ticks.timeout(ttft_s):
                if lease.url.startswith(RELAY_SCHEME):
                    upstream = Upstream(self._admission, lease, await self._open_direct(lease.url, body), span,
                                        route)
                else:
                    headers = {"content-type": "application/json", **self._auth,
                               **inject(trace.set_span_in_context(span))}
                    response = await self._send(lease.url, path, body, headers)
                    upstream = Upstream(self._admission, lease, WorkerLines(response, weigh), span, route)
                    if response.status_code != 200:
                        detail = await response.aread()
                        if response.status_code in (401, 403):
                            log.error("worker %s refused this gateway: SLUICE_INTERNAL_TOKEN differs",
                                      lease.worker_id)
                            raise _Retryable("the worker refused this gateway's internal token")
                        if response.status_code >= 500 or response.status_code == 404:
                            raise _Retryable(f"worker answered {response.status_code}")
                        raise from_body(response.status_code, detail)
                await upstream.read_first()
            if upstream.first is None:
                raise _Retryable("worker closed the stream before the first token", lost=True)
            if "error" in upstream.first:
                raise _Retryable(f"worker error before the first token: {_error_line(upstream.first)}")
            return upstream
        except TimeoutError:
            await _close(upstream, lease, self._admission, span)
            if by_deadline or time.monotonic() >= deadline:
                raise DeadlineExceeded("the request ran past its deadline before its first token",
                                       code="request_timeout") from None
            raise _Retryable(f"no first token within {ttft_s:g}s") from None
        except httpx.TransportError as exc:
            await _close(upstream, lease, self._admission, span)
            if isinstance(exc, httpx.ConnectError):
                await self._admission.unreachable(lease)
            raise _Retryable(f"{type(exc).__name__} talking to the worker",
                             lost=not isinstance(exc, httpx.ConnectError)) from None
        except BaseException:
            await _close(upstream, lease, self._admission, span)
            raise


    async def _open_direct(self, relay: str, body: bytes) -> DeltaLines:
        """An engine server called from here: its refusals map as a worker's status would."""
        try:
            return await self._direct.open(relay, body)
        except SluiceError as exc:
            if exc.status >= 500 or exc.status == 404:
                raise _Retryable(f"engine server: {exc.message}", lost=exc.code == "worker_lost") from None
            raise

    async def _send(self, url: str, path: str, body: bytes, headers: dict[str, str]) -> Http1Response | httpx.Response:
        """Plain-HTTP workers through the lean HTTP/1.1 client (sluice/http1.py); a worker behind TLS
        through httpx."""
        if url.startswith("http://"):
            return await self._workers.post(url, path, body, headers)
        request = self._http.build_request("POST", url + path, content=body, headers=headers)
        return await self._http.send(request, stream=True)


async def _close(upstream: Upstream | None, lease: Lease, admission: Admission, span: Span) -> None:
    """Undo a failed attempt: its span marked failed and ended, its slot released."""
    span.set_status(Status(StatusCode.ERROR, "attempt failed"))
    if upstream is not None:
        await upstream.aclose()  # ends the span too
    else:
        span.end()
        await admission.release(lease)
