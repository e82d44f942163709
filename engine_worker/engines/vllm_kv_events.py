"""vLLM's KV-cache events, renamed into the precise prefix index's block hashes.

vLLM's engine core publishes what its prefix cache stores and evicts (``kv_events_config``:
a ZMQ PUB socket, one msgpack ``KVEventBatch`` per message). Its blocks are named by
hashes the gateway cannot recompute (a seeded hash of pickled tuples, with extra keys),
but every ``BlockStored`` carries the blocks' token ids and the hash of the block before
them, so the worker re-chains those token ids into :mod:`sluice.prefix_tokens` hashes,
which the gateway computes from the same token ids. Read in vLLM 0.26.0's and 0.32.0's
``vllm/distributed/kv_events.py``: the batch is an array ``[ts, events, dp_rank]``, each
event a map tagged ``type`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) whose
fields are read by name (their order differs between the two versions), and the
publisher sends ``(topic, seq, payload)`` frames; an ``ipc://`` endpoint is bound by the
engine core and only connected to here.

>>> t = BlockTranslator()
>>> stored = t.stored(["a", "b"], None, list(range(64)), 32)   # two vLLM blocks of 32 = one of ours
>>> len(stored), t.removed(["b"]) == stored
(1, True)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import uuid
from typing import Any

from engine_worker.protocol import KVEvent
from sluice.prefix_tokens import ROOT, TOKEN_BLOCK, chain

log = logging.getLogger("sluice.worker.kv_events")

#: Index events buffered for the reporter at most; past it the oldest are dropped (the
#: index only gets staler, and each response's cached_tokens still corrects it).
MAX_PENDING = 65536


def kv_events_endpoint() -> str:
    """A private ``ipc://`` socket for one worker's engine core (no port to collide with the
    other workers' on one machine; a socket path has ~100 characters at most)."""
    name = f"sluice-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
    return f"ipc://{os.path.join(tempfile.gettempdir(), name)}"


class BlockTranslator:
    """vLLM block hashes → chained token-block hashes of :data:`TOKEN_BLOCK` tokens.

    For each cached vLLM block it keeps the hash of the last complete block of ours that
    ends at or before it, and the tokens since (fewer than a block), so a child's tokens
    continue the chain; and for each vLLM block, the blocks of ours it helped complete,
    which leave the index when it is evicted (the engine's prefix match stops there).
    Memory is bounded by the engine's cache: an evicted block's entries go with it.
    """

    def __init__(self) -> None:
        self._tail: dict[Any, tuple[bytes, list[int], list[Any]]] = {}
        self._completes: dict[Any, list[str]] = {}
        #: Stored blocks whose parent was unknown (stored before we listened): skipped.
        self.orphans = 0

    def __len__(self) -> int:
        return len(self._tail)

    def stored(self, hashes: list[Any], parent: Any, token_ids: list[int], block_size: int) -> list[str]:
        """A run of consecutive blocks was cached; returns our blocks it completed, in order."""
        if parent is None:
            done, tail, members = ROOT, [], []
        elif parent in self._tail:
            done, tail, members = self._tail[parent]
        else:
            self.orphans += len(hashes)
            return []
        out: list[str] = []
        for i, h in enumerate(hashes):
            tail = tail + token_ids[i * block_size:(i + 1) * block_size]
            members = [m for m in members if m in self._tail] + [h]
            while len(tail) >= TOKEN_BLOCK:
                done = chain(done, tail[:TOKEN_BLOCK])
                name = done.hex()
                out.append(name)
                for m in members:
                    names = self._completes.setdefault(m, [])
                    if name not in names:
                        names.append(name)
                tail = tail[TOKEN_BLOCK:]
                members = [h] if tail else []
            self._tail[h] = (done, tail, members)
        return out

    def removed(self, hashes: list[Any]) -> list[str]:
        """Blocks were evicted; returns our blocks that are no longer whole."""
        out: list[str] = []
        for h in hashes:
            self._tail.pop(h, None)
            out.extend(self._completes.pop(h, ()))
        return out

    def cleared(self) -> list[str]:
        out = sorted({name for names in self._completes.values() for name in names})
        self._tail.clear()
        self._completes.clear()
        return out

    def events(self, batch: list[Any]) -> list[KVEvent]:
        """One decoded ``KVEventBatch`` (``[ts, events, dp_rank]``) as index events."""
        out: list[KVEvent] = []
        for event in batch[1] if len(batch) > 1 else ():
            if not isinstance(event, dict):
                continue
            kind = event.get("type")
            if event.get("group_idx") not in (None, 0) or event.get("medium") not in (None, "GPU", "CPU"):
                continue  # another attention group's or an offloading tier's blocks
            if kind == "BlockStored":
                names = self.stored(list(event["block_hashes"]), event.get("parent_block_hash"),
                                    list(event["token_ids"]), int(event["block_size"]))
                if names:
                    out.append(KVEvent(type="stored", block_hashes=names))
            elif kind == "BlockRemoved":
                names = self.removed(list(event["block_hashes"]))
                if names:
                    out.append(KVEvent(type="removed", block_hashes=names))
            elif kind == "AllBlocksCleared":
                names = self.cleared()
                if names:
                    out.append(KVEvent(type="removed", block_hashes=names))
        return out


class KVEventListener:
    """Subscribes to one engine core's KV events and keeps them, translated, until taken."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.translator = BlockTranslator()
        self._pending: list[KVEvent] = []
        self._task: asyncio.Task[None] | None = None
        self.batches = 0

    def __repr__(self) -> str:
        return (f"KVEventListener({self.endpoint}, {self.batches} batches, {len(self.translator)} blocks, "
                f"{self.translator.orphans} orphans)")

    def start(self) -> None:
        """Connect now (before the engine core binds is fine: ZMQ reconnects)."""
        import zmq
        import zmq.asyncio

        context = zmq.asyncio.Context.instance()
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.setsockopt(zmq.RCVHWM, 100_000)
        socket.connect(self.endpoint)
        self._task = asyncio.create_task(self._listen(socket), name="vllm-kv-events")

    async def _listen(self, socket: Any) -> None:
        import msgspec

        decode = msgspec.msgpack.Decoder().decode
        try:
            while True:
                frames = await socket.recv_multipart()
                if len(frames) < 3:
                    continue
                self.batches += 1
                try:
                    events = self.translator.events(decode(frames[-1]))
                except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
                    log.warning("an unreadable KV event batch from vLLM: %s", exc)
                    continue
                self._pending.extend(events)
                if len(self._pending) > MAX_PENDING:
                    del self._pending[:len(self._pending) - MAX_PENDING]
        finally:
            socket.close(linger=0)

    def take(self) -> list[KVEvent]:
        events, self._pending = self._pending, []
        return events

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
