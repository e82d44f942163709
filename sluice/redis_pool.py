"""Creating the Redis client every process shares.

``SLUICE_REDIS_URL`` (or ``--redis-url``) takes one of three forms:

- ``redis://[user:password@]host:port[/db]``: one Redis server (``rediss://`` for TLS).
- ``redis+cluster://[user:password@]host:port[/]``: a Redis Cluster; any one node is
  enough, the client discovers the others (``rediss+cluster://`` for TLS). A cluster
  has only database 0. Every script Sluice runs names its keys with one hash tag
  (``sl:{model}:...``), so each script's keys share one slot.
- ``redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]``: the master
  that Redis Sentinel names for ``service``; the hosts are sentinels
  (``sluice/redis_url.py`` has the options). Every new connection asks the sentinels
  where the master is, so after a failover each process finds the new master by itself.

Query-string options of the first two pass through to redis-py (``?ssl_cert_reqs=none``).

After a failover (Sentinel or Cluster), a command on a connection to the old master
fails with a ``ConnectionError``, as when Redis is unreachable: the gateway answers 503 +
``Retry-After`` meanwhile, background loops retry, and the next connection goes to the
new master. A ``READONLY`` reply (a master demoted to replica while still reachable) is
turned into the same ``ConnectionError``. A Sentinel client does not wait for either:
the old master of a ``SENTINEL FAILOVER`` (or one that comes back after a crash) keeps
taking writes as a master for about ten seconds after the sentinels named another, until
they demote it (sentinel.c waits ``4 * SENTINEL_PUBLISH_PERIOD``, then its next ``INFO``),
and those writes are lost. Each process listens to its sentinel's ``+switch-master``
(and asks it every ``MASTER_CHECK_S``) and leaves the old master as soon as the sentinel
names the new one (:class:`FailoverPool`). What each family of keys does when the
failover lost writes the replica had not received is in ``sluice/failover.py``.

Either client keeps at most ``max_connections`` connections to each Redis server. A
command that finds none free waits up to ``POOL_TIMEOUT_S`` for one, then fails with
redis-py's ``ConnectionError("No connection available.")``. Blocking commands
(``XREAD BLOCK``, ``BLPOP``) hold a connection while they wait and must block for less
than ``SOCKET_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any, NoReturn, TypeAlias

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.exceptions import ClusterDownError, ReadOnlyError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import EncodableT

from sluice.redis_url import cluster_node_url, is_cluster_url, is_sentinel_url, parse

log = logging.getLogger("sluice.redis")

RedisClient: TypeAlias = Redis | RedisCluster

#: How long a command waits for a free connection before failing.
POOL_TIMEOUT_S = 5.0
SOCKET_CONNECT_TIMEOUT_S = 2.0
#: Well above the longest block Sluice asks for (XREAD BLOCK 1000).
SOCKET_TIMEOUT_S = 5.0
HEALTH_CHECK_INTERVAL_S = 30
#: The longest one Cluster command (or pipeline) may take, its retries, redirections and
#: topology refreshes included, before it fails with ``TimeoutError``. redis-py bounds
#: each socket read, not the command: a command whose master was killed under it, retried
#: across nodes and refreshes, once never returned (a suite run hung for hours), and a
#: stalled topology refresh held every command of a gateway (the nemesis, Cluster).
CLUSTER_COMMAND_DEADLINE_S = 12.0
#: After the sentinels said there is no master (mid-failover), connections fail at once
#: for this long instead of asking them again for every command.
NO_MASTER_BACKOFF_S = 0.2
#: How often a Sentinel client asks its sentinel which server is the master, besides
#: hearing its ``+switch-master`` event at once (the check covers a missed event).
MASTER_CHECK_S = 2.0
SWITCH_MASTER = "+switch-master"

Address: TypeAlias = tuple[str, int]


def redact_url(url: str) -> str:
    """The URL without its passwords, for logs and banners.

    >>> redact_url("redis+sentinel://:pw@h1,h2/sluice?sentinel_password=s")
    'redis+sentinel://***@h1,h2/sluice?sentinel_password=***'
    """
    return re.sub(r"(password=)[^&]*", r"\1***", re.sub(r"//[^@/]*@", "//***@", url))


async def create_pool(
    url: str, *, max_connections: int = 64, client_name: str | None = None,
    retries: int = 20, delay_s: float = 0.25,
) -> RedisClient:
    """Connect to ``url`` and PING it, retrying while the server comes up.

    ``client_name`` names every connection, as ``CLIENT LIST`` shows it.

    >>> redis = await create_pool("redis://127.0.0.1:6379/0", client_name="sluice-gateway")
    >>> cluster = await create_pool("redis+cluster://10.0.0.5:6379", max_connections=32)
    >>> master = await create_pool("redis+sentinel://10.0.0.7,10.0.0.8,10.0.0.9/sluice")
    """
    options: dict[str, Any] = {
        "socket_connect_timeout": SOCKET_CONNECT_TIMEOUT_S,
        "socket_timeout": SOCKET_TIMEOUT_S,
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
        "client_name": client_name,
        "max_connections": max_connections,
    }
    client: RedisClient
    if is_cluster_url(url):
        client = BoundedRedisCluster.from_url(cluster_node_url(url), **options)
    elif is_sentinel_url(url):
        client = _sentinel_master(url, options)
    else:
        pool = BlockingConnectionPool.from_url(url, timeout=POOL_TIMEOUT_S, **_closed_safe(url), **options)
        client = Redis.from_pool(pool)
    for attempt in range(1, retries + 1):
        try:
            await client.ping()
            return client
        except (
            RedisConnectionError, RedisTimeoutError, ClusterDownError, RedisClusterException, OSError,
        ) as exc:
            if attempt == retries:
                await client.aclose()
                raise
            if attempt == 1 or attempt % 40 == 0:  # a long wait logs every ~10 s, not 4 times a second
                log.warning(
                    "redis %s not reachable (%s), retry %d/%d", redact_url(url), exc, attempt, retries
                )
            await asyncio.sleep(delay_s)
    raise AssertionError("unreachable")


def _closed_safe(url: str) -> dict[str, Any]:
    """The connection class for a single server's URL: closed-safe (:class:`_ClosedSafe`)
    over TCP or TLS; a unix socket keeps redis-py's own."""
    scheme = url.split("://", 1)[0]
    if scheme == "rediss":
        return {"connection_class": _ClosedSafeSSLConnection}
    return {"connection_class": _ClosedSafeConnection} if scheme == "redis" else {}


async def connections_by_name(client: RedisClient) -> dict[str, int]:
    """Open connections per client name (``""`` for unnamed ones) on the busiest server.

    A single server is counted as is. In a cluster each master is counted on its own
    and the largest count per name is kept: ``max_connections`` bounds each server, so
    a cluster client may hold that many on every master.

    >>> await connections_by_name(redis)
    {'sluice-gateway': 12, 'sluice-worker': 3}
    """
    if isinstance(client, RedisCluster):
        await client.initialize()
        lists = [await client.client_list(target_nodes=node) for node in client.get_primaries()]
    else:
        lists = [await client.client_list()]
    busiest: dict[str, int] = {}
    for clients in lists:
        for name, count in Counter(str(entry.get("name", "")) for entry in clients).items():
            busiest[name] = max(busiest.get(name, 0), count)
    return busiest


_permit_of: ContextVar[_Bound | None] = ContextVar("sluice_redis_permit", default=None)


class _Bound:
    """At most ``limit`` commands in flight; the rest wait up to ``timeout_s``.

    A call made from inside a bounded one in the same task (a pipeline re-sending a
    redirected command) runs on its caller's permit, so it cannot deadlock waiting
    for a permit its own caller holds.
    """

    def __init__(self, limit: int, timeout_s: float) -> None:
        self._semaphore = asyncio.Semaphore(limit)
        self._timeout_s = timeout_s

    @asynccontextmanager
    async def permit(self) -> AsyncIterator[None]:
        if _permit_of.get() is self:
            yield
            return
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._semaphore.acquire()
        except TimeoutError as exc:
            raise RedisConnectionError("No connection available.") from exc
        token = _permit_of.set(self)
        try:
            yield
        finally:
            _permit_of.reset(token)
            self._semaphore.release()


class BoundedRedisCluster(RedisCluster):
    """A ``RedisCluster`` whose callers wait for a connection instead of failing.

    redis-py's cluster client raises ``MaxConnectionsError`` as soon as a node's
    ``max_connections`` are all busy. Here every command and every pipeline first
    takes one of ``max_connections - 1`` permits. A permit uses at most one connection
    per node at a time (a pipeline or an all-nodes command runs one batch per node),
    so no node's pool can run dry, and no node sees more than ``max_connections``
    connections, the topology one included. Not bounded: pub/sub, and a transaction
    pipeline between ``watch()`` and ``execute()``.
    """

    def __init__(self, *, max_connections: int = 64, **kwargs: Any) -> None:
        if max_connections < 2:
            raise ValueError("a cluster client needs max_connections >= 2")
        # One connection is left for topology: redis-py asks the startup node for
        # CLUSTER SLOTS over a pool of its own, beside that node's command pool.
        super().__init__(max_connections=max_connections - 1, **kwargs)
        self.bound = _Bound(max_connections - 1, POOL_TIMEOUT_S)
        # redis-py fixes the connection class in __init__; the nodes found later are made
        # from connection_kwargs, the startup nodes (no connection yet) already exist.
        plain = self.connection_kwargs["connection_class"]
        closed_safe = _ClosedSafeSSLConnection if issubclass(plain, SSLConnection) else _ClosedSafeConnection
        self.connection_kwargs["connection_class"] = closed_safe
        for node in [*self.startup_nodes, *self.nodes_manager.startup_nodes.values()]:
            node.connection_class = closed_safe

    async def execute_command(self, *args: EncodableT, **kwargs: Any) -> Any:
        async with self.bound.permit(), _deadline(args[0]), _unreachable_is_connection_error():
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        if shard_hint:
            raise RedisClusterException("shard_hint is deprecated in cluster mode")
        # redis-py's own stubs call ClusterPipeline abstract (_event_dispatcher); it is not.
        return _BoundedPipeline(self, transaction)  # type: ignore[abstract]


class _BoundedPipeline(ClusterPipeline):
    cluster_client: BoundedRedisCluster

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        async with self.cluster_client.bound.permit(), _deadline("pipeline"), _unreachable_is_connection_error():
            return await super().execute(raise_on_error, allow_redirections)


@contextlib.asynccontextmanager
async def _deadline(what: Any) -> AsyncIterator[None]:
    """At most ``CLUSTER_COMMAND_DEADLINE_S`` for one Cluster command, whatever redis-py
    retries inside it; past that a ``TimeoutError``, which every Redis caller handles."""
    try:
        async with asyncio.timeout(CLUSTER_COMMAND_DEADLINE_S):
            yield
    except TimeoutError as exc:
        raise RedisTimeoutError(f"the Redis Cluster did not answer {what!r} within "
                                f"{CLUSTER_COMMAND_DEADLINE_S:g} s") from exc


@contextlib.asynccontextmanager
async def _unreachable_is_connection_error() -> AsyncIterator[None]:
    """A cluster none of whose nodes answers is a ``ConnectionError``. redis-py raises
    ``RedisClusterException`` ("Redis Cluster cannot be connected"), which is no
    ``RedisError``: every ``except (RedisError, OSError)`` missed it, so a loop that keeps
    going through Redis outages (the key keeper, the journal keeper, the lease reaper)
    ended for good, and a request got a 500 (the nemesis, Cluster: its own data watcher
    died of it, every node stalled at once). Only this case: the same class also reports
    mistakes such as keys of one call in different slots, which stay what they are."""
    try:
        yield
    except RedisClusterException as exc:
        if isinstance(exc, RedisError) or not isinstance(exc.__cause__, (RedisError, OSError)):
            raise
        raise RedisConnectionError(str(exc)) from exc


def _is_closed_transport(exc: BaseException) -> bool:
    """Whether ``exc`` is how a connection that another task closed mid-command fails:
    its stream attributes are ``None`` already (``AttributeError`` on ``None``), or
    the event loop refuses the closed transport (uvloop's ``RuntimeError``)."""
    if isinstance(exc, AttributeError):
        return exc.obj is None
    return isinstance(exc, RuntimeError) and "closed" in str(exc)


class _ClosedSafe:
    """A connection on which a transport closed underneath a command is a
    ``ConnectionError``. During a failover redis-py's cluster client disconnects a node's
    connections while other tasks are mid-command on them; a server that restarts closes
    a connection between its connect and its first command (the nemesis: one 500 on a
    single server, ``RuntimeError: unable to perform operation on <TCPTransport
    closed=True>`` from the connect's own health check). Those commands then fail with
    whatever the closed stream raises, which no ``except (RedisError, OSError)`` catches
    and which skips the client's own reconnect handling."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        try:
            await super().send_packed_command(command, check_health)  # type: ignore[misc]
        except (AttributeError, RuntimeError) as exc:
            await self._closed_underneath(exc, "writing to")

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)  # type: ignore[misc]
        except (AttributeError, RuntimeError) as exc:
            await self._closed_underneath(exc, "reading from")

    async def _closed_underneath(self, exc: AttributeError | RuntimeError, doing: str) -> NoReturn:
        if not _is_closed_transport(exc):
            raise exc
        await self.disconnect(nowait=True)  # type: ignore[attr-defined]
        raise RedisConnectionError(
            f"connection closed while {doing} {self.host}:{self.port}: {exc}") from exc  # type: ignore[attr-defined]


class _ClosedSafeConnection(_ClosedSafe, Connection):
    pass


class _ClosedSafeSSLConnection(_ClosedSafe, SSLConnection):
    pass


#: The connection classes of a plain TCP single-server pool (sluice/script_channel.py
#: speaks to such a server on a socket of its own).
PLAIN_TCP_CONNECTIONS: tuple[type[Connection], ...] = (Connection, _ClosedSafeConnection)


def _sentinel_master(url: str, options: dict[str, Any]) -> Redis:
    target = parse(url)
    sentinels = Sentinel(
        list(target.sentinels),
        sentinel_kwargs={"socket_connect_timeout": SOCKET_CONNECT_TIMEOUT_S, "socket_timeout": SOCKET_TIMEOUT_S,
                         **target.sentinel_kwargs()},
    )
    client: Redis = sentinels.master_for(
        target.service, connection_pool_class=FailoverPool, connection_class=FailoverConnection,
        timeout=POOL_TIMEOUT_S, **options, **target.master_kwargs(),
    )
    client.connection_pool.watch()
    return client


def is_demotion(error: ResponseError | str) -> bool:
    """Whether an error reply says the server is a replica now. Redis 7 answers a write
    with ``READONLY ...`` (redis-py's ``ReadOnlyError``); Redis 6 wraps it in a script's
    error (``ERR Error running script ... -READONLY You can't write ...``)."""
    return isinstance(error, ReadOnlyError) or "READONLY You can't write" in str(error)


class FailoverConnection(_ClosedSafe, SentinelManagedConnection):
    """A connection to the master the sentinels name; a demoted master's ``READONLY`` is a
    ``ConnectionError`` (and the connection is dropped, so the next one asks again),
    whether it answered a command or a script."""

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except ResponseError as exc:
            if not is_demotion(exc):
                raise
            await self.disconnect()
            raise RedisConnectionError(f"{self.host}:{self.port} is no longer the master") from exc


class FailoverPool(SentinelConnectionPool, BlockingConnectionPool):  # type: ignore[misc]
    """redis-py's Sentinel pool, blocking like :class:`BlockingConnectionPool` (a command
    waits for a free connection up to ``POOL_TIMEOUT_S``), and:

    - it follows the master (:meth:`watch`): when its sentinel announces another one
      (``+switch-master``, or the answer to a check every ``MASTER_CHECK_S``), idle
      connections to the old one are closed, busy ones when handed back, and whatever
      :meth:`follow` registered (the script channel) is told. redis-py asks the sentinels
      only when it opens a connection, so its open ones stayed with a demoted master
      that was still taking writes;
    - a connection handed back while connected to an address that is no longer the
      master is closed (redis-py keeps it and would send the next command to the old
      master, which a partition may have left running);
    - while the sentinels report no master (the seconds between a master's death and a
      replica's promotion), connections fail at once for ``NO_MASTER_BACKOFF_S`` instead
      of asking every sentinel again for every command;
    - closing the pool stops the watch and closes the connections to the sentinels too
      (the client owns them).
    """

    def __init__(self, service_name: str, sentinel_manager: Sentinel, **kwargs: Any) -> None:
        super().__init__(service_name, sentinel_manager, **kwargs)
        self._no_master_until = 0.0
        self._no_master: MasterNotFoundError | None = None
        self._followers: list[Callable[[Address], None]] = []
        self._watch: asyncio.Task[None] | None = None
        self._closing = False

    def follow(self, moved: Callable[[Address], None]) -> None:
        """Call ``moved(address)`` whenever the master is found at another address."""
        self._followers.append(moved)

    def watch(self) -> None:
        """Start following the master's moves in the background (until :meth:`aclose`)."""
        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._watch_master(), name="sentinel-watch")

    async def _watch_master(self) -> None:
        """Listen to the first sentinel's ``+switch-master`` and ask it for the master after
        each event, and every ``MASTER_CHECK_S`` without one. ``discover_master`` puts the
        sentinel that answered first, so the events and the answers come from one sentinel:
        a sentinel a moment behind the others cannot take the process back and forth."""
        while not self._closing:
            try:
                async with self.sentinel_manager.sentinels[0].pubsub() as events:
                    await events.subscribe(SWITCH_MASTER)
                    while not self._closing:
                        with contextlib.suppress(MasterNotFoundError):
                            await self.get_master_address()
                        await events.get_message(ignore_subscribe_messages=True, timeout=MASTER_CHECK_S)
            except (RedisError, OSError) as exc:
                # That sentinel is gone: asking them all puts one that answers first.
                log.info("redis sentinel: watching for master changes again (%s)", exc)
                await asyncio.sleep(NO_MASTER_BACKOFF_S)
                with contextlib.suppress(RedisError, OSError):
                    await self.get_master_address()

    async def get_master_address(self) -> tuple[str, int]:
        now = asyncio.get_running_loop().time()
        if self._no_master is not None and now < self._no_master_until:
            raise MasterNotFoundError(str(self._no_master))
        before = self.master_address
        try:
            address: tuple[str, int] = await super().get_master_address()
        except MasterNotFoundError as exc:
            self._no_master, self._no_master_until = exc, now + NO_MASTER_BACKOFF_S
            log.warning("redis sentinel: %s", exc)
            raise
        if self._no_master is not None:
            self._no_master = None
            log.info("redis sentinel: master of %r is %s:%s", self.service_name, *address)
        if before is not None and address != before:
            log.warning("redis sentinel: the master of %r moved from %s:%s to %s:%s", self.service_name,
                        *before, *address)
            for moved in self._followers:
                moved(address)
        return address

    async def release(self, connection: Any) -> None:
        if (self.master_address is not None and connection.is_connected
                and (connection.host, connection.port) != self.master_address):
            await connection.disconnect()
        await super().release(connection)

    async def aclose(self) -> None:
        self._closing = True
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()
            # The nemesis saw a restarted gateway's start-up wait 90 s here while its watch went
            # on logging: a cancellation was lost (redis-py's reads run under timeouts of their
            # own). The flag ends the loop at its next turn, and closing never waits longer.
            await asyncio.wait({watch}, timeout=MASTER_CHECK_S + SOCKET_TIMEOUT_S)
        await super().aclose()
        await self.sentinel_manager.aclose()
