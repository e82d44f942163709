"""The per-request Lua scripts (admission's, rate limits') over one pipelined connection
per process for each of the two.

Every request runs two scripts (ACQUIRE, RELEASE). Through redis-py each call checks a
connection out of the pool, packs its 26-40 arguments one by one, runs retry and
deprecation wrappers and checks the connection back in: about a quarter of a gateway's CPU
per request in the request-bound profile (loadtest/peers/README.md). Here a call packs its
arguments once (the keys' part is cached per key set), writes them on a connection that
stays open and waits for its reply, which a reader task hands out in order (Redis answers
one connection's commands in the order they were sent). Calls from many requests share the
connection without waiting for each other's round trips, as in a pipeline.

For a plain single Redis server (``redis://``) and for the master Redis Sentinel names
(``redis+sentinel://``): there each new connection asks the sentinels where the master is,
checks with ``ROLE`` that it got one, and a ``READONLY`` reply (the master was demoted)
closes the connection like a lost one. A Cluster, TLS or a Unix socket keep redis-py's
scripts (:func:`script_runner` decides), which route and secure each call. Errors are
redis-py's (``ConnectionError``, ``TimeoutError``, ``ResponseError``), so callers handle
both runners the same way.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import hiredis
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.redis_pool import (
    NO_MASTER_BACKOFF_S,
    SOCKET_CONNECT_TIMEOUT_S,
    SOCKET_TIMEOUT_S,
    FailoverPool,
    RedisClient,
    is_demotion,
)

Address = tuple[str, int]

log = logging.getLogger("sluice.redis")


class Script(Protocol):
    async def __call__(self, keys: Sequence[str] = (), args: Sequence[Any] = ()) -> Any: ...


class ScriptRunner(Protocol):
    def register_script(self, script: str) -> Script: ...


def script_runner(client: RedisClient) -> ScriptRunner:
    """A :class:`ScriptChannel` for a plain single-server client or a Sentinel-managed
    master, else the client itself."""
    if not isinstance(client, Redis):
        return client
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    login = {"db": int(kwargs.get("db") or 0), "username": kwargs.get("username"),
             "password": kwargs.get("password")}
    if pool.connection_class is Connection:
        return ScriptChannel(str(kwargs.get("host", "localhost")), int(kwargs.get("port", 6379)), **login)
    if isinstance(pool, FailoverPool):
        async def master() -> Address:
            host, port = await pool.get_master_address()
            return str(host), int(port)

        channel = ScriptChannel.following(master, **login)
        pool.follow(channel.moved)  # leave the old master as soon as the pool hears of a new one
        return channel
    return client


def _bulk(value: Any) -> bytes:
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, str):
        data = value.encode()
    elif isinstance(value, bool):
        raise TypeError("a bool is no Redis argument")
    elif isinstance(value, int | float):
        data = repr(value).encode()
    else:
        raise TypeError(f"a {type(value).__name__} is no Redis argument")
    return b"$%d\r\n%b\r\n" % (len(data), data)


def _command(*words: Any) -> bytes:
    return b"*%d\r\n" % len(words) + b"".join(_bulk(w) for w in words)


#: Packed key sets one script keeps (a few hundred models' worth).
_HEADS_BYTES = 1 << 20


class ChannelScript:
    """One Lua script on a :class:`ScriptChannel`, called like redis-py's."""

    def __init__(self, channel: ScriptChannel, source: str) -> None:
        self._channel = channel
        self._source = source
        self._sha = hashlib.sha1(source.encode()).hexdigest()
        #: The packed "EVALSHA sha numkeys key..." part, per key set (keys name what clients
        #: name: bounded by bytes, emptied when full).
        self._heads: dict[tuple[str, ...], bytes] = {}
        self._head_bytes = 0

    async def __call__(self, keys: Sequence[str] = (), args: Sequence[Any] = ()) -> Any:
        key_set = tuple(keys)
        head = self._heads.get(key_set)
        if head is None:
            head = b"".join(_bulk(w) for w in ("EVALSHA", self._sha, len(key_set), *key_set))
            if self._head_bytes + len(head) > _HEADS_BYTES:
                self._heads.clear()
                self._head_bytes = 0
            self._heads[key_set] = head
            self._head_bytes += len(head)
        packed = b"*%d\r\n%b%b" % (3 + len(key_set) + len(args), head, b"".join(_bulk(a) for a in args))
        reply = await self._channel.request(packed)
        if isinstance(reply, hiredis.ReplyError) and str(reply).startswith("NOSCRIPT"):
            # EVAL runs it and leaves it cached for the next EVALSHA.
            reply = await self._channel.request(_command("EVAL", self._source, len(key_set), *key_set, *args))
        if isinstance(reply, hiredis.ReplyError):
            if is_demotion(str(reply)):
                # The server is a replica now (a failover demoted it): nothing more on this
                # connection can succeed; the next call finds the master again.
                raise self._channel.demoted()
            raise ResponseError(str(reply))
        return reply


async def _one_reply(reader: asyncio.StreamReader) -> Any:
    parser = hiredis.Reader()
    reply: Any = False
    while reply is False:
        data = await reader.read(4096)
        if not data:
            raise ConnectionResetError("Redis closed the connection")
        parser.feed(data)
        reply = parser.gets()
    return reply


class ScriptChannel:
    """One connection to one Redis server carrying every script call of this process.

    >>> channel = ScriptChannel("127.0.0.1", 6379)
    >>> channel = ScriptChannel.following(find_master)  # asked again for each new connection
    """

    def __init__(self, host: str, port: int, *, db: int = 0, username: str | None = None,
                 password: str | None = None, timeout_s: float = SOCKET_TIMEOUT_S) -> None:
        self._address = (host, port)
        #: Where to connect next; set for a server that moves (a Sentinel-managed master).
        self._locate: Callable[[], Awaitable[Address]] | None = None
        self._no_master_until = 0.0
        self._hello: list[bytes] = []
        if password is not None:
            self._hello.append(_command("AUTH", *([username] if username else []), password))
        if db:
            self._hello.append(_command("SELECT", db))
        self._timeout_s = timeout_s
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._pending: collections.deque[asyncio.Future[Any]] = collections.deque()
        self._outbox: list[bytes] = []
        self._connecting: asyncio.Lock | None = None

    @classmethod
    def following(cls, locate: Callable[[], Awaitable[Address]], **login: Any) -> ScriptChannel:
        """A channel to whichever server ``locate()`` names when it connects, which must be
        a master (``ROLE``); used for the master Redis Sentinel names."""
        channel = cls("", 0, **login)
        channel._locate = locate
        channel._hello.append(_command("ROLE"))
        return channel

    def register_script(self, script: str) -> ChannelScript:
        return ChannelScript(self, script)

    def moved(self, master: Address) -> None:
        """The master is at ``master`` now: leave the server this channel is connected to if it
        is another (the calls on their way there fail like on a lost connection)."""
        if self._writer is not None and self._address != master:
            log.warning("script connection: the master moved to %s:%s; leaving %s:%s", *master, *self._address)
            self._drop(RedisConnectionError(f"{self._address[0]}:{self._address[1]} is no longer the master"))

    def demoted(self) -> RedisConnectionError:
        """Close the connection to a server that answered READONLY; the error to raise."""
        error = RedisConnectionError(f"{self._address[0]}:{self._address[1]} is no longer the master")
        self._drop(error)
        return error

    async def request(self, packed: bytes) -> Any:
        """Send one packed command; its reply (a ``hiredis.ReplyError`` for an error reply)."""
        writer = self._writer
        if writer is None or writer.is_closing():
            if writer is not None:  # closed under us: fail what it owed before anything new is sent
                self._drop(RedisConnectionError("connection to Redis lost"))
            await self._connect()
            if self._writer is None:  # connected, and lost again at once
                raise RedisConnectionError("connection to Redis lost")
        # Invariant: the bytes in the outbox and on the wire belong, in order, to the futures
        # in ``_pending``, all on the current connection (``_drop`` clears all three).
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append(future)
        # Calls made in one turn of the event loop leave in one write (one system call).
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(packed)
        try:
            async with asyncio.timeout(self._timeout_s):
                # A caller cancelled meanwhile cancels only its own future: the reader skips it.
                return await future
        except TimeoutError:
            # Redis did not answer in time: this connection's replies can no longer be trusted
            # to arrive; every call on it fails and the next one connects again.
            self._drop(RedisTimeoutError(f"no reply from Redis within {self._timeout_s:g}s"))
            raise RedisTimeoutError(f"no reply from Redis within {self._timeout_s:g}s") from None

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        if outbox and self._writer is not None:
            self._writer.write(b"".join(outbox))

    async def _connect(self) -> None:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._writer is not None and not self._writer.is_closing():
                return
            writer = None
            if self._locate is not None:
                now = asyncio.get_running_loop().time()
                if now < self._no_master_until:  # mid-failover: do not ask the sentinels per call
                    raise RedisConnectionError("no Redis master (a failover is under way)")
                try:
                    self._address = await self._locate()
                except RedisConnectionError:
                    self._no_master_until = now + NO_MASTER_BACKOFF_S
                    raise
            try:
                async with asyncio.timeout(SOCKET_CONNECT_TIMEOUT_S):
                    reader, writer = await asyncio.open_connection(*self._address)
                    for command in self._hello:  # AUTH, SELECT, ROLE
                        writer.write(command)
                        reply = await _one_reply(reader)
                        if isinstance(reply, hiredis.ReplyError):
                            raise RedisConnectionError(f"Redis refused the connection: {reply}")
                        if isinstance(reply, list) and reply and reply[0] != b"master":
                            raise RedisConnectionError(f"{self._address[0]}:{self._address[1]} is a "
                                                       f"{reply[0].decode()}, not the master (mid-failover)")
            except BaseException as exc:
                if writer is not None:
                    writer.close()
                if isinstance(exc, OSError | TimeoutError):
                    raise RedisConnectionError(f"cannot reach Redis at {self._address[0]}:{self._address[1]}: "
                                               f"{type(exc).__name__}") from None
                raise
            self._writer = writer
            self._reader_task = asyncio.get_running_loop().create_task(self._read(reader, writer),
                                                                       name="script-channel")

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        parser = hiredis.Reader()
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    raise ConnectionResetError("Redis closed the connection")
                parser.feed(data)
                while (reply := parser.gets()) is not False:
                    future = self._pending.popleft()
                    if not future.done():
                        future.set_result(reply)
        except (OSError, hiredis.ProtocolError, IndexError) as exc:  # the replies it owed are gone too
            if self._writer is writer:
                log.warning("script connection to Redis lost: %s", exc)
                self._drop(RedisConnectionError(f"connection to Redis lost: {type(exc).__name__}"))

    def _drop(self, error: Exception) -> None:
        self._outbox = []  # unsent: their calls fail below
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        task, self._reader_task = self._reader_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        pending, self._pending = self._pending, collections.deque()
        for future in pending:
            if not future.done():
                future.set_exception(error)

    async def aclose(self) -> None:
        task = self._reader_task
        self._drop(RedisConnectionError("closed"))
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
