"""Migration: a choice whose worker breaks off mid-stream moves to another worker.

The new worker continues from prompt + the token ids already relayed
(``resume_token_ids``) with the remaining ``max_tokens``, admitted ahead of the
queue (boosted) and never on a worker that already failed this choice. The
client's stream has no gap and no repeated token. Each choice of an ``n > 1``
request migrates on its own; their lines are merged in arrival order.

A choice under a grammar (``response_format``, forced tool calls) or a tool-call
parser does not migrate: a new engine would start the grammar (and the parser's
state) from the beginning, not from the tokens already sent, and could break the
JSON the client has half received. Such a stream ends with one in-band error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from gateway.config import GatewaySettings
from gateway.context import RequestContext
from gateway.upstream import Dispatcher, Line, Upstream, query_of_death
from sluice.errors import DeadlineExceeded, SluiceError, UpstreamFailed

log = logging.getLogger("sluice.gateway")


class Migrator:
    def __init__(self, settings: GatewaySettings, dispatcher: Dispatcher) -> None:
        self._settings = settings
        self._dispatcher = dispatcher

    def lines(
        self, model: str, upstreams: list[Upstream], payloads: list[dict[str, Any]], ctx: RequestContext,
    ) -> AsyncIterator[tuple[int, Line]]:
        """Every choice's lines as (choice index, line), in arrival order. ``upstreams[i]``
        is replaced when choice ``i`` migrates, so the caller closes the current ones."""
        streams = [self._follow(model, i, upstreams, payloads[i], ctx) for i in range(len(upstreams))]
        return streams[0] if len(streams) == 1 else _merge(streams)

    async def _follow(
        self, model: str, index: int, upstreams: list[Upstream], payload: dict[str, Any], ctx: RequestContext,
    ) -> AsyncIterator[tuple[int, Line]]:
        """One choice's lines; if its worker breaks off mid-stream, migrate and go on.

        The new worker continues from prompt + the token ids already relayed
        (``resume_token_ids``) with the remaining ``max_tokens``, so the client's
        stream has no gap and no repeated token.
        """
        sent: list[int] = []
        chars = 0
        failed: list[str] = []
        while True:
            upstream = upstreams[index]
            resumed = len(payload.get("resume_token_ids", ()))
            try:
                async for line in upstream.lines(self._settings.stall_timeout_s, ctx.deadline):
                    sent.extend(line.get("ids", ()))
                    chars += len(line.get("text", ""))
                    if resumed and line.get("usage"):
                        # The worker counted the resumed ids as prompt; the client's prompt is shorter.
                        line["usage"] = {**line["usage"], "prompt_tokens": line["usage"]["prompt_tokens"] - resumed}
                    yield index, line
                return
            except (UpstreamFailed, DeadlineExceeded) as exc:
                if exc.code == "worker_lost" and not ctx.lost_a_worker():
                    raise query_of_death() from None
                if not self._may_migrate(exc, len(failed), ctx):
                    raise
                if sent and not resumable(payload):
                    raise UpstreamFailed(
                        "the worker serving this structured (JSON or tool-call) output was lost mid-stream; "
                        "it cannot be resumed on another worker", code="worker_lost") from None
                failed.append(upstream.worker_id)
                log.warning("request %s: worker %s broke off after %d tokens (%s); migrating",
                            ctx.request_id, upstream.worker_id, len(sent), exc.message)
                await upstream.aclose()
            limit = payload.get("max_tokens")
            payload = {**payload, "request_id": f"{ctx.internal_id}-{index}-m{len(failed)}",
                       "resume_token_ids": list(sent), "resume_text_chars": chars, "echo": False,
                       "max_tokens": None if limit is None else limit - len(sent) + resumed,
                       # Counted from the original start, like max_tokens (5 of 10 already sent).
                       "min_tokens": max(0, int(payload.get("min_tokens") or 0) - len(sent) + resumed)}
            if payload["max_tokens"] is not None and payload["max_tokens"] <= 0:
                yield index, {"ids": [], "text": "", "finish_reason": "length"}
                return
            upstreams[index] = await self._dispatcher.open(model, payload, ctx, exclude=failed, boost=True)
            ctx.record.migrated(upstreams[index].worker_id)

    def _may_migrate(self, exc: SluiceError, migrations: int, ctx: RequestContext) -> bool:
        if exc.code == "request_timeout" or ctx.remaining_s() <= 0:
            return False
        return migrations < self._settings.max_migrations


def resumable(payload: dict[str, Any]) -> bool:
    """Whether another engine can continue this choice from its tokens alone."""
    return not payload.get("structured") and payload.get("tool_mode") in (None, "none")


async def _merge(sources: list[AsyncIterator[tuple[int, Line]]]) -> AsyncIterator[tuple[int, Line]]:
    """Interleave several choice streams in arrival order."""
    queue: asyncio.Queue[tuple[int, Line] | BaseException | None] = asyncio.Queue(maxsize=64)

    async def pump(source: AsyncIterator[tuple[int, Line]]) -> None:
        try:
            async for item in source:
                await queue.put(item)
            await queue.put(None)
        except Exception as exc:  # handed to the consumer, which re-raises it
            await queue.put(exc)

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
        for task in tasks:
            task.cancel()
