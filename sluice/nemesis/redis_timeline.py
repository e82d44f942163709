"""What each Redis server of the run was, over time: the harness's view of the topology.

A thread asks every server of the topology, ten times a second, its role, whether its
replication link is up and whether it holds the API keys, and for Sentinel
which master the sentinels name; it keeps each change with its time. A forbidden outcome
during a failover is then read against what Redis really was (two masters at once, a
replica promoted before its first sync, keys missing on the master the gateways used).

>>> timeline = RedisTimeline(system.topology, t0).start()
>>> ...; timeline.stop(); timeline.changes[:3]
[(0.0, '41234', 'master with the API keys'), ...]
"""

from __future__ import annotations

import contextlib
import threading
import time

import redis

from sluice import keys
from sluice.embedded_redis import EmbeddedRedis
from sluice.nemesis.topology import ClusterRedis, SentinelRedis, SingleRedis

#: Changes kept (a full run has a few thousand).
MAX_CHANGES = 20_000


def _state(server: EmbeddedRedis) -> str:
    if server.process is None or server.process.poll() is not None:
        return "down"
    try:
        with redis.Redis(port=server.port, socket_timeout=0.3, socket_connect_timeout=0.3) as client:
            info = client.info("replication")
            role = str(info.get("role"))
            if role == "slave":
                role += f"(link {info.get('master_link_status')} to {info.get('master_port')})"
            return role + (" with the API keys" if client.exists(keys.API_KEYS) else " without the API keys")
    except redis.TimeoutError:
        return "stalled"
    except redis.RedisError as exc:
        return f"error {type(exc).__name__}"


class RedisTimeline:
    def __init__(self, topology: SingleRedis | SentinelRedis | ClusterRedis, t0: float, period_s: float = 0.1) -> None:
        self.topology = topology
        self.t0 = t0
        self.period_s = period_s
        #: (seconds since t0, who, state), one entry per change.
        self.changes: list[tuple[float, str, str]] = []
        self._last: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="redis-timeline", daemon=True)

    def _servers(self) -> list[EmbeddedRedis]:
        if isinstance(self.topology, SingleRedis):
            return [self.topology.server]
        return list(self.topology.deployment.servers)

    def _named_master(self) -> str | None:
        if not isinstance(self.topology, SentinelRedis):
            return None
        names = []
        for sentinel in self.topology.deployment.sentinels:
            try:
                with redis.Redis(port=sentinel.port, socket_timeout=0.3) as client:
                    names.append(str(client.sentinel_get_master_addr_by_name(self.topology.deployment.service)[1]))
            except redis.RedisError:
                names.append("?")
        return ",".join(names)

    def _note(self, who: str, state: str) -> None:
        if self._last.get(who) != state and len(self.changes) < MAX_CHANGES:
            self._last[who] = state
            self.changes.append((round(time.monotonic() - self.t0, 2), who, state))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            with contextlib.suppress(Exception):  # a diagnostic: never the run's failure
                for server in self._servers():
                    self._note(str(server.port), _state(server))
                named = self._named_master()
                if named is not None:
                    self._note("sentinels", f"name {named}")

    def start(self) -> RedisTimeline:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
