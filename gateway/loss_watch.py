"""Noticing that Redis may have lost writes: one watcher per gateway process.

Redis loses writes when it restarts without persistence (or from a snapshot older than the
last writes), on ``FLUSHALL``, when a failover promotes a replica that lacked the last
writes, and on a Cluster when one node comes back empty while the registry's epoch, on
another node, stays as it was. Every :data:`CHECK_S` the watcher reads the epoch and which
server processes answer (``Directory.look``), and after each look calls every listener
with ``lost`` set when, since the look before:

- the epoch changed, or is gone (the registry went with the data);
- other server processes answer (a restart, a failover);
- Redis answers again after being away (a restart from a snapshot keeps the epoch).

Listeners are the process's keepers of what Redis may lose: the API key records it verified
(gateway/admission/key_keeper.py) and the finished journals it produced
(gateway/streams/journal_keeper.py). A listener whose write-back failed (it returns False or
raises a Redis error: a node back but not serving yet) is called with ``lost`` again at the
next look, the others not.

The watcher also says how long ago this process saw such a change (:meth:`since_loss_s`)
and how much longer writes may still be on their way back (:meth:`unsure_s`): admission
tells an unknown model, and the key keeper an unknown key, from a lost one by it; an
Idempotency-Key Redis does not know waits that long before a new generation starts.

>>> watch = LossWatch(redis)
>>> watch.listen(keeper.after_look)
>>> watch.start()
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisClusterException, RedisError

from gateway.admission.queue import stop_tasks
from sluice import keys
from sluice.directory import Directory

log = logging.getLogger("sluice.loss")

#: How often Redis is looked at.
CHECK_S = 0.5
#: Without an answer from Redis for this long (Redis away, or this process stalled), a
#: loss may have happened unnoticed.
BLIND_S = 3.0
_UNSEEN = b"\0unseen"

#: Called after every look: ``lost`` when Redis may have lost writes since the listener's
#: last successful call. Returns False (or raises a Redis error) when its write-back failed.
Listener = Callable[[bool], Awaitable[bool]]


async def warn_if_evicting(redis: Any) -> None:
    """Say at start when Redis may evict keys: Sluice's live state (leases, queues, journals,
    idempotency records) all has TTLs, so any policy but ``noeviction`` can drop it under
    memory pressure, and no look of the watch sees an eviction as a loss (so no write-back
    follows, and a re-attach is told at once that its stream is gone). Of a Redis that
    refuses ``CONFIG`` (a managed one), only the debug log says so."""
    try:
        found = await redis.config_get("maxmemory-policy")
    except (RedisError, RedisClusterException, OSError) as exc:
        log.debug("Redis's maxmemory-policy could not be read: %s", exc)
        return
    policy = found.get("maxmemory-policy")  # (a Cluster client asks its default node)
    if policy is not None and policy not in ("noeviction", b"noeviction"):
        log.warning("Redis's maxmemory-policy is %s: under memory pressure it evicts Sluice's leases, queues "
                    "and resumable streams unseen; set maxmemory-policy noeviction", policy)


class LossWatch:
    """Watches one Redis for lost writes (see the module)."""

    def __init__(self, redis: Any, *, check_s: float = CHECK_S) -> None:
        self._directory = Directory(redis)
        self._check_s = check_s
        self._listeners: list[Listener] = []
        self._owed: list[bool] = []  # per listener: a write-back it still owes
        self._owed_since: float | None = None  # since when one is owed (monotonic)
        self._epoch: bytes | None = _UNSEEN
        self._server: str | None = None  # the run_ids last seen (Directory.look)
        self._changed_at = -math.inf  # when Redis was last away or other servers answered (monotonic)
        self._looked_at = -math.inf  # the last answer from Redis (monotonic)
        self._reported: tuple[bytes | None, str] | None = None  # the last loss confirm reported
        self._task: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"<LossWatch listeners={len(self._listeners)} since_loss_s={self.since_loss_s():.1f}>"

    def listen(self, listener: Listener) -> None:
        self._listeners.append(listener)
        self._owed.append(False)

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="loss-watch")

    async def close(self) -> None:
        if self._task is not None:
            await stop_tasks([self._task])

    @property
    def seen_epoch(self) -> str | None:
        """The registry epoch's id at the last look (None: none seen yet, or none there)."""
        return self._epoch.decode() if isinstance(self._epoch, bytes) and self._epoch != _UNSEEN else None

    def since_loss_s(self) -> float:
        """Seconds since this process last saw Redis lose data or be away (0 while it has no
        fresh look at Redis; inf: never). On a Cluster, one node restarted empty leaves the
        epoch (on another node) as it was: the registry's missing models are then told from
        typos by this (Admission.missing_model)."""
        if self._blind():
            return 0.0
        return time.monotonic() - self._changed_at

    def unsure_s(self) -> float:
        """How much longer writes Redis may have lost could still be on their way back from
        the gateway processes that keep copies (0: none known): while this process has no
        fresh look at Redis, while one of its own write-backs has yet to succeed (for at most
        :data:`~sluice.keys.REGISTRY_REBUILD_S`), and for
        :data:`~sluice.keys.API_KEYS_RESTORE_S` after that (or after a change it saw). The
        window counts from the end of this process's write-backs, not from the look that
        started them: the other processes' write-backs meet the same Redis. (The nemesis,
        Cluster: a node back but the cluster not serving yet failed every write-back for
        seconds; the window, counted from the look, ran out first, and two gateways answered
        401 for a valid key that the one gateway keeping it wrote back a moment later.)"""
        if self._blind() or (self._owed_since is not None
                             and time.monotonic() - self._owed_since < keys.REGISTRY_REBUILD_S):
            return self._check_s  # (a write-back failing for longer is not a loss on its way back)
        return max(0.0, self._changed_at + keys.API_KEYS_RESTORE_S - time.monotonic())

    async def confirm(self, *, full: bool = False) -> bool:
        """Look at Redis now: False when it lost data since this process's last look, which
        then makes this process unsure (:meth:`unsure_s`) at once; its next regular look tells
        the listeners. For a caller about to act on something's absence: a client's retry
        that came within a look's interval of a loss found its finished stream's record gone,
        ran it again and was billed twice (the nemesis, one Redis: nem-1938). On a Cluster it
        reads the epoch alone: asking every master which process it is made each new request
        wait on the slowest master, and a failing one held requests for seconds (the nemesis,
        Cluster); a loss on one node the epoch does not share is left to the regular looks.

        A loss is reported once: its caller has waited for its write-backs by the next time
        it asks. While the regular looks do not come (on a Cluster they ask every master, a
        stalled one included, and the write-backs a look starts run before the next look:
        34 s in one gateway of the nemesis), the epoch a confirm reads stays ahead of the
        last look's: every confirm said "lost" again, and each claim let go of its key and
        took it again at once, for as long as that lasted (the nemesis, Cluster: 106
        requests went round for 10-37 s; two clients got no byte for 35 s).

        ``full``: on a Cluster too, ask every master which process it is, for a caller that
        acts on no loss anywhere (:meth:`ProducerBeat.gone`'s "nothing lost for as long as
        a write-back takes"), and is rare."""
        if self._directory.clustered and not full:
            epoch, server = await self._directory.epoch_id(), self._server or ""
        else:
            epoch, server = await self._directory.look()
        return self._confirmed(epoch, server)

    def confirm_with(self, pipe: Any) -> Callable[[list[Any]], bool] | None:
        """:meth:`confirm` in the same round trip as the command it follows: its look is
        queued on ``pipe`` (a pipeline to one server) after that command, so Redis runs it
        after the command, on the same connection, and it sees at least what the command
        saw. Returns what turns the look's replies (the pipeline's last two) into
        :meth:`confirm`'s answer. None on a Cluster (the epoch lives on another node, in no
        order with the command): there :meth:`confirm` follows the command's reply."""
        if self._directory.clustered:
            return None
        self._directory.queue_look(pipe)
        return lambda replies: self._confirmed(*Directory.looked(replies))

    def _confirmed(self, epoch: bytes | None, server: str) -> bool:
        if self._epoch is _UNSEEN or not self._lost(epoch, server) or self._reported == (epoch, server):
            return True
        self._reported = (epoch, server)
        self._changed_at = time.monotonic()
        return False

    def _lost(self, epoch: bytes | None, server: str) -> bool:
        """Whether (``epoch``, ``server``), as a look found them, say Redis may have lost writes
        since the last look: other servers answer, or the epoch changed (or went)."""
        moved = server != self._server and self._server is not None
        return moved or (epoch != self._epoch and (self._epoch is not _UNSEEN or epoch is None))

    def _blind(self) -> bool:
        return time.monotonic() - self._looked_at > max(BLIND_S, 3 * self._check_s)

    async def _run(self) -> None:
        away = False
        while True:  # the epoch is read at once: a loss right after this process started is a change
            try:
                epoch, server = await self._directory.look()
            except (RedisError, OSError) as exc:
                if not away:
                    log.warning("Redis check failed (what this gateway keeps is written back once it "
                                "answers): %s", exc)
                away = True
                self._changed_at = time.monotonic()
                await asyncio.sleep(self._check_s)
                continue
            moved = server != self._server and self._server is not None
            renewed = epoch != self._epoch and self._epoch not in (_UNSEEN, None)
            if away or moved or renewed:  # (a registry made where there was none is no loss)
                self._changed_at = time.monotonic()
            if moved or renewed:
                log.warning("Redis may have lost writes (%s): kept API keys and finished streams are written "
                            "back; unknown keys and models are 503 registry_rebuilding for now",
                            "a new registry epoch" if renewed else "other server processes answer")
            lost = away or self._lost(epoch, server)
            away = False
            self._epoch, self._server = epoch, server
            self._looked_at = time.monotonic()
            await self._tell(lost)
            await asyncio.sleep(self._check_s)

    async def _tell(self, lost: bool) -> None:
        """Call every listener, side by side (the API keys, which every request needs, do not
        wait behind hundreds of journals); a write-back this look made or finished restarts
        :meth:`unsure_s`'s window."""
        owed = [lost or self._owed[i] for i in range(len(self._listeners))]
        results = await asyncio.gather(*(listener(o) for listener, o in zip(self._listeners, owed, strict=True)),
                                       return_exceptions=True)
        wrote_back = False
        for i, result in enumerate(results):
            if isinstance(result, (RedisError, OSError)):
                log.warning("writing back what Redis may have lost failed (tried again at the next look): %s",
                            result)
                self._owed[i] = owed[i]
            elif isinstance(result, BaseException):
                raise result
            else:
                self._owed[i] = not result and owed[i]
                wrote_back |= owed[i] and bool(result)
        if wrote_back:  # (not a failed one: a write-back failing for good must not keep the window open)
            self._changed_at = time.monotonic()
        if not any(self._owed):
            self._owed_since = None
        elif self._owed_since is None:
            self._owed_since = time.monotonic()
