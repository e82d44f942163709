"""Migration: a choice whose worker breaks off mid-stream moves to another worker.

The new worker continues from prompt + the token ids already relayed
(``resume_token_ids``) with the remaining ``max_tokens``, admitted ahead of the
queue (boosted), never on the worker it just left nor on one that failed it before
it progressed there (below). The client's stream has no gap and no repeated token.
Each choice of an ``n > 1`` request migrates on its own; their lines are merged in
arrival order.

A choice under a grammar (``response_format``, forced tool calls) or a tool-call
parser does not migrate: a new engine would start the grammar (and the parser's
state) from the beginning, not from the tokens already sent, and could break the
JSON the client has half received. Such a stream ends with one in-band error.

A migration needs Redis (the new worker's slot is admitted there) and a live worker
that has not failed this choice. One that finds Redis away (restarting, failing over,
the link cut) or no such worker (every worker killed or restarting at once, the
registry being rebuilt after a data loss) waits, up to ``migration_wait_s`` (15 s) and never past the
request's deadline, rather than ending a stream that was already admitted: in the
nemesis's full runs Redis outages ended 82 streams with ``503`` mid-stream, and
moments with every worker down ended 5 resumable streams with "every live worker
failed this request" while their replacements were starting.

A break-off counts against the choice (``max_migrations``, the query-of-death rule,
the workers it is kept off) only when the choice made no progress on that worker:
fewer than ``PROGRESS_TOKENS`` tokens since it was placed there. A request that kills
engines does so in its prefill or within a few tokens of where it resumes (migration
continues at the exact token), so it is still caught at its second dead worker; a long
stream whose workers die around it for unrelated reasons (a deploy, a node lost, the
nemesis's kills every few seconds) goes on as long as each worker moves it forward, and
it was ended as a ``query_of_death`` after any two deaths in its whole life (7 of the 9 in
the nemesis's one-Redis run: ``n=16`` streams of 1,300 tokens, 40 s each). Every free
migration carried the stream ``PROGRESS_TOKENS`` further, so their number stays bounded by
``max_tokens``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from array import array
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from gateway.config import GatewaySettings
from gateway.context import RequestContext
from gateway.relay.upstream import Dispatcher, Line, Upstream, query_of_death
from sluice import redis_faults
from sluice.aftercare import to_the_end
from sluice.errors import DeadlineExceeded, SluiceError, Unavailable, UpstreamFailed

PROGRESS_TOKENS = 8
"""Tokens a choice must receive on a worker for that worker's break-off not to count against it."""

log = logging.getLogger("sluice.gateway")

_RETRY_S = 0.25


@dataclass(frozen=True, slots=True)
class Progress:
    """What a choice's client already has: the token ids and the characters of their text."""

    ids: tuple[int, ...]
    chars: int


class Migrator:
    def __init__(self, settings: GatewaySettings, dispatcher: Dispatcher) -> None:
        self._settings = settings
        self._dispatcher = dispatcher

    def lines(
        self, model: str, upstreams: list[Upstream | None], payloads: list[dict[str, Any]], ctx: RequestContext,
        progress: Mapping[int, Progress] | None = None,
    ) -> AsyncIterator[tuple[int, Line]]:
        """Every choice's lines as (choice index, line), in arrival order. ``upstreams[i]``
        is replaced when choice ``i`` migrates, so the caller closes the current ones.

        A stream taken over from a dead gateway (gateway/streams/takeover.py) passes each unfinished
        choice's ``progress`` and no upstreams: those choices start by migrating."""
        indexes = range(len(upstreams)) if progress is None else sorted(progress)
        streams = [
            self._follow(model, i, upstreams, payloads[i], ctx, None if progress is None else progress[i])
            for i in indexes
        ]
        return streams[0] if len(streams) == 1 else _merge(streams)

    async def _follow(
        self, model: str, index: int, upstreams: list[Upstream | None], payload: dict[str, Any],
        ctx: RequestContext, progress: Progress | None,
    ) -> AsyncIterator[tuple[int, Line]]:
        """One choice's lines; if its worker breaks off mid-stream, migrate and go on.

        The new worker continues from prompt + the token ids already relayed
        (``resume_token_ids``) with the remaining ``max_tokens``, so the client's
        stream has no gap and no repeated token.
        """
        # 4 bytes a token (a list of ints held 40: 18 MB for one n=16 x 32k-token stream)
        sent = array("i", progress.ids if progress else ())
        # While every id relayed is in ``sent``. Ids no 32-bit integer holds (no vocabulary's:
        # a broken engine's) are relayed as they come, but the choice cannot be resumed
        # exactly, so it is not migrated.
        exact = True
        chars = progress.chars if progress else 0
        migrations = moves = 0
        shunned: list[str] = []   # workers that broke off this choice before it progressed on them
        last_failed: list[str] = []
        while True:
            upstream = upstreams[index]
            resumed = len(payload.get("resume_token_ids", ()))
            if upstream is not None:
                placed_at = len(sent)
                try:
                    async for line in upstream.lines(self._settings.stall_timeout_s, ctx.deadline):
                        ids = line.get("ids")
                        if ids and exact:
                            try:
                                sent.fromlist(ids)  # (unchanged when it fails)
                            except (OverflowError, TypeError):
                                exact = False
                        chars += len(line.get("text", ""))
                        if resumed and line.get("usage"):
                            # The worker counted the resumed ids as prompt; the client's prompt is shorter.
                            usage = line["usage"]
                            line["usage"] = {**usage, "prompt_tokens": usage["prompt_tokens"] - resumed}
                        yield index, line
                    return
                except (UpstreamFailed, DeadlineExceeded) as exc:
                    progressed = len(sent) - placed_at >= PROGRESS_TOKENS
                    # Past the deadline, a worker that broke off may have ended the request at
                    # the deadline itself: the deadline's 504, not a lost worker's 502.
                    late = ctx.remaining_s() <= 0 and exc.code == "worker_lost"
                    if not progressed and exc.code == "worker_lost" and not ctx.lost_a_worker(upstream.worker_id) \
                            and not late:
                        raise query_of_death() from None
                    if not self._may_migrate(exc, 0 if progressed else migrations, ctx):
                        if late:
                            raise DeadlineExceeded("the request ran past its deadline (its worker broke off)",
                                                   code="request_timeout") from None
                        raise
                    if not progressed:
                        migrations += 1
                        shunned.append(upstream.worker_id)
                    last_failed = [upstream.worker_id]
                    moves += 1
                    if ctx.first_to_say("broke off", upstream.worker_id, exc.message):
                        log.warning("request %s: worker %s broke off after %d tokens, %d of them its own (%s); "
                                    "migrating%s", ctx.request_id, upstream.worker_id, len(sent), len(sent) - placed_at,
                                    exc.message, "" if len(upstreams) == 1 else f" (choice {index}, and any other "
                                    "choice it served)")
                    await upstream.aclose()
            if not exact:
                raise UpstreamFailed(
                    "this stream broke off mid-stream and cannot be resumed on another worker: its engine "
                    "sent token ids that are no 32-bit integers", code="worker_lost")
            if sent and not resumable(payload):
                raise UpstreamFailed(
                    "this structured (JSON or tool-call) output broke off mid-stream; it cannot be resumed "
                    "on another worker (a new engine would restart its grammar)", code="worker_lost")
            limit = payload.get("max_tokens")
            payload = {**payload, "request_id": f"{ctx.internal_id}-{index}-m{moves}",
                       "resume_token_ids": list(sent), "resume_text_chars": chars, "echo": False,
                       "max_tokens": None if limit is None else limit - len(sent) + resumed,
                       # Counted from the original start, like max_tokens (5 of 10 already sent).
                       "min_tokens": max(0, int(payload.get("min_tokens") or 0) - len(sent) + resumed)}
            if payload["max_tokens"] is not None and payload["max_tokens"] <= 0:
                yield index, {"ids": [], "text": "", "finish_reason": "length"}
                return
            opened = await self._open(model, payload, ctx, list(dict.fromkeys(shunned + last_failed)))
            upstreams[index] = opened
            ctx.record.migrated(opened.worker_id)

    async def _open(self, model: str, payload: dict[str, Any], ctx: RequestContext, failed: list[str]) -> Upstream:
        """The migration's new upstream, waiting out a Redis outage or a moment without a
        worker to take it (see the module)."""
        until = time.monotonic() + self._settings.migration_wait_s
        waited = False
        while True:
            try:
                return await self._dispatcher.open(model, payload, ctx, exclude=failed, boost=True)
            except (RedisError, OSError, Unavailable) as exc:
                if time.monotonic() > until or ctx.remaining_s() <= _RETRY_S:
                    if isinstance(exc, Unavailable):
                        raise
                    told = redis_faults.unavailable(exc, log_it=False)
                    raise Unavailable(f"the stream could not migrate: {told.message}",
                                      retry_after_s=told.retry_after_s) from exc
                if not waited:  # said once per wait, not formatted on every retry
                    why = exc.message if isinstance(exc, Unavailable) else \
                        f"Redis: {redis_faults.kind_of(exc)} ({type(exc).__name__}: {exc})"
                    if ctx.first_to_say("migrating waits", why):
                        log.warning("request %s: migrating waits: %s", ctx.request_id, why)
                waited = True
                await asyncio.sleep(_RETRY_S)

    def _may_migrate(self, exc: SluiceError, migrations: int, ctx: RequestContext) -> bool:
        if exc.code == "request_timeout" or ctx.remaining_s() <= 0:
            return False
        return migrations < self._settings.max_migrations


def resumable(payload: dict[str, Any]) -> bool:
    """Whether another engine can continue this choice from its tokens alone."""
    return not payload.get("structured") and payload.get("tool_mode") in (None, "none")


async def _merge(sources: list[AsyncIterator[tuple[int, Line]]]) -> AsyncIterator[tuple[int, Line]]:
    """Interleave several choice streams in arrival order.

    Each source is read, and closed, by its own pump task. When the merge ends early (the
    client left, a choice failed) the pumps are cancelled *and awaited*: a pump left
    running is still inside its upstream's line reader, and the caller's clean-up, which
    closes every upstream next, would fail on it ("aclose(): asynchronous generator is
    already running") and leave the other choices' upstreams and slots open.

    A pump whose end (or error) comes once the merge is closing hands nothing over: the
    queue may be full and nobody reads it any more. (A pump cancelled in ``put`` whose
    source then failed to close turned the cancellation into that error and waited for
    ever to queue it: the merge's clean-up waited on the pump, and a taken-over stream of
    16 choices hung with its ``:live`` refreshed, its readers waiting for good.)"""
    queue: asyncio.Queue[tuple[int, Line] | BaseException | None] = asyncio.Queue(maxsize=64)
    closing = False

    async def pump(source: AsyncIterator[tuple[int, Line]]) -> None:
        outcome: Exception | None = None
        try:
            async with contextlib.aclosing(source):  # type: ignore[type-var]
                async for item in source:
                    await queue.put(item)
        except Exception as exc:  # handed to the consumer, which re-raises it
            outcome = exc
        if not closing:
            await queue.put(outcome)

    tasks = [asyncio.create_task(pump(s)) for s in sources]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        closing = True
        for task in tasks:
            task.cancel()
        await to_the_end(_ended(tasks))


async def _ended(tasks: list[asyncio.Task[Any]]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)
