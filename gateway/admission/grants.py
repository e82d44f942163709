"""Grant delivery: one listener per gateway process and model, not one Redis
connection per waiting request.

A request registers a local future, then asks for slots (ACQUIRE). If it has to wait,
ACQUIRE says so with the grant stream's newest id, and the model's listener reads on from
there (or from wherever it already is). When a released slot is handed to the request,
the Lua pump appends the grant to the model's grant stream, tagged with this process's
id. One task per model reads that stream with a blocking ``XREAD`` and resolves the
matching futures; grants for other processes are skipped. So a queue of any length costs
this process one connection per model with waiters, a model nobody waits for (one granted
at once, one that does not exist) costs none, and the listener stops when nobody has
waited for a while.

After a Redis error the listener reads on from where it was, unless the stream now ends
before that point: a failover (or a restart) lost its last entries, and the new master
numbers its next grants from its own last entry, which may lie behind what this listener
saw (another host's clock). It then reads the (capped) stream again from its start:
a grant seen twice finds no waiter the second time.

The stream is the delivery channel, not the truth: the lease in Redis is. A waiter
that gives up asks Redis (CANCEL), which reports a grant that raced in even when the
listener never saw it (a lagging listener, a trimmed stream).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import orjson
from redis.exceptions import RedisError

from sluice import keys

log = logging.getLogger("sluice.grants")

#: A listener with no waiter for this long stops (and frees its connection).
_IDLE_S = 10.0
_BLOCK_MS = 1000


def _stream_id(entry_id: bytes) -> tuple[int, int]:
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)


@dataclass(frozen=True, slots=True)
class GrantMessage:
    """What the pump decided for one waiting request."""

    ok: bool
    #: (lease id, worker id, worker url) per granted slot; empty when not ok.
    slots: tuple[tuple[Any, ...], ...]

    @classmethod
    def parse(cls, status: bytes, leases: bytes) -> GrantMessage:
        return cls(ok=status == b"ok", slots=tuple(tuple(s) for s in orjson.loads(leases)))  # type: ignore[misc]


class GrantListener:
    def __init__(self, redis: Any, gateway_id: str) -> None:
        self._redis = redis
        self._gateway_id = gateway_id.encode()
        #: model -> request id -> its future; a model leaves when its last waiter does.
        self._waiting: dict[str, dict[str, asyncio.Future[GrantMessage]]] = {}
        self._loops: dict[str, asyncio.Task[None]] = {}

    def __repr__(self) -> str:
        return f"GrantListener(models={len(self._loops)}, waiting={sum(map(len, self._waiting.values()))})"

    def waiting(self, model: str) -> int:
        return len(self._waiting.get(model, ()))

    def expect(self, model: str, request_id: str) -> asyncio.Future[GrantMessage]:
        """A future for ``request_id``'s grant. Call it *before* queueing the request, so
        no grant read meanwhile finds nobody to take it; then :meth:`listen`."""
        future: asyncio.Future[GrantMessage] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(model, {})[request_id] = future
        return future

    def listen(self, model: str, after: bytes) -> None:
        """Make sure the model's grants are read, from stream id ``after`` at the latest
        (ACQUIRE's answer for a queued request: its grant can only come later). A running
        listener is at or before it: every id it has read was in the stream by then."""
        if model not in self._loops or self._loops[model].done():
            self._loops[model] = asyncio.create_task(self._listen(model, after), name=f"grants-{model}")

    def forget(self, model: str, request_id: str) -> None:
        waiters = self._waiting.get(model)
        if waiters is not None:
            waiters.pop(request_id, None)
            if not waiters:
                del self._waiting[model]

    async def _listen(self, model: str, last: bytes) -> None:
        stream = keys.grants(model)
        failed = False
        idle_since = asyncio.get_running_loop().time()
        while True:
            try:
                if failed:
                    if _stream_id(await self._newest(stream)) < _stream_id(last):
                        last = b"0-0"  # rewound: read it all again (delivery is idempotent)
                    failed = False
                got = await self._redis.xread({stream: last}, count=512, block=_BLOCK_MS)
            except (RedisError, OSError) as exc:
                log.warning("grant listener for %r: %s; retrying", model, exc)
                failed = True
                await asyncio.sleep(0.5)
                continue
            for _, entries in got or ():
                for entry_id, fields in entries:
                    last = entry_id
                    if fields.get(b"g") == self._gateway_id:
                        self._deliver(model, fields)
            now = asyncio.get_running_loop().time()
            if self._waiting.get(model):
                idle_since = now
            elif now - idle_since > _IDLE_S:
                self._loops.pop(model, None)
                return

    async def _newest(self, stream: str) -> bytes:
        newest = await self._redis.xrevrange(stream, count=1)
        return newest[0][0] if newest else b"0-0"

    def _deliver(self, model: str, fields: dict[bytes, bytes]) -> None:
        future = self._waiting.get(model, {}).pop(fields[b"r"].decode(), None)
        if future is not None and not future.done():
            future.set_result(GrantMessage.parse(fields[b"s"], fields[b"l"]))
        # No future: its waiter already left and asked Redis (CANCEL), which owns the outcome.

    async def close(self) -> None:
        tasks = list(self._loops.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
        self._loops.clear()
