"""The Redis under test, and the faults it can suffer, for each topology.

The deployments are the ones the test suite fails over (``sluice/embedded_redis.py``,
``sluice/embedded_failover.py``); this module only says which server each fault hits.

- ``single``: one ``redis-server``; restart with or without persistence, FLUSHALL, SIGSTOP.
- ``sentinel``: ``EmbeddedSentinel`` (one master, one replica, three sentinels), reached as
  ``redis+sentinel://host:port,host:port,host:port/<service>``; faults hit the current master,
  and a failover is ``SENTINEL FAILOVER`` (the replica becomes master, the old master its replica).
- ``cluster``: ``ReplicatedCluster`` (three masters, each with a replica); faults hit a random
  master, and a failover SIGKILLs it: its replica takes over, it comes back as that one's replica.

Every operation blocks (the fault runner calls them in a thread).

>>> topo = make_topology("single").start()
>>> topo.url; topo.restart(persist=False, down_s=0.5); topo.stop()
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Protocol, Self

import redis

from sluice.embedded_failover import EmbeddedSentinel, ReplicatedCluster
from sluice.embedded_redis import EmbeddedRedis


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

    def refuse_writes(self, seconds: float) -> None:
        """A master full (at its ``maxmemory``) for ``seconds``."""

    def ready_for_failover(self) -> None:
        """Wait until a failover could succeed (a replica linked to the master it replaces)."""

    def failover(self, promoted: Callable[[], None]) -> dict[str, float]:
        """Fail over, calling ``promoted()`` once the new master serves; seconds from its
        start to each of its steps."""


class SingleRedis:
    name = "single"

    def __init__(self) -> None:
        self.server = EmbeddedRedis()

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def port(self) -> int:
        return self.server.port

    def start(self) -> Self:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()

    def client(self) -> redis.Redis:
        return self.server.admin()

    def restart(self, *, persist: bool, down_s: float) -> None:
        self.server.shutdown(save=persist)
        time.sleep(down_s)
        self.server.start()

    def flushall(self) -> None:
        with self.server.admin() as client:
            client.flushall()

    def stall(self, seconds: float) -> None:
        self.server.stall(seconds)

    def refuse_writes(self, seconds: float) -> None:
        self.server.refuse_writes(seconds)

    def ready_for_failover(self) -> None:
        raise RuntimeError("a single Redis server has nothing to fail over to")

    def failover(self, promoted: Callable[[], None]) -> dict[str, float]:
        raise RuntimeError("a single Redis server has nothing to fail over to")


class SentinelRedis:
    name = "sentinel"

    def __init__(self) -> None:
        self.deployment = EmbeddedSentinel()

    @property
    def url(self) -> str:
        return self.deployment.url

    def start(self) -> Self:
        self.deployment.start()
        return self

    def stop(self) -> None:
        self.deployment.stop()

    def client(self) -> redis.Redis:
        return self.deployment.master().admin()

    def restart(self, *, persist: bool, down_s: float) -> None:
        self.deployment.restart_master(persist=persist, down_s=down_s)

    def flushall(self) -> None:
        self.deployment.flushall()

    def stall(self, seconds: float) -> None:
        self.deployment.stall_master(seconds)

    def refuse_writes(self, seconds: float) -> None:
        self.deployment.master().refuse_writes(seconds)

    def ready_for_failover(self) -> None:
        self.deployment.wait_replica_ready()

    def failover(self, promoted: Callable[[], None]) -> dict[str, float]:
        self.deployment.failover(promoted=promoted)
        return dict(self.deployment.phases)


class ClusterRedis:
    name = "cluster"

    def __init__(self, masters: int = 3) -> None:
        self.deployment = ReplicatedCluster(masters)
        self.masters = masters
        self._rng = random.Random(0)  # which master each fault hits: the same in every run

    @property
    def url(self) -> str:
        return self.deployment.url

    def start(self) -> Self:
        self.deployment.start()
        return self

    def stop(self) -> None:
        self.deployment.stop()

    def client(self) -> redis.RedisCluster:
        return self.deployment.client()

    def _victim(self) -> int:
        return self._rng.randrange(self.masters)

    def restart(self, *, persist: bool, down_s: float) -> None:
        self.deployment.restart_master(self._victim(), persist=persist, down_s=down_s)

    def flushall(self) -> None:
        self.deployment.flushall()

    def stall(self, seconds: float) -> None:
        self.deployment.master(self._victim()).stall(seconds)

    def refuse_writes(self, seconds: float) -> None:
        self.deployment.master(self._victim()).refuse_writes(seconds)

    def ready_for_failover(self) -> None:
        self.deployment.wait_replicated()

    def failover(self, promoted: Callable[[], None]) -> dict[str, float]:
        self.deployment.failover(self._victim(), promoted=promoted)
        return dict(self.deployment.phases)


def make_topology(name: str) -> SingleRedis | SentinelRedis | ClusterRedis:
    if name == "single":
        return SingleRedis()
    if name == "sentinel":
        return SentinelRedis()
    if name == "cluster":
        return ClusterRedis()
    raise ValueError(f"unknown topology {name!r}: single, sentinel or cluster")
