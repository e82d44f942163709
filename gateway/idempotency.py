"""``Idempotency-Key``: the same key within its TTL yields one generation.

Record ``sl:idem:{key}`` (JSON): ``{"state": "pending"|"done", "fp": body hash,
"stream": bool, "body": completed JSON body (non-streaming only)}``.

- first caller: claims the key (SET NX) and generates;
- a later caller with the same body: gets the stored result once it is done
  (waiting while it is pending); for a streaming request it re-attaches to the
  journaled stream (see gateway/journal.py), from ``Last-Event-ID`` on;
- the same key with a different body: 409;
- a generation that fails forgets the key, so the client's retry runs again.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Literal

import orjson
from redis.asyncio import Redis
from starlette.responses import Response

from sluice import keys
from sluice.errors import Conflict, DeadlineExceeded, InvalidRequest

MAX_KEY_LENGTH = 255


def scoped(owner: str, key: str) -> str:
    """The name a client's Idempotency-Key gets in Redis: private to its API key.

    Hashing also keeps arbitrary client text out of Redis key names.
    """
    return hashlib.sha256(f"{owner}\0{key}".encode()).hexdigest()[:40]


def fingerprint(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


class Idempotency:
    def __init__(self, redis: Redis, ttl_s: float) -> None:
        self._redis = redis
        self._ttl_ms = int(ttl_s * 1000)

    @staticmethod
    def check_key(key: str) -> str:
        if not key or len(key) > MAX_KEY_LENGTH or not key.isprintable():
            raise InvalidRequest(f"Idempotency-Key must be 1-{MAX_KEY_LENGTH} printable characters")
        return key

    async def claim(self, key: str, fp: str, stream: bool, deadline: float) -> Response | Literal["attach"] | None:
        """None when this caller owns the key and must generate; "attach" to re-attach to
        the key's stream; else the stored answer to send."""
        pending = orjson.dumps({"state": "pending", "fp": fp, "stream": stream})
        # A pending claim lives as long as its request may run, not the whole TTL: if the
        # gateway dies mid-generation, a retry with the key can run once that has passed.
        pending_ms = min(self._ttl_ms, int((deadline - time.monotonic() + 30) * 1000))
        while True:
            if await self._redis.set(keys.idempotency(key), pending, nx=True, px=max(pending_ms, 1000)):
                return None
            raw = await self._redis.get(keys.idempotency(key))
            if raw is None:
                continue  # the owner failed and forgot the key: try to claim it again
            record = orjson.loads(raw)
            if record.get("fp") != fp:
                raise Conflict("this Idempotency-Key was used with a different request body")
            if stream:  # same body, so the stored request streams too
                return "attach"
            if record.get("state") == "done":
                return Response(
                    record["body"].encode(), media_type="application/json",
                    headers={"idempotent-replayed": "true"},
                )
            if time.monotonic() > deadline:
                raise DeadlineExceeded("the request with this Idempotency-Key is still running")
            await asyncio.sleep(0.05)

    async def complete(self, key: str, fp: str, stream: bool, body: bytes | None) -> None:
        record = {"state": "done", "fp": fp, "stream": stream}
        if body is not None:
            record["body"] = body.decode()
        await self._redis.set(keys.idempotency(key), orjson.dumps(record), px=self._ttl_ms)

    async def lookup(self, key: str) -> dict[str, object] | None:
        raw = await self._redis.get(keys.idempotency(key))
        return None if raw is None else dict(orjson.loads(raw))

    async def forget(self, key: str) -> None:
        await self._redis.delete(keys.idempotency(key))
