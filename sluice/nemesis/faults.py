"""Runs a fault schedule against the system, and records when each fault really ran.

Each fault is a task that waits for its time, then for its target (one fault per target
at a time: a restart still in progress delays the next fault on that process), applies
the fault, holds it for its duration and undoes it. Blocking work (signals and waits,
Redis shutdowns) runs in threads, so clients and the link proxy go on meanwhile.

After a Sentinel or Cluster failover a watcher sends each gateway port a one-token
request (a real API key) every quarter second until it is served, and records how long
after the failover began that took: the issue's "admission serves again within 10 s".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import httpx
from redis.exceptions import RedisError

from sluice.nemesis.clients import Cutter
from sluice.nemesis.schedule import DATA_LOSS, Fault
from sluice.nemesis.system import MODEL, System
from sluice.redis_pool import RedisClient, create_pool

log = logging.getLogger("sluice.nemesis")


@dataclass
class FaultRun:
    fault: Fault
    #: Seconds since the run's start: when the fault began, and when it was undone.
    started_s: float = 0.0
    ended_s: float = 0.0
    #: Data-loss faults: when the gateways had written the API keys back.
    restored_s: float | None = None
    #: A Redis fault whose kind loses nothing, after which Redis had lost data all the same
    #: (on Sentinel or Cluster, a failover it set off promoted a server without the data):
    #: the checker treats it as a data-loss fault (``Nemesis._watch_data``).
    lost_data: bool = False
    note: str = ""
    error: str | None = None
    #: Failovers: per gateway port, seconds from the fault's start until a request was
    #: served there again (None: not within ``SERVING_WAIT_S``).
    serving_s: dict[int, float | None] = field(default_factory=dict)
    #: Failovers: per gateway port, what its probes got, each change of answer once:
    #: ``[seconds since the fault began, "200" | "503 service_unavailable" | "ReadTimeout"...]``.
    probes: dict[int, list[tuple[float, str]]] = field(default_factory=dict)

    def public(self) -> dict[str, object]:
        out = asdict(self)
        out["fault"] = self.fault.public()
        return out


#: How long the serving watcher waits after a failover, per port.
SERVING_WAIT_S = 60.0
#: How long after a data loss the gateways' key keepers may take to write the keys back.
KEYS_BACK_S = 30.0
FAILOVERS = frozenset({"sentinel_failover", "cluster_failover"})


async def _probe(http: httpx.AsyncClient, url: str, body: dict[str, object], headers: dict[str, str]) -> str:
    """One serving probe's answer: ``"200"``, the status and error code, or the exception's name."""
    try:
        resp = await http.post(url, json=body, headers=headers)
    except httpx.HTTPError as exc:
        return type(exc).__name__
    if resp.status_code == 200:
        return "200"
    code = ""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        error = resp.json()["error"]
        code = str(error.get("code") or error.get("type") or "")
    return f"{resp.status_code} {code}".strip()


class Nemesis:
    def __init__(self, system: System, cutter: Cutter, t0: float) -> None:
        self.system = system
        self.cutter = cutter
        self.t0 = t0
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.runs: list[FaultRun] = []
        self._watchers: list[asyncio.Task[None]] = []

    def now_s(self) -> float:
        return time.monotonic() - self.t0

    async def run(self, schedule: list[Fault]) -> list[FaultRun]:
        self.runs = [FaultRun(f) for f in schedule]
        done = asyncio.Event()
        client = await create_pool(self.system.topology.url, retries=1000, delay_s=0.25)
        await self.system.write_markers(client)
        watcher = asyncio.create_task(self._watch_data(client, done))
        try:
            await asyncio.gather(*(self._one(r) for r in self.runs))
            await asyncio.gather(*self._watchers)
        finally:
            done.set()
            await watcher
            await client.aclose()
        return self.runs

    async def _watch_data(self, client: RedisClient, done: asyncio.Event) -> None:
        """Notice every data loss, whichever fault caused it: a marker key on every master
        is gone. Besides the faults that lose data by design, on Sentinel and Cluster a
        restart or a stall past the failure timeout is a failover, and a failover can
        promote a server without the data (Sentinel promotes an old master that came back
        empty from a restart without persistence and was still a master when the next
        failover began: the hazard Redis's Sentinel documentation describes for masters
        without persistence). The loss counts against the latest Redis fault begun, and
        its ``restored_s`` is when the gateways had written the API keys back (their key
        keepers do; the harness writes no key)."""
        restoring: set[asyncio.Task[None]] = set()
        while not done.is_set():
            with contextlib.suppress(RedisError, OSError):
                if await self.system.markers_lost(client):
                    await self.system.write_markers(client)
                    run = self._blame_data_loss(self.now_s())
                    if run is not None:
                        task = asyncio.create_task(self._keys_back(client, run, done))
                        restoring.add(task)
                        task.add_done_callback(restoring.discard)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.25)
        await asyncio.gather(*restoring)

    async def _keys_back(self, client: RedisClient, run: FaultRun, done: asyncio.Event) -> None:
        """Set ``run.restored_s`` once Redis has every API key again."""
        deadline = self.now_s() + KEYS_BACK_S
        while self.now_s() < deadline and not done.is_set():
            with contextlib.suppress(RedisError, OSError):
                if not await self.system.api_keys_lost(client):
                    run.restored_s = max(run.restored_s or 0.0, self.now_s())
                    return
            await asyncio.sleep(0.1)
        if not done.is_set():
            run.error = f"the gateways had not written the API keys back {KEYS_BACK_S:.0f} s after a data loss"
            log.warning("%s: %s", run.fault, run.error)

    def _blame_data_loss(self, seen_s: float) -> FaultRun | None:
        """The latest Redis fault begun before ``seen_s`` lost data."""
        begun = [r for r in self.runs if r.fault.target == "redis" and 0 < r.started_s <= seen_s]
        if not begun:
            return None
        run = max(begun, key=lambda r: r.started_s)
        if run.fault.kind not in DATA_LOSS and not run.lost_data:
            run.lost_data = True
            run.note = (run.note + "; " if run.note else "") + "Redis lost data"
            log.warning("%s lost Redis data", run.fault)
        return run

    async def _watch_serving(self, run: FaultRun, promoted: asyncio.Event) -> None:
        """Fill ``run.serving_s``: per port, when the first probe of the last unbroken run of
        served ones came back (a probe that waits out the failover and is then served counts
        at its answer), once the new master is in place (``promoted``: the sentinels name it,
        or the cluster serves every slot without the killed master) and three in a row were
        served since. What follows the promotion (Sentinel demoting the old master some ten
        seconds later, a killed Cluster master rejoining as a replica) holds the Redis
        target's lock, so the next Redis fault waits for it and does not lengthen what this
        measures, and so does waiting for this watcher's answer (``_apply``)."""
        body = {"model": MODEL, "messages": [{"role": "user", "content": "serving?"}], "max_tokens": 1}
        headers = {"Authorization": f"Bearer {self.system.api_keys[-1]}"}  # the priority tenant: queues least

        async def port(http: httpx.AsyncClient, number: int) -> None:
            run.serving_s[number] = None
            seen = run.probes.setdefault(number, [])
            since, streak = None, 0
            while self.now_s() - run.started_s < SERVING_WAIT_S:
                sent = self.now_s() - run.started_s
                answer = await _probe(http, f"http://127.0.0.1:{number}/v1/chat/completions", body, headers)
                ok = answer == "200"
                if not seen or seen[-1][1] != answer:
                    seen.append((round(sent, 2), answer))
                at = self.now_s() - run.started_s
                if not ok:
                    since, streak = None, 0
                else:
                    since = at if since is None else since
                    streak += promoted.is_set()
                    if streak >= 3:
                        run.serving_s[number] = round(since, 2)
                        return
                await asyncio.sleep(0.25)

        async with httpx.AsyncClient(timeout=5) as http:
            await asyncio.gather(*(port(http, n) for n in self.system.ports))

    async def _one(self, run: FaultRun) -> None:
        await asyncio.sleep(max(0.0, run.fault.at_s - self.now_s()))
        async with self._locks[run.fault.target]:
            run.started_s = self.now_s()
            try:
                await self._apply(run)
            except Exception as exc:  # a fault that could not be applied is reported, not fatal
                run.error = f"{type(exc).__name__}: {exc}"
                log.warning("fault %s failed: %s", run.fault, exc)
            run.ended_s = self.now_s()

    async def _apply(self, run: FaultRun) -> None:
        f, s = run.fault, self.system
        kind = f.kind
        if kind in ("gateway_kill", "worker_kill", "gateway_stop", "worker_stop"):
            family, index = f.target.split("-")
            proc = (s.gateways if family == "gateway" else s.workers)[int(index)]
            if kind.endswith("kill"):
                await asyncio.to_thread(proc.kill)
                await asyncio.sleep(f.duration_s)
                tries = await proc.restart()
                if tries > 1:
                    run.note = f"started {tries} times"
            else:
                proc.signal(signal.SIGSTOP)
                try:
                    await asyncio.sleep(f.duration_s)
                finally:
                    proc.signal(signal.SIGCONT)
        elif kind in ("redis_restart", "redis_restart_lossy"):
            await asyncio.to_thread(s.topology.restart, persist=kind == "redis_restart", down_s=f.duration_s)
        elif kind == "flushall":
            await asyncio.to_thread(s.topology.flushall)
        elif kind == "redis_stop":
            await asyncio.to_thread(s.topology.stall, f.duration_s)
        elif kind == "redis_full":
            await asyncio.to_thread(s.topology.refuse_writes, f.duration_s)
        elif kind in FAILOVERS:
            # Begun once it can succeed, as an operator would: a replica linked to the master.
            # The wait is not part of the failover's figures.
            await asyncio.to_thread(s.topology.ready_for_failover)
            run.started_s = self.now_s()
            promoted = asyncio.Event()
            loop = asyncio.get_running_loop()
            watcher = asyncio.create_task(self._watch_serving(run, promoted))
            self._watchers.append(watcher)
            try:
                phases = await asyncio.to_thread(s.topology.failover, lambda: loop.call_soon_threadsafe(promoted.set))
                run.note = ", ".join(f"{step} {seconds}" for step, seconds in phases.items())
            finally:
                promoted.set()
            # Redis is left alone until every port served again (or SERVING_WAIT_S passed):
            # the next Redis fault, begun meanwhile, broke serving before the watcher saw
            # it back, and the figure measured two faults instead of one failover.
            await asyncio.shield(watcher)
        elif kind in ("link_delay", "link_cut"):
            assert s.proxy is not None
            if kind == "link_delay":
                s.proxy.delay(f.param)
            else:
                s.proxy.cut(blackhole=f.index % 2 == 1)
                run.note = "blackhole" if f.index % 2 else "reset"
            try:
                await asyncio.sleep(f.duration_s)
            finally:
                s.proxy.heal()
        elif kind == "client_cut":
            run.note = ",".join(str(i) for i in self.cutter.cut(int(f.param), f.index))
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
