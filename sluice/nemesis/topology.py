"""The Redis under test, and the faults it can suffer, for each topology.

- ``single``: one ``redis-server``; restart with or without persistence, FLUSHALL, SIGSTOP.
- ``sentinel``: one master, one replica, three sentinels (the same binary, ``--sentinel``),
  reached as ``redis+sentinel://host:port,host:port,host:port/nemesis``; adds a failover
  (``SENTINEL FAILOVER``: the replica becomes master, the old master its replica).
- ``cluster``: three masters, each with a replica; adds a master failover (the master is
  SIGKILLed, its replica takes over, the old master comes back as the new one's replica).

Every operation blocks (the fault runner calls them in a thread). Faults on a sentinel or
cluster topology hit the current master (a random one in a cluster).

>>> topo = make_topology("single").start()
>>> topo.url; topo.restart(persist=False, down_s=0.5); topo.stop()
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, Self

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from sluice.embedded_redis import CLUSTER_SLOTS, EmbeddedRedis, free_cluster_port, redis_server_binary
from sluice.processes import child_preexec

SENTINEL_SERVICE = "nemesis"


class Topology(Protocol):
    name: str

    @property
    def url(self) -> str: ...

    def start(self) -> Self: ...

    def stop(self) -> None: ...

    def client(self) -> redis.Redis | redis.RedisCluster:
        """A new blocking admin client of the current master(s)."""

    def restart(self, *, persist: bool, down_s: float) -> None: ...

    def flushall(self) -> None: ...

    def stall(self, seconds: float) -> None:
        """SIGSTOP a master for ``seconds``, then SIGCONT."""

    def failover(self) -> None: ...

    def pids(self) -> list[int]: ...


class Server(EmbeddedRedis):
    """A redis-server that can be shut down and started again on the same port and folder."""

    @property
    def dump(self) -> Path:
        return Path(self._dir.name) / "dump.rdb"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def client(self) -> redis.Redis:
        # No retries: redis-py's default retries with backoff would make a SHUTDOWN (whose
        # connection the server closes) and a probe of a dead server take seconds.
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10, retry=Retry(NoBackoff(), 0))

    def shutdown(self, *, save: bool) -> None:
        """``SHUTDOWN SAVE`` (a snapshot the next start loads) or ``NOSAVE`` (and no snapshot left)."""
        client = self.client()
        try:
            client.shutdown(save=save, nosave=not save)
        except redis.ConnectionError:
            pass  # the server closes the connection as it goes
        finally:
            client.close()
        assert self.process is not None
        self.process.wait(30)
        if not save:
            self.dump.unlink(missing_ok=True)

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def start_sentinel(self, timeout_s: float = 10.0) -> None:
        """Start as a sentinel: its config file (which it rewrites) must come first."""
        conf = Path(self._dir.name) / "sentinel.conf"
        self.process = subprocess.Popen(
            [redis_server_binary(), str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
            preexec_fn=child_preexec, start_new_session=True,  # noqa: PLW1509 - prctl only
        )
        deadline = time.monotonic() + timeout_s
        while True:
            client = self.client()
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"sentinel on port {self.port} did not start") from None
                time.sleep(0.05)
            finally:
                client.close()

    def stall(self, seconds: float) -> None:
        os.kill(self.pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(self.pid, signal.SIGCONT)


class _OneMaster:
    """Faults of a topology with one master at a time (one server, or Sentinel's)."""

    def master(self) -> Server:
        raise NotImplementedError

    def client(self) -> redis.Redis:
        return self.master().client()

    def restart(self, *, persist: bool, down_s: float) -> None:
        master = self.master()
        master.shutdown(save=persist)
        time.sleep(down_s)
        master.args = ()  # back as a master; Sentinel makes it a replica if it failed over meanwhile
        master.start()

    def flushall(self) -> None:
        client = self.client()
        try:
            client.flushall()
        finally:
            client.close()

    def stall(self, seconds: float) -> None:
        self.master().stall(seconds)


class SingleRedis(_OneMaster):
    name = "single"

    def __init__(self) -> None:
        self.server = Server()

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def port(self) -> int:
        return self.server.port

    def master(self) -> Server:
        return self.server

    def start(self) -> Self:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()

    def failover(self) -> None:
        raise RuntimeError("a single Redis server has nothing to fail over to")

    def pids(self) -> list[int]:
        return [self.server.pid]


class SentinelRedis(_OneMaster):
    """One master, one replica, three sentinels, on loopback."""

    name = "sentinel"

    def __init__(self) -> None:
        self.servers = [Server(), Server()]
        self.sentinels = [Server() for _ in range(3)]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SENTINEL_SERVICE}"

    def start(self) -> Self:
        master, replica = self.servers
        master.start()
        replica.args = ("--replicaof", "127.0.0.1", str(master.port))
        replica.start()
        for sentinel in self.sentinels:
            sentinel.dump.with_name("sentinel.conf").write_text(
                f"port {sentinel.port}\nbind 127.0.0.1\ndir {sentinel.dump.parent}\n"
                f"sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {master.port} 2\n"
                f"sentinel down-after-milliseconds {SENTINEL_SERVICE} 1000\n"
                f"sentinel failover-timeout {SENTINEL_SERVICE} 5000\n"
            )
            sentinel.start_sentinel()
        self._wait_replicated(time.monotonic() + 20)
        return self

    def _wait_replicated(self, deadline: float) -> None:
        while True:
            info = self.client().info("replication")
            if info.get("connected_slaves", 0) >= 1:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"sentinel topology: replica never connected ({info})")
            time.sleep(0.1)

    def master(self, timeout_s: float = 15.0) -> Server:
        """The server the sentinels name as master, once it agrees (after a failover or a
        restart the sentinels take a moment to reconfigure)."""
        deadline = time.monotonic() + timeout_s
        while True:
            client = self.sentinels[0].client()
            try:
                _, port = client.sentinel_get_master_addr_by_name(SENTINEL_SERVICE)
            finally:
                client.close()
            server = next(s for s in self.servers if s.port == int(port))
            probe = server.client()
            try:
                if probe.info("replication").get("role") == "master":
                    return server
            except redis.RedisError:
                pass
            finally:
                probe.close()
            if time.monotonic() > deadline:
                raise RuntimeError(f"no master agreed on by the sentinels in {timeout_s:g}s")
            time.sleep(0.1)

    def stop(self) -> None:
        for server in [*self.sentinels, *self.servers]:
            server.stop()

    def failover(self) -> None:
        before = self.master().port
        client = self.sentinels[0].client()
        try:
            client.execute_command("SENTINEL", "FAILOVER", SENTINEL_SERVICE)
        finally:
            client.close()
        deadline = time.monotonic() + 30
        while self.master().port == before and time.monotonic() < deadline:
            time.sleep(0.1)

    def pids(self) -> list[int]:
        return [s.pid for s in self.servers]


class ClusterRedis:
    """Three masters, each with one replica; a failover kills a master and restarts it as a replica."""

    name = "cluster"

    def __init__(self, masters: int = 3) -> None:
        args = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1000")
        self.servers = [Server(free_cluster_port(), args=args) for _ in range(2 * masters)]
        self.masters = masters
        self._rng = random.Random(0)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers[:1])

    def start(self) -> Self:
        for server in self.servers:
            server.start()
        clients = [s.client() for s in self.servers]
        try:
            share = -(-CLUSTER_SLOTS // self.masters)
            for i, client in enumerate(clients[: self.masters]):
                owned = range(i * share, min((i + 1) * share, CLUSTER_SLOTS))
                for first in range(owned.start, owned.stop, 1024):
                    client.cluster("ADDSLOTS", *range(first, min(first + 1024, owned.stop)))
            for server in self.servers[1:]:
                clients[0].cluster("MEET", "127.0.0.1", server.port)
            self._wait(lambda: all(int(c.cluster("INFO")["cluster_known_nodes"]) == len(clients) for c in clients))
            for master, replica in zip(clients[: self.masters], clients[self.masters:], strict=True):
                replica.cluster("REPLICATE", master.cluster("MYID"))
            self._wait(lambda: all(c.cluster("INFO")["cluster_state"] == "ok" for c in clients)
                       and sum(c.info("replication").get("connected_slaves", 0) for c in clients) >= self.masters)
        finally:
            for client in clients:
                client.close()
        return self

    @staticmethod
    def _wait(ready: Callable[[], bool], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError("redis cluster did not come up")
            time.sleep(0.1)

    def _current_masters(self) -> list[Server]:
        out = []
        for server in self.servers:
            if server.process is None or server.process.poll() is not None:
                continue
            client = server.client()
            try:
                if client.info("replication").get("role") == "master":
                    out.append(server)
            except redis.RedisError:
                pass
            finally:
                client.close()
        return out

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def client(self) -> redis.RedisCluster:
        live = self._current_masters()[0]
        return redis.RedisCluster(host="127.0.0.1", port=live.port)

    def restart(self, *, persist: bool, down_s: float) -> None:
        victim = self._rng.choice(self._current_masters())
        victim.shutdown(save=persist)
        time.sleep(down_s)
        victim.start()

    def flushall(self) -> None:
        for server in self._current_masters():
            client = server.client()
            try:
                client.flushall()
            finally:
                client.close()

    def stall(self, seconds: float) -> None:
        self._rng.choice(self._current_masters()).stall(seconds)

    def failover(self) -> None:
        victim = self._rng.choice(self._current_masters())
        victim.kill()
        survivors = [s for s in self.servers if s is not victim]
        self._wait(lambda: len([s for s in survivors if s in self._current_masters()]) >= self.masters, 30)
        victim.start()  # it rejoins from its nodes.conf, as the new master's replica

    def pids(self) -> list[int]:
        return [s.pid for s in self.servers]


def make_topology(name: str) -> SingleRedis | SentinelRedis | ClusterRedis:
    if name == "single":
        return SingleRedis()
    if name == "sentinel":
        return SentinelRedis()
    if name == "cluster":
        return ClusterRedis()
    raise ValueError(f"unknown topology {name!r}: single, sentinel or cluster")

