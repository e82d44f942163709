"""What one resumable stream, one tenant and all tenants may keep in journals.

A journal (gateway/streams/journal.py) is never trimmed, so it must be bounded another way:

- **events**: every event of a choice but its first (role, echo) and its last (finish)
  carries at least one token, so a request's events are at most ``generations x
  (max_tokens + 2) + 2`` (usage, ``[DONE]``); a Responses stream's typed events, at most
  ``5 x max_tokens + 10``. A request whose own ``max_tokens`` cannot
  fit ``journal_max_events`` is refused up front (400); one without ``max_tokens`` is
  journaled with that cap and, should it reach it, ends with an in-band error.
- **answers**: a non-streaming request with an Idempotency-Key keeps its whole answer in
  Redis for its retries (``idempotency_ttl_s``); it reserves that many bytes the same way
  (:meth:`JournalQuota.keep`), and one past a bound is sent but not kept (its key is
  forgotten: a retry runs it again). Before, nothing bounded them: one client's keyed answers
  could fill Redis, and every tenant's admission with it.
- **bytes**: a stream reserves journal bytes for its tenant (API key) in chunks of
  ``CHUNK_BYTES`` as it writes, the plan (its request body) first. Each reservation
  holds until its journal can have expired (the request's deadline plus the journal's
  TTL; the shorter ``journal_done_ttl_s`` once it ended), and a finished stream settles
  it to what it really wrote. A new resumable request that would take its tenant past
  ``journal_tenant_max_bytes``, or all of them past ``journal_max_bytes``, gets 429 in
  OpenAI's shape; a stream already running that would, ends with the same error in-band.

The reservations live in one Redis Cluster slot (``keys.JOURNAL_QUOTA``), so one script
checks the tenant's bound and the total together; each call also drops up to 64
expired reservations, and sets the keys' TTL to the latest reservation's expiry (so an
idle system's quota keys expire with the journals they counted). Redis losing them (a restart without persistence) loses the
journals they counted too.

A new stream's first reservation goes in the same round trip as its journal's first write,
which promotes its Idempotency-Key's claim (gateway/streams/journal.py): :meth:`JournalQuota.budget`,
sent by the writer (``StreamBudget.opening_call``). It replaces what an earlier attempt of
the same key held, and remembers its ``holder`` (the new stream's producer token) and what
it replaced, so that a promotion refused in that round trip (this gateway stalled past its
claim, a retry owns the key now) undoes it exactly (``UNRESERVE``), and only while it is
still the key's: a retry that reserved since replaced it, and keeps its own. A refused
reservation changes nothing. Growth, settling and take-overs go by the key alone.

>>> quota = JournalQuota(redis, settings)
>>> budget = quota.budget(scope, tenant, plan_bytes, hold_s=deadline_s + ttl_s, holder=token)  # a new stream
>>> writer = JournalWriter(..., max_events=journal_events(req, settings), budget=budget)  # reserves it
>>> budget = await quota.open(scope, tenant, 0, hold_s=..., taken_over=stored)  # a take-over: 429 when full
"""

from __future__ import annotations

import logging

from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from gateway.admission.caps import generations
from gateway.config import GatewaySettings
from gateway.surfaces.openai import ChatCompletionRequest, CompletionRequest
from sluice import keys
from sluice.errors import InvalidRequest, RateLimited, SluiceError
from sluice.script_channel import ScriptRunner

log = logging.getLogger("sluice.journal")

#: A stream reserves journal bytes this many at a time (about 600 chunk events): one
#: script call per chunk, not per event.
CHUNK_BYTES = 64 * 1024

_RELEASE = """
local function release(scope)
  local size = tonumber(redis.call('HGET', KEYS[2], scope) or '0')
  local tenant = redis.call('HGET', KEYS[3], scope)
  if size ~= 0 then  -- (Redis refuses "-0")
    if tenant and redis.call('HINCRBY', KEYS[4], tenant, -size) <= 0 then redis.call('HDEL', KEYS[4], tenant) end
    if redis.call('DECRBY', KEYS[5], size) < 0 then redis.call('SET', KEYS[5], 0) end
  end
  redis.call('HDEL', KEYS[2], scope)
  redis.call('HDEL', KEYS[3], scope)
  redis.call('HDEL', KEYS[6], scope)
  redis.call('ZREM', KEYS[1], scope)
end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
for _, scope in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 64)) do release(scope) end
-- The quota's keys live as long as their latest reservation (plus a second), refreshed on
-- every write, so an idle system's keys expire; with no reservation left they hold nothing.
local function keep()
  local top = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
  if not top[2] then
    redis.call('DEL', unpack(KEYS))
    return
  end
  local ttl = math.max(1000, tonumber(top[2]) - now + 1000)
  for i = 1, #KEYS do redis.call('PEXPIRE', KEYS[i], ttl) end
end
"""

#: Reserve ``bytes`` more for a stream, if its tenant and the total stay within their
#: bounds. KEYS: keys.JOURNAL_QUOTA. ARGV: scope, tenant, bytes, hold ms, tenant bound,
#: total bound, "1" for a new stream (it replaces what an earlier attempt of the scope held),
#: the new stream's producer token ('' none: see UNRESERVE).
#: Returns {1, tenant's bytes, then what a new stream replaced: its bytes, expiry, tenant,
#: holder} or {0, tenant's bytes} (tenant full) or {-1, total} (all full); a refusal changes nothing.
RESERVE = _RELEASE + """
local add = tonumber(ARGV[3])
local mine = tonumber(redis.call('HGET', KEYS[4], ARGV[2]) or '0')
local all = tonumber(redis.call('GET', KEYS[5]) or '0')
local before = {0, 0, '', ''}
if ARGV[7] == '1' then
  before[1] = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
  if before[1] > 0 then
    before[2] = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]) or '0')
    before[3] = redis.call('HGET', KEYS[3], ARGV[1]) or ''
    before[4] = redis.call('HGET', KEYS[6], ARGV[1]) or ''
    if before[3] == ARGV[2] then mine = mine - before[1] end
    all = all - before[1]
  end
end
if mine + add > tonumber(ARGV[5]) then keep() return {0, mine} end
if all + add > tonumber(ARGV[6]) then keep() return {-1, all} end
if ARGV[7] == '1' then
  release(ARGV[1])
  if ARGV[8] ~= '' then redis.call('HSET', KEYS[6], ARGV[1], ARGV[8]) end
end
redis.call('HINCRBY', KEYS[2], ARGV[1], add)
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[4], ARGV[2], add)
redis.call('INCRBY', KEYS[5], add)
local expiry = now + tonumber(ARGV[4])
local held = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not held or tonumber(held) < expiry then redis.call('ZADD', KEYS[1], expiry, ARGV[1]) end
keep()
return {1, mine + add, before[1], before[2], before[3], before[4]}
"""

#: A new stream's first reservation undone: its promotion failed (another request owns the
#: key now). Only while that reservation is still the scope's (its holder is ARGV[2]):
#: whoever reserved the scope as a new stream since then replaced it, and keeps theirs.
#: Takes its bytes back out (what others added since stays) and puts back what it replaced,
#: as RESERVE returned it. KEYS: keys.JOURNAL_QUOTA. ARGV: scope, holder, bytes, then what
#: it replaced: bytes, expiry, tenant, holder. Returns 1 undone, 0 not the holder's.
UNRESERVE = _RELEASE + """
if redis.call('HGET', KEYS[6], ARGV[1]) ~= ARGV[2] then keep() return 0 end
local function add(tenant, bytes)
  redis.call('HINCRBY', KEYS[2], ARGV[1], bytes)
  if redis.call('HINCRBY', KEYS[4], tenant, bytes) <= 0 then redis.call('HDEL', KEYS[4], tenant) end
  if redis.call('INCRBY', KEYS[5], bytes) < 0 then redis.call('SET', KEYS[5], 0) end
end
add(redis.call('HGET', KEYS[3], ARGV[1]), -tonumber(ARGV[3]))
local before = tonumber(ARGV[4])
if before > 0 then
  add(ARGV[6], before)
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[6])
  if ARGV[7] ~= '' then redis.call('HSET', KEYS[6], ARGV[1], ARGV[7]) else redis.call('HDEL', KEYS[6], ARGV[1]) end
  if tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]) or '0') < tonumber(ARGV[5]) then
    redis.call('ZADD', KEYS[1], ARGV[5], ARGV[1])
  end
else
  redis.call('HDEL', KEYS[6], ARGV[1])
end
if tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0') <= 0 then release(ARGV[1]) end
keep()
return 1
"""

#: A stream ended: its reservation becomes what it wrote, held ``hold ms`` from now (0
#: bytes: dropped). KEYS: keys.JOURNAL_QUOTA. ARGV: scope, bytes, hold ms.
SETTLE = _RELEASE + """
local tenant = redis.call('HGET', KEYS[3], ARGV[1])
if not tenant then keep() return 0 end
local size = tonumber(ARGV[2])
if size <= 0 then release(ARGV[1]) keep() return 1 end
local delta = size - tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
redis.call('HSET', KEYS[2], ARGV[1], size)
redis.call('HINCRBY', KEYS[4], tenant, delta)
redis.call('INCRBY', KEYS[5], delta)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
keep()
return 1
"""


def journal_events(req: ChatCompletionRequest | CompletionRequest, settings: GatewaySettings, *,
                   typed: bool = False) -> int:
    """The most events the request's stream may journal (its error and ``[DONE]`` aside);
    400 when its own ``max_tokens`` could need more than ``journal_max_events``. ``typed``:
    the Responses API's events, up to 5 per token (a tool call's item added, arguments
    delta and their two done events) and 8 more (created, in progress, the message's
    item and part, completed)."""
    limit = req.token_limit()
    count = generations(req)
    per_token, extra = (5, 8) if typed else (1, 2)
    needed = count * ((limit or settings.max_tokens_cap) * per_token + extra) + 2
    if needed <= settings.journal_max_events:
        return needed
    if limit is None:
        return settings.journal_max_events  # reaching it ends the stream with an in-band error
    fits = max(0, ((settings.journal_max_events - 2) // count - extra) // per_token)
    param = "max_completion_tokens" if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens \
        else "max_tokens"
    raise InvalidRequest(
        f"a resumable stream (Idempotency-Key) keeps at most {settings.journal_max_events} events; "
        f"{count} generation(s) of {limit} tokens could need {needed}: ask for at most {fits} tokens, "
        "fewer choices, or stream without an Idempotency-Key", param=param, code="stream_too_long")


class JournalQuota:
    """The journal memory reservations of every stream (one per gateway process)."""

    def __init__(self, redis: Redis | ScriptRunner, settings: GatewaySettings) -> None:
        """``redis``: what the scripts run on (the gateway gives the Idempotency-Keys' script
        channel, gateway/streams/idempotency.py)."""
        self._reserve = redis.register_script(RESERVE)
        self._settle = redis.register_script(SETTLE)
        self._unreserve = redis.register_script(UNRESERVE)
        self._tenant_max = settings.journal_tenant_max_bytes
        self._total_max = settings.journal_max_bytes

    async def open(self, scope: str, tenant: str, first_bytes: int, *, hold_s: float,
                   taken_over: int | None = None) -> StreamBudget:
        """A stream's budget with ``first_bytes`` and one chunk reserved; 429 (RateLimited)
        when its tenant or all of them are at their bound. A new stream drops what an
        earlier attempt with the same scope held; a stream ``taken_over`` after that many
        bytes adds to what its first producer reserved for them."""
        budget = StreamBudget(self, scope, tenant, int(hold_s * 1000))
        budget.reserved = taken_over or 0
        refusal = await budget.reserve(first_bytes + CHUNK_BYTES, new=taken_over is None)
        if refusal is not None:
            raise refusal
        return budget

    def budget(self, scope: str, tenant: str, first_bytes: int, *, hold_s: float, holder: str) -> StreamBudget:
        """A new stream's budget whose first reservation, ``first_bytes`` and one chunk, is
        still to be made: by its journal's first write, in the same round trip
        (gateway/streams/journal.py, ``StreamBudget.opening``). ``holder``: the stream's
        producer token, which lets it undo that reservation alone (:meth:`StreamBudget.undo_opening`)."""
        budget = StreamBudget(self, scope, tenant, int(hold_s * 1000), holder)
        budget.opening = first_bytes + CHUNK_BYTES
        return budget

    async def keep(self, scope: str, tenant: str, size: int, *, hold_s: float) -> bool:
        """Reserve ``size`` bytes for a keyed non-streaming answer that Redis keeps ``hold_s``
        for its retries (gateway/relay/serving.py); False when a bound refuses. Counted with the
        journals: both are what Redis holds for Idempotency-Keys."""
        return await StreamBudget(self, scope, tenant, int(hold_s * 1000)).reserve(size, new=True) is None

    @property
    def reserve_script(self) -> AsyncScript:
        """``RESERVE`` as registered (a journal round sends it in its own pipeline)."""
        return self._reserve

    async def call_reserve(self, args: list[str | int]) -> list[int]:
        return list(await self._reserve(keys=list(keys.JOURNAL_QUOTA), args=args))

    async def call_unreserve(self, args: list[bytes | str | int]) -> bool:
        return bool(await self._unreserve(keys=list(keys.JOURNAL_QUOTA), args=args))

    async def call_settle(self, args: list[str | int]) -> None:
        await self._settle(keys=list(keys.JOURNAL_QUOTA), args=args)

    def limits(self) -> tuple[int, int]:
        return self._tenant_max, self._total_max


class StreamBudget:
    """The journal bytes one stream has reserved (gateway/streams/journal.py's ``Budget``)."""

    def __init__(self, quota: JournalQuota, scope: str, tenant: str, hold_ms: int, holder: str = "") -> None:
        self._quota = quota
        self._scope = scope
        self._tenant = tenant
        self._hold_ms = hold_ms
        self._holder = holder
        self.reserved = 0
        #: Bytes of the first reservation still to be made by the journal's first write (0: made).
        self.opening = 0
        #: The first reservation, once made: what it replaced (RESERVE's reply), to undo it.
        self._opened: list[bytes | str | int] | None = None
        self._refusal: SluiceError | None = None

    def __repr__(self) -> str:
        return f"<StreamBudget {self._scope} tenant={self._tenant} reserved={self.reserved}>"

    def _args(self, more: int, new: bool) -> list[str | int]:
        tenant_max, total_max = self._quota.limits()
        return [self._scope, self._tenant, more, self._hold_ms, tenant_max, total_max, "1" if new else "0",
                self._holder if new else ""]

    async def reserve(self, more: int, *, new: bool = False) -> SluiceError | None:
        return self._reserved(more, await self._quota.call_reserve(self._args(more, new)))

    def opening_call(self) -> tuple[AsyncScript, list[str], list[str | int]]:
        """The script, KEYS and ARGV of the first reservation (:attr:`opening` bytes, as a new
        stream), for the journal's first round to send with its write; :meth:`opened` takes
        the reply."""
        return self._quota.reserve_script, list(keys.JOURNAL_QUOTA), self._args(self.opening, True)

    def opened(self, reply: list[Any]) -> SluiceError | None:
        """The first reservation's reply: None when it was made, else the refusal (429)."""
        more, self.opening = self.opening, 0
        refusal = self._reserved(more, reply)
        if refusal is None:
            self._opened = [more, *reply[2:6]]
        return refusal

    async def undo_opening(self) -> bool:
        """Undo the first reservation of a stream that did not start (its promotion failed:
        another request owns the key now; or Redis failed), made or maybe made (sent, not
        answered): only while it is still the scope's, so the reservation of a request that
        took the key over meanwhile stays as it is. True if one was undone."""
        if self._opened is not None:
            args = self._opened
        elif self.opening:  # unanswered: what it may have replaced is unknown, and stays dropped
            args = [self.opening, 0, 0, "", ""]
        else:
            return False
        self._opened, self.opening, self.reserved = None, 0, 0
        return await self._quota.call_unreserve([self._scope, self._holder, *args])

    def _reserved(self, more: int, reply: list[Any]) -> SluiceError | None:
        status, held = reply[0], reply[1]
        if int(status) == 1:
            self.reserved += more
            return None
        tenant_max, total_max = self._quota.limits()
        whose, bound = ("this API key's streams", tenant_max) if int(status) == 0 else ("all streams", total_max)
        self._refusal = RateLimited(
            f"resumable streams (Idempotency-Key) keep at most {bound} bytes of journal for {whose}, and "
            f"{int(held)} are in use; retry later, or stream without an Idempotency-Key",
            code="journal_memory_exceeded", retry_after_s=30)
        return self._refusal

    async def grow(self, used: int) -> bool:
        """Reserve chunks until ``used`` bytes fit; False when a bound refuses. Redis failing
        here does not end the stream (its journal writes fail the same way, and retry)."""
        try:
            return await self.reserve(max(CHUNK_BYTES, used - self.reserved + CHUNK_BYTES)) is None
        except (RedisError, OSError) as exc:
            log.warning("could not reserve journal memory for %s: %s", self._scope, exc)
            self.reserved = used + CHUNK_BYTES  # try again a chunk later
            return True

    def refusal(self) -> SluiceError:
        assert self._refusal is not None
        return self._refusal

    async def settle(self, used: int, hold_ms: int) -> None:
        """The stream ended: it holds what it wrote, for as long as its journal is kept."""
        await self._quota.call_settle([self._scope, used, hold_ms])

    async def release(self) -> None:
        """The stream never started: it holds nothing."""
        await self._quota.call_settle([self._scope, 0, 0])
