"""Who may call, how much, and how urgently: API keys and per-key limits in Redis.

Limits are token buckets refilled continuously (requests per minute, tokens per
minute) plus a cap on concurrent requests, all in one Lua script per key, so
every gateway replica enforces the same budget. Tokens are charged at admission
with an estimate (prompt characters / 4 + max_tokens) and corrected with the
real usage when the request ends.

Whether callers need a key (``SLUICE_GATEWAY_AUTH``): ``keys`` always; ``open`` never;
``auto`` once keys exist in Redis (``sl:apikeys:enforced``), and from then on for the
process's life. Redis that loses its data loses the keys and the marker: the gateways
that enforce write both back within about a second (gateway/admission/key_keeper.py). A
gateway in ``auto`` that starts and finds no keys therefore serves openly only once the
registry's epoch is old enough for that (:data:`~sluice.keys.API_KEYS_RESTORE_S` after a
loss, :data:`~sluice.keys.API_KEYS_UNMARKED_S` otherwise; it waits at start until then),
so one started in the moment after a loss does not open while another gateway writes the
keys back. With no such gateway left (every gateway restarted while Redis was empty, or
cut off from it), ``auto`` opens: deployments that must never serve openly use ``keys``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from gateway.admission.key_keeper import KeyKeeper
from gateway.admission.queue import stop_tasks
from gateway.config import GatewaySettings
from gateway.loss_watch import LossWatch
from sluice import keys
from sluice.apikeys import ApiKey, KeyStore
from sluice.directory import Directory
from sluice.errors import AuthenticationFailed, InvalidRequest, RateLimited
from sluice.script_channel import ScriptChannel, script_runner
from sluice.settings import is_loopback
from sluice.single_flight import SingleFlight

log = logging.getLogger("sluice.tenancy")

_ADMIT = r"""
local b, s = KEYS[1], KEYS[2]
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local rpm, tpm, est, maxc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local stream_id, stream_ttl, weight = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
local function level(tokens_field, ts_field, cap)
  local tokens = tonumber(redis.call('HGET', b, tokens_field) or cap)
  local ts = tonumber(redis.call('HGET', b, ts_field) or now)
  return math.min(cap, tokens + (now - ts) * cap / 60000)
end
local rt, tt = level('rt', 'rts', rpm), level('tt', 'tts', tpm)
redis.call('ZREMRANGEBYSCORE', s, '-inf', now)
local conc = redis.call('ZCARD', s)
local need = math.min(est, tpm)
local verdict, retry_ms = 'ok', 0
if rt < 1 then
  verdict, retry_ms = 'requests', math.ceil((1 - rt) * 60000 / rpm)
elseif tt < need then
  verdict, retry_ms = 'tokens', math.ceil((need - tt) * 60000 / tpm)
elseif conc + weight > maxc then
  verdict, retry_ms = 'concurrency', 1000
end
if verdict == 'ok' then
  rt, tt = rt - 1, tt - need
  -- One member per generation, each with a short expiry that the admitting gateway
  -- renews while it runs: a dead gateway's generations stop counting within stream_ttl.
  for i = 0, weight - 1 do redis.call('ZADD', s, now + stream_ttl, stream_id .. '#' .. i) end
  redis.call('PEXPIRE', s, stream_ttl + 60000)
end
redis.call('HSET', b, 'rt', tostring(rt), 'rts', now, 'tt', tostring(tt), 'tts', now)
redis.call('PEXPIRE', b, 120000)
return {verdict, retry_ms, math.floor(rt), math.floor(tt),
        math.ceil((rpm - rt) * 60000 / rpm), math.ceil((tpm - tt) * 60000 / tpm)}
"""

_SETTLE = r"""
local b, s = KEYS[1], KEYS[2]
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local tpm, delta = tonumber(ARGV[1]), tonumber(ARGV[2])
local tokens = tonumber(redis.call('HGET', b, 'tt') or tpm)
local ts = tonumber(redis.call('HGET', b, 'tts') or now)
tokens = math.min(tpm, tokens + (now - ts) * tpm / 60000) - delta
redis.call('HSET', b, 'tt', tostring(math.min(tpm, tokens)), 'tts', now)
redis.call('PEXPIRE', b, 120000)
for i = 0, tonumber(ARGV[4]) - 1 do redis.call('ZREM', s, ARGV[3] .. '#' .. i) end
return 1
"""

_RENEW = r"""
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local ttl = tonumber(ARGV[1])
-- Not XX: a generation Redis forgot (a failover that lost the last writes, a restart)
-- counts again from its next renewal. Only running generations are renewed, and a
-- settlement leaves this gateway's list before its ZREM is sent.
for i = 2, #ARGV, 2 do
  for j = 0, tonumber(ARGV[i + 1]) - 1 do
    redis.call('ZADD', KEYS[1], now + ttl, ARGV[i] .. '#' .. j)
  end
end
redis.call('PEXPIRE', KEYS[1], ttl + 60000)
return 1
"""


def _duration(ms: float) -> str:
    """OpenAI's reset format: 1s, 6m0s, 250ms."""
    if ms < 1000:
        return f"{max(int(ms), 0)}ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.0f}s" if seconds == int(seconds) else f"{seconds:.1f}s"
    return f"{int(seconds // 60)}m{int(seconds % 60)}s"


class StartupRefused(RuntimeError):
    """The gateway must not start with this configuration; the message says why."""


@dataclass(frozen=True)
class Charge:
    """An admitted request's charge against its key: tokens estimated (settled with real
    usage at the end) and ``weight`` generations counted against its concurrency."""

    key: ApiKey
    stream_id: str
    estimate: int
    weight: int
    headers: dict[str, str]




class Tenancy:
    def __init__(self, redis: Any, settings: GatewaySettings, watch: LossWatch | None = None) -> None:
        self._redis = redis
        self._s = settings
        self.keys = KeyStore(redis)
        # Three of these run per request with keys on (the key's record, its charge and its
        # settlement): see Admission's runner.
        self._runner = script_runner(redis)
        self.keeper = KeyKeeper(redis, self.keys, watch=watch, keys_file=settings.keys_file, runner=self._runner)
        self.keeper.enforcing = settings.auth == "keys" or self.keeper.filed
        self._admit = self._runner.register_script(_ADMIT)
        self._settle = self._runner.register_script(_SETTLE)
        self._renew = self._runner.register_script(_RENEW)
        self._keys_seen = (0.0, False)
        #: The look in Redis for keys under way, shared by every request that waits for it.
        self._keys_check = SingleFlight[None, bool]()
        #: Charges running on this gateway, by key prefix: renewed until settled.
        self._running: dict[str, dict[str, int]] = {}
        self._member_ttl_ms = int(settings.lease_ttl_s * 1000)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._renew_loop(), name="concurrency-renewal")
        self.keeper.start()  # also without keys: it starts the watch for losses (gateway/loss_watch.py)

    async def close(self) -> None:
        await self.keeper.close()
        if self._task is not None:
            await stop_tasks([self._task])
        if isinstance(self._runner, ScriptChannel):
            await self._runner.aclose()

    async def _renew_loop(self) -> None:
        """Keep this gateway's generations counted; a dead gateway's stop counting within a lease TTL."""
        while True:
            await asyncio.sleep(self._s.lease_ttl_s / 3)
            for prefix, running in list(self._running.items()):
                args: list[object] = [self._member_ttl_ms]
                for stream_id, weight in running.items():
                    args += [stream_id, weight]
                try:
                    await self._renew(keys=keys.rate_limits(prefix)[1:], args=args)
                except (RedisError, OSError) as exc:
                    log.warning("concurrency renewal for key %s failed: %s", prefix, exc)

    async def enforced(self) -> bool:
        """Whether callers need an API key (never turns back off in a process's life)."""
        return await self._enforced()

    async def check_startup(self) -> None:
        """Refuse an unauthenticated gateway on a non-loopback address unless allowed."""
        enforced = self._s.auth == "keys" or (self._s.auth == "auto" and (self.keeper.filed or await self._keys_exist()))
        if self._s.auth == "auto":
            self._keys_seen = (time.monotonic(), enforced)
            self.keeper.enforcing = enforced
        if enforced:
            return
        if not is_loopback(self._s.host) and not self._s.allow_open:
            raise StartupRefused(
                f"refusing to serve {self._s.host}:{self._s.port} without API keys: create one with "
                "'sluice keys create', or set SLUICE_GATEWAY_ALLOW_OPEN=true to serve openly"
            )
        log.warning("no API keys configured: serving without authentication (%s)",
                    "loopback only" if is_loopback(self._s.host) else "OPEN, explicitly allowed")

    async def _keys_exist(self) -> bool:
        """Whether keys exist, for an ``auto`` gateway starting. Redis with none may have just
        lost them: wait while its registry's epoch is young. Every process that knew the
        previous epoch marks the new one as following a loss at its next beat (a second), and
        a gateway that kept keys writes them back at its next check (the same second). So
        an unmarked epoch API_KEYS_UNMARKED_S old is one no running process knew before;
        a marked one is given API_KEYS_RESTORE_S for the keys to come back."""
        directory = Directory(self._redis)
        waiting = False
        while not await self.keys.any_keys():
            epoch = await directory.epoch(None)
            wait_s = epoch.keys_restore_s
            if wait_s <= 0:
                return False
            if not waiting:
                waiting = True
                log.info("no API keys in Redis, whose registry is %.1f s old: waiting up to %.1f s for gateways "
                         "that kept keys to write them back before serving without keys", epoch.age_s, wait_s)
            await asyncio.sleep(min(0.2, wait_s))
        return True

    async def _enforced(self) -> bool:
        if self._s.auth != "auto":
            return self._s.auth == "keys"
        checked, present = self._keys_seen
        if present:
            return True  # once keys were seen, they stay enforced for this process's life
        if time.monotonic() - checked > 2.0:
            present = await self._keys_check.run(None, self._check_keys)  # one look for all who ask
        return present

    async def _check_keys(self) -> bool:
        present = await self.keys.any_keys()
        self._keys_seen = (time.monotonic(), present)
        if present:
            self.keeper.enforcing = True
            log.info("API keys exist: authentication is enforced from now on")
        return present

    async def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The caller's key; None when the gateway runs open. Raises 401 otherwise."""
        if not await self._enforced():
            return None
        if not authorization or not authorization.lower().startswith("bearer "):
            raise AuthenticationFailed("missing API key: send 'Authorization: Bearer <key>'")
        return await self.keeper.verify(authorization[7:].strip())

    async def admit(self, key: ApiKey, estimate: int, stream_id: str, weight: int = 1) -> Charge:
        """Charge a request of ``weight`` generations; 429 when a limit is reached."""
        if weight > key.max_concurrent:
            raise InvalidRequest(
                f"this request runs {weight} generations at once; key {key.prefix} may run "
                f"{key.max_concurrent}", param="n")
        result = await self._admit(
            keys=keys.rate_limits(key.prefix),
            args=[key.rpm, key.tpm, estimate, key.max_concurrent, stream_id, self._member_ttl_ms, weight],
        )
        verdict = result[0].decode()
        headers = {
            "x-ratelimit-limit-requests": str(key.rpm),
            "x-ratelimit-limit-tokens": str(key.tpm),
            "x-ratelimit-remaining-requests": str(max(int(result[2]), 0)),
            "x-ratelimit-remaining-tokens": str(max(int(result[3]), 0)),
            "x-ratelimit-reset-requests": _duration(int(result[4])),
            "x-ratelimit-reset-tokens": _duration(int(result[5])),
        }
        if verdict != "ok":
            what = {"requests": f"{key.rpm} requests per minute", "tokens": f"{key.tpm} tokens per minute",
                    "concurrency": f"{key.max_concurrent} concurrent requests"}[verdict]
            err = RateLimited(f"rate limit reached for key {key.prefix}: {what}",
                              retry_after_s=max(1, math.ceil(int(result[1]) / 1000)))
            err.extra_headers = headers
            raise err
        if weight:  # (a charge of no generations holds no concurrency: nothing to renew)
            self._running.setdefault(key.prefix, {})[stream_id] = weight
        # The script charges at most a full bucket; settle against what it charged.
        return Charge(key=key, stream_id=stream_id, estimate=min(estimate, key.tpm), weight=weight,
                      headers=headers)

    async def charge_after(self, prefix: str, stream_id: str) -> Charge | None:
        """A charge for tokens generated on behalf of a request admitted elsewhere (a
        take-over): nothing estimated, no concurrency held; :meth:`settle` charges what it
        used. None for a gateway without API keys, or a key that is gone."""
        if prefix == "-":
            return None
        key = await self.keeper.get(prefix)
        return None if key is None else Charge(key=key, stream_id=stream_id, estimate=0, weight=0, headers={})

    async def settle_quietly(self, charge: Charge | None, used_tokens: int, request_id: str) -> None:
        """:meth:`settle` a request's charge, if it has one; a Redis failure is logged, not
        raised (the request is answered already, or failing for another reason)."""
        if charge is None:
            return
        try:
            await self.settle(charge, used_tokens)
        except (RedisError, OSError) as exc:
            log.warning("could not settle the rate-limit charge of %s: %s", request_id, exc)

    async def settle_all(self, charges: list[Charge], used_tokens: int, request_id: str) -> None:
        """:meth:`settle_quietly` each of a request's charges (the key's, its model name's)."""
        for charge in charges:
            await self.settle_quietly(charge, used_tokens, request_id)

    async def settle(self, charge: Charge, used_tokens: int) -> None:
        running = self._running.get(charge.key.prefix, {})
        running.pop(charge.stream_id, None)
        if not running:
            self._running.pop(charge.key.prefix, None)
        await self._settle(
            keys=keys.rate_limits(charge.key.prefix),
            args=[charge.key.tpm, used_tokens - charge.estimate, charge.stream_id, charge.weight],
        )
