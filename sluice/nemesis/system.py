"""The system under test: a Redis topology, sim workers and gateway processes, each of which
the nemesis can kill, stall and restart on its own port.

Gateways are single processes (``--procs 1``) bound with ``SO_REUSEPORT``, so several share
a port as the processes of one ``sluice gateway --procs N`` replica do, while each one can
be killed or stalled alone. Gateway 0 reaches Redis through a :class:`LinkProxy` (its link
can be delayed or cut); the others, and the workers, directly. API keys are on: one per
tenant (the last one of the priority tier, for urgent requests).

TTLs are short so that faults run past them within a short run: leases 3 s (and with them
the tenancy's concurrency members), ``:live`` and gateway liveness 3 s (fixed in the code),
worker heartbeats 0.5 s (missed for 1.5 s: dropped), a stalled worker noticed after 2 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis
from redis.crc import key_slot

from sluice import keys
from sluice.apikeys import KeyStore, save_records
from sluice.commands.bench_stack import MODEL, LoggedChild, _child_env
from sluice.embedded_redis import free_port
from sluice.nemesis.proxy import LinkProxy
from sluice.nemesis.topology import SingleRedis, make_topology
from sluice.redis_pool import RedisClient, create_pool

#: One marker key in each third of the slot space (each master's range in the harness's
#: Cluster; on one server all three are there): a marker gone is a master that lost its data.
MARKERS = [next(m for m in (keys.nemesis_marker(i) for i in range(10_000))
                if lo <= key_slot(m.encode()) < hi)
           for lo, hi in ((0, 5461), (5461, 10923), (10923, 16384))]

#: The run's keys file (``sluice keys export``), in its log directory.
KEYS_FILE = "keys.jsonl"

#: Gateway settings of a nemesis run (see the module docstring for why each is short).
#: Keys always required, as in production on a Redis that can lose its data: with ``auto`` a
#: gateway that (re)starts when no gateway is left to write the keys back serves openly.
GATEWAY_ENV = {
    "SLUICE_GATEWAY_AUTH": "keys",
    "SLUICE_GATEWAY_LEASE_TTL_S": "3",
    "SLUICE_GATEWAY_STALL_TIMEOUT_S": "2",
    "SLUICE_GATEWAY_TTFT_TIMEOUT_S": "15",
    "SLUICE_GATEWAY_MAX_MIGRATIONS": "6",
    "SLUICE_GATEWAY_QUEUE_TIMEOUT_S": "10",
    "SLUICE_GATEWAY_MAX_QUEUE": "4096",
    "SLUICE_GATEWAY_SSE_PING_S": "1",
    "SLUICE_GATEWAY_IDEMPOTENCY_TTL_S": "600",
    "SLUICE_GATEWAY_SHUTDOWN_GRACE_S": "2",
    "SLUICE_GATEWAY_REUSE_PORT": "true",
}


@dataclass
class SystemShape:
    topology: str = "single"
    gateways: int = 3
    ports: int = 2
    workers: int = 3
    tenants: int = 3
    #: Slots per sim worker: fewer make requests queue (admission under faults).
    slots: int = 24
    worker_args: list[str] = field(default_factory=lambda: [
        "--sim-token-ms=30", "--sim-ttft-ms=20", "--heartbeat-ms=500"])
    gateway_env: dict[str, str] = field(default_factory=dict)


class ProcExited(RuntimeError):
    """The process exited before it was ready (a gateway gives up when Redis stays away at start)."""


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on ``port`` (any process)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    return inodes


class Proc:
    """One gateway or worker: the same argv, port and log on every restart."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path, port: int) -> None:
        self.name, self.argv, self.env, self.log_path, self.port = name, argv, env, log_path, port
        self.url = f"http://127.0.0.1:{port}"
        self.child: LoggedChild | None = None
        self.starts = 0

    def start(self) -> None:
        self.child = LoggedChild(self.name, self.argv, self.env, self.log_path)
        self.child.start()
        self.starts += 1

    @property
    def pid(self) -> int:
        assert self.child is not None
        return self.child.pid

    def kill(self) -> None:
        assert self.child is not None and self.child.process is not None
        self.child.kill_group()
        self.child.process.wait()

    def move_to(self, port: int) -> None:
        """Listen on ``port`` from the next start (a worker's port was taken before it started)."""
        self.argv[self.argv.index("--port") + 1] = str(port)
        self.port, self.url = port, f"http://127.0.0.1:{port}"

    def signal(self, sig: signal.Signals) -> None:
        if self.child is None:  # never started
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    def alive(self) -> bool:
        return self.child is not None and self.child.alive()

    def listening(self) -> bool:
        """Whether this process itself listens on its port: with SO_REUSEPORT another process
        on the same port answers HTTP while this one is still starting."""
        inodes = _listening_inodes(self.port)
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{self.pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{self.pid}/fd/{fd}")
                    if link.startswith("socket:[") and link[8:-1] in inodes:
                        return True
        return False

    async def ready(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2) as http:
            while True:
                if not self.alive():
                    raise ProcExited(f"{self.name} exited; log: {self.log_path}")
                if self.listening():
                    with contextlib.suppress(httpx.HTTPError):
                        if (await http.get(self.url + "/health")).status_code == 200:
                            return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} not ready; log: {self.log_path}")
                await asyncio.sleep(0.1)

    async def restart(self, timeout_s: float = 90.0) -> int:
        """Start until it is ready, as a supervisor would (again after 1 s when it exits at
        start); returns the starts it took."""
        deadline = time.monotonic() + timeout_s
        for tries in range(1, 1000):
            self.start()
            try:
                await self.ready(max(1.0, deadline - time.monotonic()))
                return tries
            except ProcExited:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1.0)
        raise RuntimeError(f"{self.name} never came up")

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop(timeout_s=5)


async def _start_on_a_free_port(worker: Proc, timeouts_s: tuple[float, ...] = (10.0, 30.0, 60.0)) -> None:
    """Start a worker; on another free port if it did not come up on its own (another
    process bound that port between ``free_port()`` and the start: the worker exits at
    once, and would again on every restart)."""
    for attempt, timeout_s in enumerate(timeouts_s):
        try:
            await worker.restart(timeout_s=timeout_s)
            return
        except (ProcExited, RuntimeError):
            if attempt == len(timeouts_s) - 1:
                raise
            worker.stop()
            worker.move_to(free_port())


class System:
    def __init__(self, shape: SystemShape, logs: Path) -> None:
        self.shape = shape
        self.logs = logs
        self.topology = make_topology(shape.topology)
        self.proxy: LinkProxy | None = None
        self.ports = [free_port() for _ in range(shape.ports)]
        self.workers: list[Proc] = []
        self.gateways: list[Proc] = []
        self.api_keys: list[str] = []
        self._key_prefixes: list[str] = []

    @property
    def urls(self) -> list[str]:
        """Client-facing gateway URLs, one per port."""
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    def port_of(self, gateway: int) -> int:
        return self.ports[gateway % len(self.ports)]

    async def start(self) -> None:
        await asyncio.to_thread(self.topology.start)
        try:  # the processes read the same URL: fail here, clearly, if Sluice cannot
            await (await create_pool(self.topology.url, retries=1)).aclose()
        except ValueError as exc:
            raise RuntimeError(f"this Sluice cannot use {self.topology.url} (sluice/redis_pool.py): {exc}") from None
        if isinstance(self.topology, SingleRedis):
            self.proxy = await LinkProxy(self.topology.port).start()
        await self._create_keys()
        python = [sys.executable, "-m", "sluice"]
        for i in range(self.shape.workers):
            port = free_port()
            argv = [*python, "--log-level", "WARNING", "worker", "--engine", "sim", "--port", str(port),
                    "--redis-url", self.topology.url, "--served-model-name", MODEL, "--worker-id", f"w{i}",
                    f"--sim-max-seqs={self.shape.slots}", *self.shape.worker_args]
            self.workers.append(Proc(f"worker-{i}", argv, _child_env({}), self.logs / f"worker-{i}.log", port))
        for i in range(self.shape.gateways):
            url = self.topology.url
            if i == 0 and self.proxy is not None:
                url = f"redis://127.0.0.1:{self.proxy.port}/0"
            argv = [*python, "--log-level", "INFO", "gateway", "--procs", "1", "--port", str(self.port_of(i)),
                    "--redis-url", url]
            # The deployment the README recommends where Redis may lose its data: a keys file.
            env = _child_env({**GATEWAY_ENV, "SLUICE_GATEWAY_KEYS_FILE": str(self.logs / KEYS_FILE),
                              **self.shape.gateway_env})
            self.gateways.append(Proc(f"gateway-{i}", argv, env, self.logs / f"gateway-{i}.log", self.port_of(i)))
        await asyncio.gather(*(_start_on_a_free_port(p) for p in self.workers))
        await asyncio.gather(*(p.restart() for p in self.gateways))
        await self._models_ready()

    async def _models_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2) as http:
            for url in self.urls:
                while True:
                    with contextlib.suppress(httpx.HTTPError):
                        if (await http.get(url + "/ready")).status_code == 200:
                            break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{url} never ready; logs under {self.logs}")
                    await asyncio.sleep(0.1)

    async def _create_keys(self) -> None:
        store_redis = await create_pool(self.topology.url if self.shape.topology != "sentinel"
                                        else self._master_url())
        try:
            store = KeyStore(store_redis)
            for t in range(self.shape.tenants):
                tier = "priority" if t == self.shape.tenants - 1 else "standard"
                key, record = await store.create(f"tenant-{t}", tier, rpm=100_000, tpm=100_000_000,
                                                 max_concurrent=512)
                self.api_keys.append(key)
                self._key_prefixes.append(record.prefix)
            save_records(str(self.logs / KEYS_FILE), await store.records())
        finally:
            await store_redis.aclose()

    def _master_url(self) -> str:
        client = self.topology.client()
        try:
            port = client.connection_pool.connection_kwargs["port"]
        finally:
            client.close()
        return f"redis://127.0.0.1:{port}/0"

    async def api_keys_lost(self, client: RedisClient) -> bool:
        """Whether Redis lacks any of the run's API keys (it lost data)."""
        for prefix in self._key_prefixes:
            if not await client.exists(keys.api_key(prefix)) or not await client.sismember(keys.API_KEYS, prefix):
                return True
        return False

    async def write_markers(self, client: RedisClient) -> None:
        for marker in MARKERS:
            await client.set(marker, "1", ex=keys.NEMESIS_MARKER_TTL_S)

    async def markers_lost(self, client: RedisClient) -> bool:
        """Whether a master lost its data: its marker is gone."""
        for marker in MARKERS:
            if not await client.exists(marker):
                return True
        return False

    def redis_client(self) -> redis.Redis | redis.RedisCluster:
        return self.topology.client()

    async def close(self) -> None:
        for proc in [*self.gateways, *self.workers]:
            proc.signal(signal.SIGCONT)  # a stalled process cannot stop
        for proc in self.gateways:
            if proc.alive():
                proc.signal(signal.SIGTERM)
        await asyncio.to_thread(lambda: [p.stop() for p in [*self.gateways, *self.workers]])
        if self.proxy is not None:
            await self.proxy.close()
        await asyncio.to_thread(self.topology.stop)
