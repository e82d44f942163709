"""API keys: random, shown once, stored only as SHA-256 hashes in Redis.

A key reads ``sk-sluice-<prefix>-<secret>``: the 8-hex-character prefix is public
and names the record ``sl:apikey:<prefix>``; the secret is 32 random bytes
(256 bits). The record holds the SHA-256 of the whole key, compared in constant
time, plus the key's name, tier and limits. A record changes once at most: its
revocation, which marks it (it stays, as the key's tombstone) and lists its prefix in
``sl:apikeys:revoked``. Gateways keep copies of the records they verify and write them back
when Redis loses them (gateway/admission/key_keeper.py).

A *keys file* holds the same records outside Redis, one JSON object per line (hashes, never
keys): ``sluice keys export FILE`` writes it, and ``create`` and ``revoke`` rewrite it when
given ``--keys-file``. Gateways started with ``SLUICE_GATEWAY_KEYS_FILE`` load it and write
its records back whenever Redis lacks them, so keys outlive a Redis that lost its data even
when no gateway process that verified them is left (the nemesis, Sentinel, seed 13: every
gateway restarted while Redis could not take their copies back, and valid keys got 401 for
the rest of the run).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import orjson

from sluice import keys
from sluice.redis_pool import RedisClient

_SCHEME = "sk-sluice-"


@dataclass(frozen=True)
class Tier:
    rpm: int
    tpm: int
    max_concurrent: int
    #: The most urgent priority this tier may ask for (lower is more urgent).
    priority_ceiling: int


TIERS: dict[str, Tier] = {
    "free": Tier(rpm=60, tpm=40_000, max_concurrent=4, priority_ceiling=10),
    "standard": Tier(rpm=600, tpm=400_000, max_concurrent=32, priority_ceiling=0),
    "priority": Tier(rpm=6_000, tpm=4_000_000, max_concurrent=256, priority_ceiling=-10),
}


@dataclass(frozen=True)
class ApiKey:
    prefix: str
    name: str
    tier: str
    rpm: int
    tpm: int
    max_concurrent: int
    priority_ceiling: int
    created: float
    revoked: bool = False

    def public(self) -> dict[str, object]:
        return {k: v for k, v in asdict(self).items()}


def digest(key: str) -> str:
    """What a record stores of its key: the SHA-256, hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def parse_prefix(key: str) -> str | None:
    if not key.startswith(_SCHEME):
        return None
    prefix, _, secret = key[len(_SCHEME):].partition("-")
    if len(prefix) != 8 or not secret:
        return None
    return prefix


class KeyStore:
    def __init__(self, redis: RedisClient) -> None:
        self._redis = redis

    async def create(
        self, name: str, tier: str = "standard", *, rpm: int | None = None, tpm: int | None = None,
        max_concurrent: int | None = None, priority_ceiling: int | None = None,
    ) -> tuple[str, ApiKey]:
        """A new key and its record; the key itself is returned once and never stored."""
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; one of {sorted(TIERS)}")
        base = TIERS[tier]
        while True:
            prefix = secrets.token_hex(4)
            if not await self._redis.exists(keys.api_key(prefix)):
                break
        key = f"{_SCHEME}{prefix}-{secrets.token_urlsafe(32)}"
        record = ApiKey(
            prefix=prefix, name=name, tier=tier,
            rpm=rpm if rpm is not None else base.rpm,
            tpm=tpm if tpm is not None else base.tpm,
            max_concurrent=max_concurrent if max_concurrent is not None else base.max_concurrent,
            priority_ceiling=priority_ceiling if priority_ceiling is not None else base.priority_ceiling,
            created=time.time(),
        )
        fields = {k: str(int(v) if isinstance(v, bool) else v) for k, v in record.public().items()}
        fields["sha256"] = digest(key)
        # Not one MULTI: the record and the set live in different cluster slots. Record
        # first, so the set never names a missing record; a crash in between leaves a
        # key that works but that `keys list` does not show.
        await self._redis.hset(keys.api_key(prefix), mapping=fields)
        await self._redis.sadd(keys.API_KEYS, prefix)
        await self._redis.set(keys.API_KEYS_ENFORCED, "1")
        return key, record

    async def verify(self, key: str) -> ApiKey | None:
        """The key's record if the key is genuine and not revoked."""
        prefix = parse_prefix(key)
        if prefix is None:
            return None
        fields = await self.fields(prefix)
        if fields is None or not matches(digest(key), fields):
            return None
        record = parse_record(fields)
        return None if record.revoked else record

    async def fields(self, prefix: str) -> dict[str, str] | None:
        """The stored record of the key with ``prefix`` (its hash, never the key), or None."""
        raw = await self._redis.hgetall(keys.api_key(prefix))
        return {k.decode(): v.decode() for k, v in raw.items()} if raw else None

    async def get(self, prefix: str) -> ApiKey | None:
        """The record of the key with ``prefix``, revoked or not (no secret needed: for
        charging usage to a key that was verified when its request arrived)."""
        fields = await self.fields(prefix)
        return parse_record(fields) if fields else None

    async def list(self) -> list[ApiKey]:
        return [parse_record(fields) for fields in await self.records()]

    async def records(self) -> list[dict[str, str]]:
        """Every stored record, revoked ones too (hashes, never keys), by prefix."""
        out = []
        for prefix in sorted(p.decode() for p in await self._redis.smembers(keys.API_KEYS)):
            fields = await self.fields(prefix)
            if fields is not None:
                out.append(fields)
        return out

    async def revoke(self, prefix: str) -> bool:
        if not await self._redis.exists(keys.api_key(prefix)):
            return False
        await self._redis.hset(keys.api_key(prefix), "revoked", "1")
        # The gateways that keep a copy of the record learn it here within a second, and
        # write it back revoked if Redis loses it (gateway/admission/key_keeper.py).
        await self._redis.sadd(keys.API_KEYS_REVOKED, prefix)
        return True

    async def any_keys(self) -> bool:
        """Whether keys exist here: the marker, or (for keys made before it) the key set."""
        return bool(await self._redis.exists(keys.API_KEYS_ENFORCED)) or bool(await self._redis.scard(keys.API_KEYS))


def matches(key_digest: str, fields: dict[str, str]) -> bool:
    """Whether the key of ``key_digest`` is the key of this stored record (constant-time)."""
    return hmac.compare_digest(fields.get("sha256", ""), key_digest)


def parse_record(fields: dict[str, str]) -> ApiKey:
    return ApiKey(
        prefix=fields["prefix"], name=fields["name"], tier=fields["tier"], rpm=int(fields["rpm"]),
        tpm=int(fields["tpm"]), max_concurrent=int(fields["max_concurrent"]),
        priority_ceiling=int(fields["priority_ceiling"]), created=float(fields["created"]),
        revoked=fields.get("revoked", "0") == "1",
    )


def save_records(path: str, records: Iterable[dict[str, str]]) -> int:
    """Write key records to the keys file ``path`` (see the module), whole or not at all,
    readable by its owner only. Returns how many."""
    tmp = f"{path}.tmp-{os.getpid()}"
    count = 0
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as out:
            for fields in records:
                out.write(orjson.dumps(fields) + b"\n")
                count += 1
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # (gone once replaced: left only by a write that failed)
    return count


def load_records(path: str) -> dict[str, dict[str, str]]:
    """The records of the keys file ``path``, by prefix. Raises ValueError naming the first
    line that is not a key record, OSError when it cannot be read."""
    records: dict[str, dict[str, str]] = {}
    with open(path, "rb") as source:
        for number, line in enumerate(source, 1):
            if not line.strip():
                continue
            try:
                raw = orjson.loads(line)
                fields = {str(k): str(v) for k, v in raw.items()}
                record = parse_record(fields)
                if len(fields.get("sha256", "")) != 64:
                    raise ValueError("no sha256")
            except (orjson.JSONDecodeError, AttributeError, KeyError, ValueError) as exc:
                raise ValueError(f"{path}, line {number}: not an API key record ({exc})") from None
            records[record.prefix] = fields
    return records
