"""Fixtures: a real redis-server, real worker and gateway processes on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
import pytest
import redis

from sluice import keys
from sluice.embedded_failover import EmbeddedSentinel, ReplicatedCluster
from sluice.embedded_redis import EmbeddedCluster, EmbeddedRedis, free_port
from sluice.processes import child_preexec
from sluice.redis_url import sync_client

ROOT = Path(__file__).resolve().parent.parent


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` until true; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.02)


def access_line(gateway, request_id: str) -> dict:
    """The gateway's access-log fields for one request (its JSON log line)."""
    found: list[dict] = []

    def logged() -> bool:
        found[:] = [orjson.loads(line) for line in gateway.log_tail(3000).splitlines()
                    if f'"msg":"access request_id={request_id} ' in line]
        return bool(found)

    wait_for(logged, 5, f"the access line of {request_id}")
    return found[-1]


def worker_alive(client: redis.Redis, model: str, worker_id: str) -> bool:
    """Whether the worker's heartbeat has not expired, on Redis's clock."""
    seconds, micros = client.time()
    expiry = client.hget(keys.alive(model), worker_id)
    return expiry is not None and int(expiry) >= seconds * 1000 + micros // 1000


def running(worker: Proc) -> int:
    """Sequences the worker's engine is running, from its /health."""
    return int(httpx.get(worker.url + "/health").json()["worker"]["stats"]["running"])


def streaming(worker: Proc) -> int:
    """Streams the worker has open to gateways, from its /health (exact at once, where the
    engine's ``running`` comes from its periodic scheduler stats)."""
    return int(httpx.get(worker.url + "/health").json()["worker"]["in_flight"])


class Proc:
    """A sluice child process with its log file; ``stop()`` sends SIGTERM and waits.

    It is stopped when the test that started it ends, or the module whose fixture started
    it; ``shared`` ones (session fixtures) live until the session ends.
    """

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.name = name
        self.shared = False
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        # Own process group, so kill() also takes vLLM's engine processes with it.
        self.process = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
            start_new_session=True, preexec_fn=child_preexec,  # dies with the test run, even a killed one
        )
        self.url = ""

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def _kill_group(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        self._kill_group()
        self.process.wait()
        self._log.close()

    def terminate(self) -> None:
        if self.alive():
            self.process.terminate()

    def stop(self, timeout_s: float = 15) -> int:
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._kill_group()
        self._log.close()
        return self.process.returncode

    def listens(self) -> bool:
        """Whether this process (or a child of it) holds the listening socket of its URL's port.
        A 200 from the port alone is not enough: the shards of ``make test`` choose ports at
        random side by side, and a child that lost its port to another shard's process found
        that process answering its /health (CI, 2026-12-05: a worker "never registered")."""
        port = httpx.URL(self.url).port
        try:
            root = psutil.Process(self.pid)
            family = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return False
        for member in family:
            try:
                if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                       for c in member.net_connections(kind="tcp")):
                    return True
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return False

    def wait_http(self, path: str, timeout_s: float = 30) -> None:
        """Until this process answers 200 at ``path``; a process that lost its port exits
        ("address already in use"), which ``start_on_free_ports`` retries on another."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited early:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + path, timeout=1).status_code == 200 and self.listens():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} not ready at {path} after {timeout_s}s:\n{self.log_tail()}")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """A three-master Redis Cluster, as a ``redis+cluster://`` URL."""
    with EmbeddedCluster() as cluster:
        yield cluster.url


@pytest.fixture(scope="module")
def private_redis() -> Iterator[EmbeddedRedis]:
    """A Redis of the module's own (its tests may fill, flush or read all of it)."""
    server = EmbeddedRedis().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def redis_sentinel_url() -> Iterator[str]:
    """A Sentinel-managed master (one replica, three sentinels) that no test fails over,
    as a ``redis+sentinel://`` URL."""
    with EmbeddedSentinel() as deployment:
        yield deployment.url


@pytest.fixture
def sentinel_redis() -> Iterator[EmbeddedSentinel]:
    """A master, a replica and three sentinels, for one test (tests kill its master)."""
    with EmbeddedSentinel() as deployment:
        yield deployment


@pytest.fixture
def replicated_cluster() -> Iterator[ReplicatedCluster]:
    """Three masters with a replica each, for one test (tests kill its masters)."""
    with ReplicatedCluster() as cluster:
        yield cluster


class Backend:
    """The Redis a test's processes share: its URL and a client to inspect it."""

    def __init__(self, kind: str, url: str) -> None:
        self.kind, self.url, self.client = kind, url, sync_client(url)


@pytest.fixture(scope="session", params=["single", "cluster"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """Run a test against a single Redis and against a three-master Redis Cluster."""
    url = request.getfixturevalue("redis_url" if request.param == "single" else "redis_cluster_url")
    b = Backend(request.param, url)
    yield b
    b.client.close()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


StartWorker = Callable[..., Proc]
StartGateway = Callable[..., Proc]


def stop_all(procs: list[Proc], timeout_s: float = 15) -> None:
    """SIGTERM every one first, then wait: they stop in the time of the slowest."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.stop(timeout_s)


@pytest.fixture(scope="session")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    stop_all(started, timeout_s=5)


def start_on_a_free_port(procs: list[Proc], launch: Callable[[int], Proc], timeout_s: float) -> Proc:
    return start_on_free_ports(procs, [launch], timeout_s)[0]


def start_on_free_ports(procs: list[Proc], launches: list[Callable[[int], Proc]], timeout_s: float) -> list[Proc]:
    """Each ``launch(port)`` on a free port, until its child serves ``/health`` there. A port
    is chosen free and bound by the child a moment later; on a shared machine another process
    can take it in between, and the child exits ("address already in use"): then again on
    another port, three tries in all.

    All are launched before any is waited for, so their start-ups overlap (a vLLM start keeps
    one core busy importing, one process after another). Launched from this thread: a child
    dies with the thread that started it (``child_preexec``), so never from a worker thread."""
    children = [launch(free_port()) for launch in launches]
    procs.extend(children)
    for i, launch in enumerate(launches):
        for attempt in range(1, 4):
            proc = children[i]
            try:
                proc.wait_http("/health", timeout_s=timeout_s)
                break
            except RuntimeError:
                lost_port = not proc.alive() and "address already in use" in proc.log_path.read_text(errors="replace")
                if not lost_port or attempt == 3:
                    raise
                proc.stop()
                procs.remove(proc)
                children[i] = launch(free_port())
                procs.append(children[i])
    return children


def _stop_started_since(procs: list[Proc], before: int) -> None:
    stop_all([p for p in procs[before:] if not p.shared])
    procs[before:] = [p for p in procs[before:] if p.shared]


@pytest.fixture(scope="module", autouse=True)
def _module_processes_stop_with_it(procs: list[Proc]) -> Iterator[None]:
    """What a module's fixtures started stops when the module ends. (Left running, a
    whole suite's idle workers and gateways heartbeating against Redis servers that had
    stopped took most of both cores by its last third.)"""
    before = len(procs)
    yield
    _stop_started_since(procs, before)


@pytest.fixture(autouse=True)
def _test_processes_stop_with_it(procs: list[Proc]) -> Iterator[None]:
    """What a test started itself stops when it ends (its module's fixtures are set up
    before this one, so they are not counted)."""
    before = len(procs)
    yield
    _stop_started_since(procs, before)


#: One worker's arguments for ``start_workers``: ``start_worker``'s positional and keyword ones.
WorkerArgs = tuple[tuple[str, ...], dict[str, Any]]
StartWorkers = Callable[[list[WorkerArgs]], list[Proc]]


@pytest.fixture(scope="session")
def start_workers(
    redis_url: str, redis_client: redis.Redis, procs: list[Proc], tmp_path_factory: pytest.TempPathFactory
) -> StartWorkers:
    """Start several workers side by side (``start_worker`` is one of them): each is given as
    ``((model, *extra), {"engine": ..., "env": ..., **flags})``; returns them in that order
    once every one serves and is registered."""
    logs = tmp_path_factory.mktemp("logs")

    def launcher(model: str = "sim", *extra: str, env: dict[str, str] | None = None,
                 redis_at: str | None = None, **flags: object) -> Callable[[int], Proc]:
        engine = str(flags.pop("engine", "sim"))
        heartbeat_ms = flags.pop("heartbeat_ms", 200)

        def launch(port: int) -> Proc:
            worker_id = f"w-{model}-{port}"
            argv = [
                sys.executable, "-m", "sluice", "worker", "--engine", engine,
                "--port", str(port), "--redis-url", redis_at or redis_url, "--served-model-name", model,
                "--worker-id", worker_id, "--heartbeat-ms", str(heartbeat_ms),
            ]
            for name, value in flags.items():
                argv += ["--" + name.replace("_", "-"), str(value)]
            argv += list(extra)
            proc = Proc(worker_id, argv, logs / f"{worker_id}.log", {**_env(), **(env or {})})
            proc.url = f"http://127.0.0.1:{port}"
            return proc

        return launch

    def registered(proc: Proc, model: str, redis_at: str | None) -> None:
        deadline = time.monotonic() + 10
        client = sync_client(redis_at) if redis_at else redis_client
        try:
            while not worker_alive(client, model, proc.name):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{proc.name} never registered:\n{proc.log_tail()}")
                time.sleep(0.02)
        finally:
            if redis_at:
                client.close()

    def start(workers: list[WorkerArgs]) -> list[Proc]:
        # vLLM loads a model and warms up: allow minutes on a busy 2-core machine.
        sim = all(kwargs.get("engine", "sim") == "sim" for _, kwargs in workers)
        started = start_on_free_ports(procs, [launcher(*args, **kwargs) for args, kwargs in workers],
                                       60.0 if sim else 600.0)
        for proc, (args, kwargs) in zip(started, workers, strict=True):
            registered(proc, args[0] if args else kwargs.get("model", "sim"), kwargs.get("redis_at"))
        return started

    return start


@pytest.fixture(scope="session")
def start_worker(start_workers: StartWorkers) -> StartWorker:
    def start(*args: str, **kwargs: Any) -> Proc:
        return start_workers([(args, kwargs)])[0]

    return start


@pytest.fixture(scope="session")
def start_gateway(
    redis_url: str, procs: list[Proc], tmp_path_factory: pytest.TempPathFactory
) -> StartGateway:
    logs = tmp_path_factory.mktemp("gateway-logs")

    def start(env: dict[str, str] | None = None, redis_at: str | None = None, processes: int = 1) -> Proc:
        def launch(port: int) -> Proc:
            argv = [sys.executable, "-m", "sluice", "gateway", "--port", str(port),
                    "--redis-url", redis_at or redis_url, "--procs", str(processes)]
            proc = Proc(f"gateway-{port}", argv, logs / f"gateway-{port}.log", {**_env(), **(env or {})})
            proc.url = f"http://127.0.0.1:{port}"
            return proc

        return start_on_a_free_port(procs, launch, 30)

    return start


@pytest.fixture(scope="session")
def stack(start_worker: StartWorker, start_gateway: StartGateway) -> Proc:
    """A gateway and two sim workers serving model ``sim``; shared, never killed by tests."""
    started = [start_worker("sim"), start_worker("sim"), start_gateway()]
    for proc in started:
        proc.shared = True
    return started[-1]


@pytest.fixture(scope="session")
def base_url(stack: Proc) -> str:
    return stack.url + "/v1"
