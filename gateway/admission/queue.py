"""Admission: one priority queue per model in Redis, shared by every gateway replica.

A request asks for all the slots it needs (one per generation) at once; it gets
them together on live workers, or waits in the model's queue until released slots
are handed to it (all of them, in one grant), its queue timeout passes (429 +
``Retry-After``), or its client leaves (it is removed from the queue). Queue order,
fairness between tenants and urgent headroom are described in gateway/admission/scripts.py.

Waiting costs no Redis connection: the grant arrives through this process's
:class:`~gateway.admission.grants.GrantListener`. Every granted slot is a lease that this
process renews while the stream runs; the same beat keeps this process marked
alive, so the queue drops the entries of a gateway that died instead of handing
them slots. One gateway process per period reclaims the leases of gateways that died
(gateway/admission/reaper.py). The same beat watches the registry's epoch (sluice/directory.py):
when Redis loses its data, this process queues its waiting requests again.

Clocks: queue deadlines and lease expiries are computed in Lua from Redis ``TIME``
and relative timeouts; this process only uses ``time.monotonic()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, cast

import orjson
from redis.exceptions import RedisError

from gateway.admission import scripts
from gateway.admission.grants import GrantListener, GrantMessage
from gateway.admission.reaper import Reaper
from gateway.config import GatewaySettings
from sluice import keys, redis_faults
from sluice.aftercare import detach, to_the_end
from sluice.directory import Directory, Epoch
from sluice.errors import (
    InvalidRequest,
    ModelNotFound,
    RateLimited,
    SluiceError,
    Unavailable,
)
from sluice.script_channel import Packed, ScriptChannel, script_runner
from sluice.tasks import GENERATE, ROUTES, Task

log = logging.getLogger("sluice.admission")

#: A gateway process that has not beaten for this long counts as dead: its queued
#: requests are dropped instead of granted.
GATEWAY_TTL_S = 3.0
_BEAT_S = 1.0

#: First tokens are reported to Redis in batches at most this often (cache routing).
_PREFILLED_BATCH_S = 0.02

#: Times a request asks again after a grant it could not claim in time.
_CLAIM_RETRIES = 2

#: Longest wait, after a request's queue timeout, for the queue's length and drain rate that
#: its 429 reports (two more Redis round trips): a failing-over Cluster held a hundred 429s
#: for up to 25 s past their 10 s queue timeouts (nemesis, Cluster, 6ec4b61).
HINT_S = 1.0

#: The code of a 503 for a model the registry does not know while it is being rebuilt.
REGISTRY_REBUILDING = "registry_rebuilding"
#: Why a request is a 503 ``registry_rebuilding``, ending its message.
_REBUILDING_WHY = "Redis lost its data moments ago and workers are registering again"
#: Seconds the most slots a model's live workers held stay its capacity when fewer are live:
#: a request too big for the live workers but not for that is a 503 to retry, not a 400
#: (a worker restarting, stopped, or not yet beaten since Redis came back). A fleet scaled
#: down for good answers 400 again after this.
CAPACITY_KEPT_S = 300.0

#: Models this process was granted slots of lately, remembered (bounded) so that a model whose
#: workers Redis forgot is a 503 to retry rather than a 404.
_KNOWN_MODELS = 256


class _GrantLost(Exception):
    """A published grant whose leases expired before this process claimed them."""


class ClientGone(SluiceError):
    """The client disconnected while its request waited (nginx's 499)."""

    status = 499
    type = "client_closed_request"


def as_sluice_error(exc: BaseException) -> SluiceError:
    """What the client is told about an exception that is not already a SluiceError."""
    if isinstance(exc, SluiceError):
        return exc
    if isinstance(exc, asyncio.CancelledError):
        return ClientGone("the request was cancelled")
    if isinstance(exc, (RedisError, OSError)):
        return redis_faults.unavailable(exc, log_it=False)
    return SluiceError("internal error in the gateway")


async def stop_tasks(tasks: list[asyncio.Task[None]], grace_s: float = 2.0) -> None:
    """Cancel background tasks and wait for them, but not forever: a task cancelled in the
    middle of a Redis reply may take its connection's clean-up with it. A cancellation can
    also be lost: one that lands while redis-py connects, inside its timeout block, is
    swallowed there, and the task goes on to its next sleep (a gateway shut down right after
    it started hung in its key keeper's close: tests/test_taken_ports.py, 1 run in 5). So
    the tasks are cancelled again until they end."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    pending = {task for task in tasks if not task.done()}
    while pending and loop.time() < deadline:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(0.1, max(0.0, deadline - loop.time())))


@dataclass(frozen=True, slots=True)
class QueueCharge:
    """What one lease's grant charged to its tenant's fair share: ``tokens``, its part of
    the request's estimated cost, in the urgent or the normal class. The lease's release
    corrects it with the generation's real usage (a request of ``shares`` generations
    counts a share of each one's prompt, so its prompt is counted once)."""

    tenant: str
    urgent: bool
    tokens: int
    shares: int = 1

    def correction(self, usage: Mapping[str, Any]) -> int:
        """Tokens really used minus tokens charged (negative: charged too much)."""
        used = int(usage.get("completion_tokens", 0)) + int(usage.get("prompt_tokens", 0)) // self.shares
        return used - self.tokens


@dataclass(frozen=True, slots=True)
class Lease:
    """A worker slot granted to one generation; hand it back with :meth:`Admission.release`."""

    model: str
    lease_id: str
    worker_id: str
    url: str
    #: Leading prompt blocks the prefix index expected this worker to hold (cache routing).
    matched_blocks: int = 0
    #: Blocks this lease added to its worker's pending prefill (cache routing), until its
    #: first token (:meth:`Admission.prefilled`) or its release.
    prefill_blocks: int = 0
    #: Its grant's charge to the tenant's fair share; None when the grant charged nothing
    #: (a retry or a migration).
    charge: QueueCharge | None = None


@dataclass(frozen=True, slots=True)
class Ask:
    """What one admission asks for.

    ``need`` slots at once (a request's generations); ``cost`` in tokens, charged to
    ``tenant``'s fair share; ``boost`` for retries and migrations (first in line,
    never refused for queue length); ``exclude`` names workers that already failed it;
    ``blocks``: the prompt's block hashes (:mod:`sluice.prefix`), for cache routing;
    ``task``: only workers serving it are granted (:mod:`sluice.tasks`);
    ``session``: the session's routing key (:mod:`gateway.admission.affinity`), "" for none;
    ``adapter``: the LoRA adapter asked for, served by ``model`` (its parent), "" for none;
    ``role``: one hop of a disaggregated request takes only workers of that role
    (:mod:`sluice.roles`), "" (a whole request) any worker.
    """

    model: str
    request_id: str
    priority: int = 0
    need: int = 1
    timeout_s: float = 30.0
    tenant: str = "-"
    cost: int = 1
    boost: bool = False
    exclude: tuple[str, ...] = ()
    blocks: tuple[str, ...] = ()
    task: Task = GENERATE
    session: str = ""
    adapter: str = ""
    role: str = ""


@dataclass(eq=False, slots=True)
class _Waiter:
    """A request of this process waiting in its model's queue."""

    ask: Ask
    deadline: float  # time.monotonic()
    future: asyncio.Future[GrantMessage]
    #: Held while the waiter leaves or is queued again, so the two never cross.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    left: bool = False
    #: Not in Redis's queue: Redis lost it with its data, and it is not queued again yet.
    lost: bool = False
    #: How many times it was queued again (:meth:`Admission.after_look` tells a missing entry
    #: read before a re-queue from one that is still missing).
    asks: int = 0


def _tenant_name(tenant: str) -> str:
    """A tenant as the normal queue's member names can hold it (``|`` and ``}`` delimit)."""
    return tenant.replace("|", "_").replace("}", "_") or "-"


class Admission:
    def __init__(self, redis: Any, settings: GatewaySettings,
                 since_loss_s: Callable[[], float] = lambda: math.inf) -> None:
        self._redis = redis
        self._s = settings
        #: Seconds since this process last saw Redis lose data (LossWatch.since_loss_s).
        self._since_loss_s = since_loss_s
        #: This process's identity in the queue: grants are addressed to it.
        self.gateway_id = uuid.uuid4().hex[:16]
        # Two of these scripts run per request: one pipelined connection where Redis is one
        # plain server (sluice/script_channel.py), redis-py's scripts otherwise.
        self._runner = script_runner(redis)
        # What leads every script's arguments (ARGV[1..6], the prelude's): packed once for a
        # channel, as every call packed them before.
        common = (self.gateway_id, int(settings.lease_ttl_s * 1000), int(GATEWAY_TTL_S * 1000),
                  settings.reserved_slots, settings.urgent_priority_max, settings.priority_step_tokens)
        self._common: list[object] = [Packed(common)] if isinstance(self._runner, ScriptChannel) else list(common)
        self._acquire = self._runner.register_script(scripts.ACQUIRE)
        self._release = self._runner.register_script(scripts.RELEASE)
        self._cancel = self._runner.register_script(scripts.CANCEL)
        self._reap = self._runner.register_script(scripts.REAP)
        self._renew = self._runner.register_script(scripts.RENEW)
        self._retry_after = self._runner.register_script(scripts.RETRY_AFTER)
        self._prefilled_script = self._runner.register_script(scripts.PREFILLED)
        self._live = self._runner.register_script(scripts.LIVE)
        self._reclaim = self._runner.register_script(scripts.RECLAIM)
        self.grants = GrantListener(redis, self.gateway_id)
        self._active: dict[str, Lease] = {}  # lease id -> lease, renewed in the background
        self._queued: dict[str, int] = {}  # model -> requests of this process waiting in it
        self._prefilled: dict[str, list[str]] = {}  # model -> leases past their first token, not yet told
        self._prefilled_due = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.reaper = Reaper(redis, settings, self._reap_model, self.gateway_id)
        self._directory = Directory(redis)
        self._epoch: str | None = None  # the registry epoch this process queued its waiters in
        self._waiters: dict[str, _Waiter] = {}  # request id -> waiter, in arrival order
        self._known: OrderedDict[str, float] = OrderedDict()  # model -> last grant (monotonic)

    def __repr__(self) -> str:
        return f"Admission(gateway={self.gateway_id}, active_leases={len(self._active)}, {self.grants!r})"

    async def start(self) -> None:
        with contextlib.suppress(RedisError, OSError):  # Redis down: the first beat learns it
            self._epoch = (await self._directory.epoch(None)).id
        self._tasks = [
            asyncio.create_task(self._beat_loop(), name="admission-beat"),
            asyncio.create_task(self.reaper.run(), name="lease-reaper"),
            asyncio.create_task(self._prefilled_loop(), name="prefilled-reporter"),
        ]

    async def close(self) -> None:
        await stop_tasks(self._tasks)
        await self.grants.close()
        if isinstance(self._runner, ScriptChannel):
            await self._runner.aclose()

    def _args(self, *extra: object) -> list[object]:
        return [*self._common, *extra]

    async def acquire(self, ask: Ask, disconnected: Callable[[], Awaitable[bool]] | None = None) -> list[Lease]:
        """``ask.need`` slots now, or after waiting in the queue up to ``ask.timeout_s``.

        A grant that reached this process too late to be claimed (its leases already
        reclaimed: this process was too busy for seconds) is not used: the request asks
        again, first in line."""
        for attempt in range(_CLAIM_RETRIES + 1):
            try:
                return await self._acquire_once(ask, disconnected)
            except _GrantLost:
                if attempt == _CLAIM_RETRIES:
                    raise Unavailable("this gateway is too busy to claim its grants", retry_after_s=1) from None
                ask = replace(ask, request_id=f"{ask.request_id}r", boost=True)
        raise AssertionError("unreachable")

    async def _acquire_once(
        self, ask: Ask, disconnected: Callable[[], Awaitable[bool]] | None
    ) -> list[Lease]:
        model = ask.model
        future = self.grants.expect(model, ask.request_id)
        self._queued[model] = self._queued.get(model, 0) + 1
        try:
            result = await self._ask(ask, ask.timeout_s)
            status = result[0].decode()
            live: int | None = None  # live workers counted since ACQUIRE said 'none'
            if status == "none" and not ask.exclude and (live := await self.live_workers(model)) > 0:
                # The model's workers had all missed a heartbeat when ACQUIRE ran, and one has
                # beaten since: ask once more rather than refuse. (A CI run on a loaded Cluster
                # refused 210 of 600 requests so, each told "every live worker failed this
                # request" though none had been tried: a worker's beat is three round trips there.)
                result = await self._ask(ask, ask.timeout_s)
                status = result[0].decode()
            if status == "granted":
                return self._granted(ask, result[1])
            if status == "none":
                raise await self._no_worker(model, bool(ask.exclude), ask.role, live)
            if status == "untasked":
                if await self._rebuilding():
                    raise Unavailable(
                        f"no live worker of model '{model}' serves {ROUTES.get(ask.task, ask.task)} yet: "
                        f"{_REBUILDING_WHY}", retry_after_s=2, code=REGISTRY_REBUILDING)
                raise InvalidRequest(
                    f"no live worker of model '{model}' serves {ROUTES.get(ask.task, ask.task)}: task '{ask.task}' "
                    "is not served", param="model", code="task_not_served")
            if status == "short":
                raise Unavailable(
                    f"this request needs {ask.need} generations at once; the live workers of '{model}' hold "
                    f"{int(result[1])} now, {int(result[2])} lately (workers are missing)", retry_after_s=2)
            if status == "too_big":
                if await self._rebuilding():
                    raise Unavailable(
                        f"this request needs {ask.need} generations at once; the live workers of '{model}' hold "
                        f"{int(result[1])} now: {_REBUILDING_WHY}", retry_after_s=2, code=REGISTRY_REBUILDING)
                raise InvalidRequest(
                    f"this request needs {ask.need} generations at once; the live workers of '{model}' "
                    f"hold {int(result[1])}: lower n or send fewer prompts", param="n")
            if status == "full":
                raise RateLimited(
                    f"the queue for '{model}' is full ({int(result[1])} waiting)",
                    retry_after_s=await self.retry_after_s(model, int(result[1])), code="queue_full",
                )
            self.grants.listen(model, result[2])
            return await self._wait(_Waiter(ask, time.monotonic() + ask.timeout_s, future), disconnected)
        finally:
            self.grants.forget(model, ask.request_id)
            self._queued[model] -= 1
            if not self._queued[model]:
                del self._queued[model]  # keyed by what clients name: nothing stays

    async def _ask(self, ask: Ask, timeout_s: float) -> list[Any]:
        """ACQUIRE for ``ask``, queueing it for at most ``timeout_s``.

        Cancelled meanwhile (the client left during a migration's re-acquire, the request's
        deadline), the call still runs to its answer, and what Redis did is undone: a grant
        is released, a queue entry removed. Otherwise the grant would hold its slot for a
        lease TTL, and the entry would wait for a waiter that is gone. That runs on its own
        (:func:`sluice.aftercare.detach`): the cancelled request answers at once."""
        call = asyncio.ensure_future(self._acquire(
            keys=keys.admission(ask.model),
            args=self._args(ask.request_id, ask.priority, ask.need, max(1, int(timeout_s * 1000)),
                            self._s.max_queue, orjson.dumps(ask.exclude),
                            int(ask.boost), _tenant_name(ask.tenant), ask.cost,
                            orjson.dumps(ask.blocks), self._s.routing, self._s.route_load_blocks,
                            self._s.route_hot_share,
                            self._s.route_least_pending_weight if self._s.routing == "least"
                            else self._s.route_prefill_weight, ask.task,
                            ask.session if self._s.session_affinity != "off" else "", self._s.session_affinity,
                            self._s.session_load_bound, self._s.session_cost_blocks, ask.adapter, ask.role,
                            self._s.route_least_spread, self._s.route_sample),
        ))
        try:
            return cast(list[Any], await asyncio.shield(call))
        except asyncio.CancelledError:
            detach(self._undo(ask, call), f"undoing the admission of cancelled request {ask.request_id}")
            raise

    async def _undo(self, ask: Ask, call: asyncio.Future[Any]) -> None:
        """What a cancelled ACQUIRE did, undone once it answers."""
        with contextlib.suppress(RedisError, OSError):
            result = await call
            if result[0] == b"granted":
                for lease in self._granted(ask, result[1]):
                    await self.release(lease)
            elif result[0] == b"queued":
                await self._leave_and_release(ask)

    async def _wait(self, waiter: _Waiter, disconnected: Callable[[], Awaitable[bool]] | None) -> list[Lease]:
        ask = waiter.ask
        self._waiters[ask.request_id] = waiter  # in arrival order, for a re-queue
        try:
            while (remaining := waiter.deadline - time.monotonic()) > 0:
                with contextlib.suppress(TimeoutError):
                    message = await asyncio.wait_for(asyncio.shield(waiter.future), min(remaining, 1.0))
                    if not message.ok and ask.need > 1 and not ask.exclude:
                        raise Unavailable(f"the live workers of '{ask.model}' no longer hold the {ask.need} "
                                          "slots this request needs at once", retry_after_s=2)
                    if not message.ok:
                        raise await self._no_worker(ask.model, True)
                    leases = self._granted(ask, message.slots)
                    await self._claim(leases)
                    return leases
                if disconnected is not None and await disconnected():
                    await self._depart_and_release(waiter)
                    raise ClientGone("client disconnected while queued")
        except asyncio.CancelledError:
            await to_the_end(self._depart_and_release(waiter))
            raise
        finally:
            self._waiters.pop(ask.request_id, None)
        leases = await self._depart(waiter)
        if leases:
            await self._claim(leases)
            return leases  # granted at the last moment: serve it
        if waiter.lost:  # Redis lost it, and no worker of the model has come back since
            raise Unavailable(f"model '{ask.model}' has no live worker", retry_after_s=2)
        try:  # the queue's length and drain rate only inform the answer: they do not hold it up
            async with asyncio.timeout(HINT_S):
                position = await self._position(ask.model)
                retry_after_s = await self.retry_after_s(ask.model, position)
            waiting = f"{position} waiting"
        except (TimeoutError, RedisError, OSError):
            waiting, retry_after_s = "Redis did not say how many wait", self._unknown_retry_after_s()
        raise RateLimited(f"no capacity for '{ask.model}' within the queue timeout ({waiting})",
                          retry_after_s=retry_after_s, code="queue_timeout")

    async def _depart_and_release(self, waiter: _Waiter) -> None:
        """The waiter leaves the queue, and gives back what it was granted meanwhile."""
        for lease in await self._depart(waiter):
            await self.release(lease)

    async def _depart(self, waiter: _Waiter) -> list[Lease]:
        """The waiter leaves the queue (after any re-queue of it in flight has landed)."""
        async with waiter.lock:
            waiter.left = True
            return await self._leave(waiter.ask)

    async def _lease_again(self) -> int:
        """The streams this process runs hold their slots again: Redis forgot their leases,
        and without them their workers would look free and be given more than they hold.
        Returns how many leases Redis lacked."""
        by_model: dict[str, list[str]] = {}
        for lease in self._active.values():
            by_model.setdefault(lease.model, []).extend((lease.lease_id, lease.worker_id))
        missing = 0
        for model, pairs in by_model.items():
            missing += int(await self._reclaim(keys=keys.admission(model), args=self._args(*pairs)))
        return missing

    async def _requeue(self) -> None:
        """Queue again, in their arrival order and with their priority and what is left of
        their timeouts, this process's waiters that Redis lost with its data. One whose
        model has no live worker yet (none has beaten since) is tried again next beat."""
        for waiter in list(self._waiters.values()):
            if not waiter.lost:
                continue
            async with waiter.lock:
                remaining = waiter.deadline - time.monotonic()
                if not waiter.lost or waiter.left or waiter.future.done() or remaining <= 0:
                    continue
                waiter.asks += 1
                result = await self._ask(waiter.ask, remaining)
                if result[0] == b"granted":
                    waiter.lost = False
                    if waiter.future.done():  # answered meanwhile after all: this grant is not needed
                        for lease in self._granted(waiter.ask, result[1]):
                            await self.release(lease)
                    else:
                        waiter.future.set_result(GrantMessage.parse(b"ok", result[1]))
                elif result[0] == b"queued":
                    waiter.lost = False
                    self.grants.listen(waiter.ask.model, result[2])

    async def after_look(self, lost: bool) -> bool:
        """A :class:`~gateway.loss_watch.LossWatch` listener: after Redis may have lost writes
        that left the epoch as it was (a Cluster node back empty or failed over to a replica
        without the last writes, while the epoch lives on another node; a restart from an
        older snapshot), the streams this process runs lease their slots again, and its
        waiters whose queue entries are gone are queued again. Without it they waited out
        their queue timeout for a grant nobody would send, and got 429 with "0 waiting"
        (the nemesis, Cluster). A Redis error fails the look: it is tried again at the next."""
        if not lost:
            return True
        leased = await self._lease_again()  # idempotent: RECLAIM adds only the leases Redis lacks
        if leased:
            log.warning("Redis lost the leases of %d running stream(s) of this process; leased again", leased)
        by_model: dict[str, list[_Waiter]] = {}
        for waiter in self._waiters.values():
            if not (waiter.left or waiter.lost or waiter.future.done()):
                by_model.setdefault(waiter.ask.model, []).append(waiter)
        gone = 0
        for model, waiters in by_model.items():
            asked = [w.asks for w in waiters]
            metas = await self._redis.hmget(keys.admission(model).queue_meta, [w.ask.request_id for w in waiters])
            for waiter, meta, asks in zip(waiters, metas, asked, strict=True):
                # Only an entry still missing: not one the epoch's re-queue (the beat) wrote
                # meanwhile, or is writing (then it is marked lost already), which a second
                # re-queue would have queued twice. A grant on its way has removed the entry
                # too: queued again, the second grant is released (:meth:`_requeue`) or, if
                # the first comes later, left unclaimed to expire.
                if meta is None and waiter.asks == asks and not (waiter.lost or waiter.left or waiter.future.done()):
                    waiter.lost = True
                    gone += 1
        if gone:
            log.warning("Redis lost the queue entries of %d waiting request(s) of this process; queueing them "
                        "again", gone)
            await self._requeue()
        return True

    async def _watch_epoch(self) -> Epoch:
        """The registry's epoch. A new one means Redis lost its data, and with it this
        process's queue entries (sluice/directory.py): they are queued again."""
        epoch = await self._directory.epoch(self._epoch)
        if self._epoch is not None and epoch.id != self._epoch:
            log.warning("Redis lost its data (new registry epoch); leasing the slots of %d running stream(s) "
                        "and queueing %d waiting request(s) again", len(self._active), len(self._waiters))
            for waiter in self._waiters.values():
                waiter.lost = True
            await self._lease_again()
        self._epoch = epoch.id
        if any(waiter.lost for waiter in self._waiters.values()):
            await self._requeue()
        return epoch

    async def _claim(self, leases: list[Lease]) -> None:
        """Renew a published grant's leases now: unclaimed, they expire within seconds.
        Raises :class:`_GrantLost` (its slots released) when some were already reclaimed."""
        try:
            lost = await self._renew(keys=keys.admission(leases[0].model),
                                     args=self._args(*(lease.lease_id for lease in leases)))
        except (RedisError, OSError) as exc:
            log.warning("could not claim leases %s: %s", [x.lease_id for x in leases], exc)
            return
        if lost:
            log.warning("grant for %s came too late to claim (%d lease(s) reclaimed); asking again",
                        leases[0].lease_id.rsplit("#", 1)[0], len(lost))
            for lease in leases:
                await self.release(lease)
            raise _GrantLost

    async def _position(self, model: str) -> int:
        urgent, normal = keys.queues(model)
        return int(await self._redis.zcard(urgent)) + int(await self._redis.zcard(normal))

    async def _leave_and_release(self, ask: Ask) -> None:
        for lease in await self._leave(ask):
            await self.release(lease)

    async def _leave(self, ask: Ask) -> list[Lease]:
        """Leave the queue; if a grant raced in, return it (the caller serves or releases it)."""
        result = await self._cancel(keys=keys.admission(ask.model), args=self._args(ask.request_id, ask.need))
        if result[0] == b"granted":
            return self._granted(ask, result[1])
        return []

    def _granted(self, ask: Ask, slots: bytes | tuple[tuple[Any, ...], ...]) -> list[Lease]:
        model = ask.model
        parsed = orjson.loads(slots) if isinstance(slots, bytes) else slots
        # The scripts charged ask.cost to the tenant (nothing for a boosted ask); each lease
        # carries its part, to be corrected with its generation's usage at its release.
        share, rest = divmod(ask.cost, len(parsed) or 1)
        urgent = ask.priority <= self._s.urgent_priority_max
        leases = [Lease(model=model, lease_id=lease_id, worker_id=worker, url=url,
                        matched_blocks=int(route[0]) if route else 0,
                        prefill_blocks=int(route[1]) if len(route) > 1 else 0,
                        charge=None if ask.boost else QueueCharge(_tenant_name(ask.tenant), urgent,
                                                                   share + (i < rest), len(parsed)))
                  for i, (lease_id, worker, url, *route) in enumerate(parsed)]
        for lease in leases:
            self._active[lease.lease_id] = lease
        self._known[model] = time.monotonic()
        self._known.move_to_end(model)
        if len(self._known) > _KNOWN_MODELS:
            self._known.popitem(last=False)
        return leases

    async def _no_worker(self, model: str, retried: bool, role: str = "", live: int | None = None) -> SluiceError:
        """Why no worker was granted. ``live``: the live workers, if counted a moment ago."""
        if not retried and (live if live is not None else await self.live_workers(model)) == 0:
            return await self.missing_model(model)
        if role and not retried:
            return Unavailable(f"model '{model}' has no live {role} worker", retry_after_s=1)
        if not retried:  # none was live when it was admitted, and none was tried
            return Unavailable(f"model '{model}' has no live worker", retry_after_s=1)
        return Unavailable(f"every live worker for '{model}' failed this request", retry_after_s=1)

    async def missing_model(self, model: str) -> SluiceError:
        """No live worker serves ``model``: 404 when nothing says it exists; 503 + Retry-After
        when it is listed, this process served it lately, or the registry is young (Redis
        lost its data and workers have not all beaten since). SDKs retry a 503, not a 404."""
        seen = self._known.get(model)
        if (seen is not None and time.monotonic() - seen < keys.MODEL_FORGET_S) or await self._directory.listed(model):
            return Unavailable(f"model '{model}' has no live worker", retry_after_s=2)
        # A new epoch; or, on a Cluster, one node that lost its data while the epoch's node
        # kept it (CI, test_key_data_loss: the model 404 right after its node restarted empty).
        if (await self._watch_epoch()).rebuilding or self._since_loss_s() < keys.REGISTRY_REBUILD_S:
            # Maybe a model, maybe a typo: the code says so (no metrics series for the name).
            return Unavailable(f"model '{model}' is not registered (yet): {_REBUILDING_WHY}", retry_after_s=2,
                               code=REGISTRY_REBUILDING)
        return ModelNotFound(f"The model '{model}' does not exist", param="model")

    async def _rebuilding(self) -> bool:
        """Whether Redis lost its data moments ago (sluice/directory.py), so the registry may
        lack workers that have not beaten since. Unlike :meth:`missing_model`, a young registry
        nobody marked as following a loss counts as whole: what it lacks is 400 at once."""
        epoch = await self._watch_epoch()
        return (epoch.after_loss and epoch.rebuilding) or self._since_loss_s() < keys.REGISTRY_REBUILD_S

    async def release(self, lease: Lease, usage: Mapping[str, Any] | None = None) -> None:
        """Give the slot back; with Redis unreachable the lease simply expires and is reaped.
        ``usage``: its generation's real usage, which corrects what its grant charged to the
        tenant's fair share, before the slot goes to the next request."""
        self._active.pop(lease.lease_id, None)
        args = self._args(lease.lease_id, self._s.route_sample)
        if usage is not None and lease.charge is not None:
            args += [lease.charge.tenant, 1 if lease.charge.urgent else 2, lease.charge.correction(usage)]
        try:
            await self._release(keys=keys.admission(lease.model), args=args)
        except (RedisError, OSError) as exc:
            log.warning("could not release lease %s (%s); it will expire", lease.lease_id, exc)

    def prefilled(self, lease: Lease) -> None:
        """The lease's first token arrived: its prompt is prefilled, so its blocks leave its
        worker's pending prefill (cache routing). Batched off the request's path: one Redis
        call per model every :data:`_PREFILLED_BATCH_S` at most, whatever the request rate."""
        if lease.prefill_blocks > 0:
            self._prefilled.setdefault(lease.model, []).append(lease.lease_id)
            self._prefilled_due.set()

    async def _prefilled_loop(self) -> None:
        while True:
            await self._prefilled_due.wait()
            await asyncio.sleep(_PREFILLED_BATCH_S)
            await self.report_prefilled()

    async def report_prefilled(self) -> None:
        """Tell Redis now what :meth:`prefilled` collected (the reporter does it every
        :data:`_PREFILLED_BATCH_S`; a test in virtual time, at once)."""
        self._prefilled_due.clear()
        batch, self._prefilled = self._prefilled, {}
        for model, lease_ids in batch.items():
            try:
                await self._prefilled_script(keys=keys.admission(model), args=self._args(*lease_ids))
            except (RedisError, OSError) as exc:
                # Not lost: the lease's release takes the blocks off instead.
                log.warning("could not report %d prefilled lease(s): %s", len(lease_ids), exc)

    async def retry_after_s(self, model: str, position: int) -> float:
        """Seconds until ``position`` requests ahead have drained at the recent service rate."""
        seconds = int(await self._retry_after(keys=keys.admission(model), args=self._args(position)))
        if seconds < 0:
            return self._unknown_retry_after_s()
        return float(min(max(1, seconds), 120))

    def _unknown_retry_after_s(self) -> float:
        """Retry-After when the drain rate is not known: the queue timeout, a minute at most."""
        return float(min(self._s.queue_timeout_s, 60))

    async def queue_depths(self, model: str) -> dict[str, int]:
        """Waiting requests per priority class (counters kept by the scripts)."""
        raw = await self._redis.hgetall(keys.admission(model).depth)
        depths = {"urgent": 0, "default": 0, "low": 0}
        depths.update({k.decode(): max(0, int(v)) for k, v in raw.items()})
        return depths

    async def unreachable(self, lease: Lease) -> None:
        """Nothing answers at a worker's address (it crashed): stop granting its slots now, for
        every gateway, instead of when its heartbeat lapses (a few seconds in which every
        retry could land on it). A worker that is alive after all puts itself back with its
        next heartbeat."""
        try:
            await self._redis.hdel(keys.alive(lease.model), lease.worker_id)
        except (RedisError, OSError) as exc:
            log.warning("could not mark worker %s unreachable: %s", lease.worker_id, exc)

    async def live_workers(self, model: str) -> int:
        return int(await self._live(keys=[keys.workers(model), keys.alive(model)]))

    async def live_models(self) -> list[str]:
        models = sorted(m.decode() for m in await self._redis.smembers(keys.MODELS))
        return [m for m in models if await self.live_workers(m) > 0]

    async def _beat_loop(self) -> None:
        """Keep this process alive in every model it waits in, and renew its leases."""
        lease_period = self._s.lease_ttl_s / 3
        last_renewal = time.monotonic()
        while True:
            await asyncio.sleep(min(_BEAT_S, lease_period))
            due = time.monotonic() - last_renewal >= lease_period
            if due:
                last_renewal = time.monotonic()
            by_model: dict[str, list[str]] = {m: [] for m, n in self._queued.items() if n > 0}
            if due:
                for lease_id, lease in list(self._active.items()):
                    by_model.setdefault(lease.model, []).append(lease_id)
            try:
                await self._watch_epoch()
            except (RedisError, OSError) as exc:
                log.warning("registry epoch check failed: %s", exc)
            for model, lease_ids in by_model.items():
                try:
                    lost = await self.renew(model, lease_ids)
                except (RedisError, OSError) as exc:
                    log.warning("lease renewal failed: %s", exc)
                    continue
                if lost:
                    log.warning("%d lease(s) of this gateway expired before renewal (reaped): %s",
                                len(lost), ", ".join(lost[:5]))

    async def renew(self, model: str, lease_ids: list[str]) -> list[str]:
        """Push back the expiry of these leases (and keep this process alive in ``model``);
        the ones Redis no longer has although their streams still hold them: reaped. A lease
        released after the ids were collected is gone too, and not lost: one of a stream that
        ended in the meantime (at 860 one-token requests a second on an H100, three a minute
        were logged as reaped)."""
        gone = await self._renew(keys=keys.admission(model), args=self._args(*lease_ids))
        return [lease_id for lease_id in map(bytes.decode, gone) if lease_id in self._active]

    async def _reap_model(self, model: str, reconcile: bool) -> tuple[int, int]:
        expired, corrections = await self._reap(keys=keys.admission(model),
                                                args=self._args(int(reconcile), int(CAPACITY_KEPT_S * 1000)))
        return int(expired), int(corrections)

    async def reap_once(self, reconcile: bool | None = None) -> int:
        """Reclaim expired leases of every model now, whichever process reaps this period
        (gateway/admission/reaper.py); when asked, also recount slots in use from the leases."""
        return await self.reaper.reap_once(reconcile, contend=False) or 0
