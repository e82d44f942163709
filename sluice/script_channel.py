"""The per-request Lua scripts (admission's, rate limits', resumable streams') over one
pipelined connection per process for each of the three; the resumable streams' pipelines
(a claim with the loss watch's look after it, a journal round) on theirs.

Every request runs two scripts (ACQUIRE, RELEASE). Through redis-py each call checks a
connection out of the pool, packs its 26-40 arguments one by one, runs retry and
deprecation wrappers and checks the connection back in: about a quarter of a gateway's CPU
per request in the request-bound profile (loadtest/peers/README.md). Here a call packs its
arguments once (the keys' part is cached per key set), writes them on a connection that
stays open and waits for its reply, which the connection's read callback hands out in order
(Redis answers one connection's commands in the order they were sent). Calls from many
requests share the connection without waiting for each other's round trips, as in a pipeline.

A call is a future, not a coroutine, and replies are handed out from the read callback, not
by a reader task; one timer per connection watches for an overdue reply, not an
``asyncio.timeout`` per call. Each task hop is one more turn of a busy event loop before a
request goes on: with a reader task, and admission running its call as a task of its own
(it must see the reply even when cancelled), ACQUIRE took three turns more than a plain
await of its reply (loadtest/peers/README.md: what those turns cost under load).

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
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.redis_pool import (
    NO_MASTER_BACKOFF_S,
    PLAIN_TCP_CONNECTIONS,
    SOCKET_CONNECT_TIMEOUT_S,
    SOCKET_TIMEOUT_S,
    FailoverPool,
    RedisClient,
    is_demotion,
)

Address = tuple[str, int]

log = logging.getLogger("sluice.redis")


class Script(Protocol):
    def __call__(self, keys: Sequence[str] = (), args: Sequence[Any] = ()) -> Awaitable[Any]: ...


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
    if pool.connection_class in PLAIN_TCP_CONNECTIONS:
        return ScriptChannel(str(kwargs.get("host", "localhost")), int(kwargs.get("port", 6379)), **login)
    if isinstance(pool, FailoverPool):
        async def master() -> Address:
            host, port = await pool.get_master_address()
            return str(host), int(port)

        channel = ScriptChannel.following(master, **login)
        pool.follow(channel.moved)  # leave the old master as soon as the pool hears of a new one
        return channel
    return client


class Packed:
    """Arguments packed once and sent as they are with every call: a process's constants
    that lead every admission script's arguments (the gateway's id, the lease TTL, ...),
    packed at each call before. Only a :class:`ScriptChannel`'s scripts take one, as their
    first argument (redis-py's are given the values)."""

    __slots__ = ("data", "values")

    def __init__(self, values: Sequence[Any]) -> None:
        self.values = tuple(values)
        self.data = _bulks(self.values)


def _count(values: Sequence[Any]) -> int:
    """How many arguments ``values`` are, a leading :class:`Packed` run counted by its own
    (the only place :func:`_bulks` takes one)."""
    count = len(values)
    if count and type(values[0]) is Packed:  # (where admission puts its constants)
        count += len(values[0].values) - 1
    return count


def _bulks(values: Sequence[Any]) -> bytes:
    """The values (``str``, ``int``, ``float``, ``bytes``; a :class:`Packed` run only first, as
    it was packed) as Redis bulk strings, joined: by hiredis's packer, in C. A journal round
    packs hundreds of values (each event and its state), and the same work in Python, a type
    test and a format per value, was 10 % of a gateway's samples at 64 resumable 128-token
    streams (loadtest/peers/README.md). Anything else is a ``TypeError``: a ``bool`` as before,
    an ``int`` enum too (it was packed as its repr)."""
    if not values:
        return b""
    if type(values[0]) is Packed:
        return values[0].data + _bulks(values[1:])
    packed = hiredis.pack_command(values if type(values) is tuple else tuple(values))
    return packed[packed.index(b"\n") + 1:]  # less the array's header


def _command(*words: Any) -> bytes:
    return hiredis.pack_command(words)


_INFO_SERVER = _command("INFO", "server")


#: Packed key sets one script keeps (a few hundred models' worth).
_HEADS_BYTES = 1 << 20


class ChannelScript:
    """One Lua script on a :class:`ScriptChannel`, called like redis-py's.

    A call on a connected channel returns the reply's future itself, not a coroutine: no
    frame or task of its own per call, and a caller that must not lose the reply when it is
    cancelled (admission's ACQUIRE) shields that future directly."""

    def __init__(self, channel: ScriptChannel, source: str) -> None:
        self._channel = channel
        #: As redis-py's scripts name them (a pipeline's ``evalsha`` takes the sha).
        self.script = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        #: The packed "EVALSHA sha numkeys key..." part, per key set (keys name what clients
        #: name: bounded by bytes, emptied when full).
        self._heads: dict[tuple[str, ...], bytes] = {}
        self._head_bytes = 0

    def __call__(self, keys: Sequence[str] = (), args: Sequence[Any] = ()) -> asyncio.Future[Any]:
        key_set = tuple(keys)
        head = self._heads.get(key_set)
        if head is None:
            head = _bulks(("EVALSHA", self.sha, len(key_set), *key_set))
            if self._head_bytes + len(head) > _HEADS_BYTES:
                self._heads.clear()
                self._head_bytes = 0
            self._heads[key_set] = head
            self._head_bytes += len(head)
        packed = b"*%d\r\n%b%b" % (3 + len(key_set) + _count(args), head, _bulks(args))
        call = _Call(self, key_set, args)
        if self._channel.connected():
            return self._channel.submit(packed, call)
        return asyncio.ensure_future(self._channel.request(packed, call))

    def evaluate(self, keys: Sequence[str], args: Sequence[Any]) -> bytes:
        """EVAL with the source: runs it, and leaves it cached for the next EVALSHA."""
        return b"*%d\r\n%b%b" % (3 + len(keys) + _count(args), _bulks(("EVAL", self.script, len(keys), *keys)),
                                  _bulks(args))


class _Call:
    """What a script call's reply becomes: NOSCRIPT sends it again as EVAL (Redis restarted
    or flushed its scripts), an error reply raises redis-py's error."""

    __slots__ = ("args", "keys", "retried", "script")

    def __init__(self, script: ChannelScript, keys: tuple[str, ...], args: Sequence[Any],
                 retried: bool = False) -> None:
        self.script, self.keys, self.args, self.retried = script, keys, args, retried

    def settle(self, channel: ScriptChannel, future: asyncio.Future[Any], reply: Any) -> None:
        if not isinstance(reply, hiredis.ReplyError):
            future.set_result(reply)
            return
        if str(reply).startswith("NOSCRIPT") and not self.retried:
            channel.resubmit(future, self.script.evaluate(self.keys, self.args),
                             _Call(self.script, self.keys, self.args, retried=True))
            return
        future.set_exception(channel.error(reply))


class ChannelPipeline:
    """The part of redis-py's pipeline that the resumable streams' hot path uses (an
    Idempotency-Key's claim with the loss watch's look after it, a journal round's scripts),
    on a :class:`ScriptChannel`: queued commands leave in one write, in order. Replies are
    redis-py's: raw, ``INFO server`` as a dict (its ``run_id``), an error reply raised, or
    returned in its place with ``raise_on_error=False`` (``NoScriptError`` for ``NOSCRIPT``:
    the script is not sent again here, as redis-py's pipeline does not); a lost connection
    raised. Arguments are plain values (no :class:`Packed`)."""

    __slots__ = ("_channel", "_queued")

    def __init__(self, channel: ScriptChannel) -> None:
        self._channel = channel
        #: Each command packed (empty: ``INFO server``, answered by the connection).
        self._queued: list[bytes] = []

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> ChannelPipeline:
        self._queued.append(_command("EVALSHA", sha, numkeys, *keys_and_args))
        return self

    def hget(self, name: str, key: str) -> ChannelPipeline:
        self._queued.append(_command("HGET", name, key))
        return self

    def info(self, section: str) -> ChannelPipeline:
        """``INFO server``, answered without a command: its ``run_id`` alone, which the
        connection read when it opened (a connection talks to one server process for its
        life: a restart or a failover is a new connection). The loss watch's look at every
        fresh claim asked Redis for the whole section, about 1 KB made and parsed per
        resumable request. (No other section is asked for here.)"""
        assert section == "server", f"a channel's pipeline answers INFO server only, not {section}"
        self._queued.append(b"")
        return self

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        channel = self._channel
        queued, self._queued = self._queued, []
        await channel.connect()
        server = {"run_id": channel.server_id}  # (submitted at once: on the connection it names)
        replies = await asyncio.gather(*(channel.submit(packed) for packed in queued if packed),
                                       return_exceptions=True)
        lost = next((r for r in replies if isinstance(r, BaseException) and not isinstance(r, hiredis.ReplyError)),
                    None)
        if lost is not None:  # the connection's (error replies are replies; every one after it failed alike)
            raise lost
        results: list[Any] = []
        answered = iter(replies)
        for packed in queued:
            if not packed:
                results.append(server)
                continue
            reply = next(answered)
            if isinstance(reply, hiredis.ReplyError):
                error = channel.error(reply)
                if raise_on_error:
                    raise error
                results.append(error)
            else:
                results.append(reply)
        return results


def _info_fields(reply: bytes) -> dict[str, str]:
    """``INFO``'s text as its fields (every value text: what is read of it is ``run_id``, when a
    connection opens)."""
    fields = {}
    for line in reply.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.partition(":")
            fields[name] = value
    return fields


class _Replies(asyncio.Protocol):
    """A connection's read side: replies parsed as bytes arrive and handed out in order,
    from the event loop's read callback (no reader task to wake per reply)."""

    def __init__(self, channel: ScriptChannel) -> None:
        self._channel = channel
        self._parser = hiredis.Reader()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._parser.feed(data)
        try:
            while (reply := self._parser.gets()) is not False:
                self._channel.replied(self, reply)
        except (hiredis.ProtocolError, IndexError) as exc:  # the replies it owed are gone too
            self._channel.lost(self, exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self._channel.lost(self, exc or ConnectionResetError("Redis closed the connection"))


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
        self._protocol: _Replies | None = None
        self._ready = False  # connected, and its hello (AUTH, SELECT, ROLE) answered
        #: Per command sent or in the outbox, in order: its future, when it was sent (the
        #: loop's clock) and what its reply becomes (None: the reply itself).
        self._pending: collections.deque[tuple[asyncio.Future[Any], float, _Call | None]] = collections.deque()
        self._outbox: list[bytes] = []
        self._watch: asyncio.TimerHandle | None = None
        self._connecting: asyncio.Lock | None = None
        #: The ``run_id`` of the server process the open connection talks to.
        self.server_id = ""

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
        if self._protocol is not None and self._address != master:
            log.warning("script connection: the master moved to %s:%s; leaving %s:%s", *master, *self._address)
            self._drop(RedisConnectionError(f"{self._address[0]}:{self._address[1]} is no longer the master"))

    def demoted(self) -> RedisConnectionError:
        """Close the connection to a server that answered READONLY; the error to raise."""
        error = RedisConnectionError(f"{self._address[0]}:{self._address[1]} is no longer the master")
        self._drop(error)
        return error

    def connected(self) -> bool:
        protocol = self._protocol
        return self._ready and protocol is not None and protocol.transport is not None \
            and not protocol.transport.is_closing()

    async def request(self, packed: bytes, call: _Call | None = None) -> Any:
        """Send one packed command; its reply (a ``hiredis.ReplyError`` for an error reply,
        unless ``call`` says what the reply becomes)."""
        await self.connect()
        return await self.submit(packed, call)

    async def connect(self) -> None:
        """Open the connection unless it is open."""
        if not self.connected():
            if self._protocol is not None and self._ready:  # closed under us: fail what it owed first
                self._drop(RedisConnectionError("connection to Redis lost"))
            await self._connect()

    def pipeline(self, transaction: bool = False) -> ChannelPipeline:
        """Commands sent together and answered in order, as redis-py's pipeline (not a
        transaction): on this connection, so in order with every call on it."""
        assert not transaction, "a channel's pipeline is no transaction"
        return ChannelPipeline(self)

    def error(self, reply: hiredis.ReplyError) -> RedisError:
        """The error an error reply is, as redis-py raises it. A ``READONLY`` reply (a
        failover demoted the server) closes the connection: nothing more on it can
        succeed, and the next call finds the master again."""
        text = str(reply)
        if text.startswith("NOSCRIPT"):
            return NoScriptError(text)
        if is_demotion(text):
            return self.demoted()
        return ResponseError(text)

    def submit(self, packed: bytes, call: _Call | None = None) -> asyncio.Future[Any]:
        """Queue one packed command on the open connection; its reply's future. A caller
        cancelled meanwhile cancels only its own future: its reply is skipped."""
        # Invariant: the bytes in the outbox and on the wire belong, in order, to the entries
        # in ``_pending``, all on the current connection (``_drop`` clears all three).
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._enqueue(loop, future, packed, call)
        return future

    def resubmit(self, future: asyncio.Future[Any], packed: bytes, call: _Call | None) -> None:
        """Send another command whose reply settles ``future`` (a script sent again)."""
        if self.connected():
            self._enqueue(asyncio.get_running_loop(), future, packed, call)
        else:
            future.set_exception(RedisConnectionError("connection to Redis lost"))

    def _enqueue(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], packed: bytes,
                 call: _Call | None) -> None:
        now = loop.time()
        self._pending.append((future, now, call))
        # Calls made in one turn of the event loop leave in one write (one system call).
        if not self._outbox:
            loop.call_soon(self._flush)
        self._outbox.append(packed)
        if self._watch is None:
            self._watch = loop.call_at(now + self._timeout_s, self._check)

    def _check(self) -> None:
        """The oldest reply owed is overdue: Redis did not answer in time, so this
        connection's replies can no longer be trusted to arrive; every call on it fails and
        the next one connects again. (Replies come in order: the oldest is due first.)"""
        self._watch = None
        if not self._pending:
            return
        due = self._pending[0][1] + self._timeout_s
        loop = asyncio.get_running_loop()
        if loop.time() < due:
            self._watch = loop.call_at(due, self._check)
            return
        self._drop(RedisTimeoutError(f"no reply from Redis within {self._timeout_s:g}s"))

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        protocol = self._protocol
        if outbox and protocol is not None and protocol.transport is not None:
            protocol.transport.write(b"".join(outbox))

    def replied(self, protocol: _Replies, reply: Any) -> None:
        if protocol is not self._protocol:
            return
        future, _, call = self._pending.popleft()
        if future.done():
            return  # its caller was cancelled
        if call is None:
            future.set_result(reply)
            return
        try:
            call.settle(self, future, reply)
        except Exception as exc:  # (a call that cannot be sent again): its caller learns it, not the loop
            if not future.done():
                future.set_exception(exc)

    def lost(self, protocol: _Replies, exc: BaseException) -> None:
        if protocol is self._protocol:
            log.warning("script connection to Redis lost: %s", exc)
            self._drop(RedisConnectionError(f"connection to Redis lost: {type(exc).__name__}"))

    async def _connect(self) -> None:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self.connected():
                return
            if self._locate is not None:
                now = asyncio.get_running_loop().time()
                if now < self._no_master_until:  # mid-failover: do not ask the sentinels per call
                    raise RedisConnectionError("no Redis master (a failover is under way)")
                try:
                    self._address = await self._locate()
                except RedisConnectionError:
                    self._no_master_until = now + NO_MASTER_BACKOFF_S
                    raise
            protocol: _Replies | None = None
            try:
                async with asyncio.timeout(SOCKET_CONNECT_TIMEOUT_S):
                    _, protocol = await asyncio.get_running_loop().create_connection(
                        lambda: _Replies(self), *self._address)
                    self._protocol, self._ready = protocol, False
                    for command in (*self._hello, _INFO_SERVER):  # AUTH, SELECT, ROLE; which server
                        reply = await self.submit(command)
                        if isinstance(reply, hiredis.ReplyError):
                            raise RedisConnectionError(f"Redis refused the connection: {reply}")
                        if isinstance(reply, list) and reply and reply[0] != b"master":
                            raise RedisConnectionError(f"{self._address[0]}:{self._address[1]} is a "
                                                       f"{reply[0].decode()}, not the master (mid-failover)")
                    self.server_id = _info_fields(reply).get("run_id", "")
            except BaseException as exc:
                if protocol is not None:
                    if protocol is self._protocol:
                        self._drop(RedisConnectionError("connection to Redis failed"))
                    elif protocol.transport is not None:
                        protocol.transport.close()
                if isinstance(exc, OSError | TimeoutError):
                    raise RedisConnectionError(f"cannot reach Redis at {self._address[0]}:{self._address[1]}: "
                                               f"{type(exc).__name__}") from None
                raise
            self._ready = True

    def _drop(self, error: Exception) -> None:
        self._outbox = []  # unsent: their calls fail below
        protocol, self._protocol = self._protocol, None
        self._ready = False
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        pending, self._pending = self._pending, collections.deque()
        for future, _, _ in pending:
            if not future.done():
                future.set_exception(error)

    async def aclose(self) -> None:
        self._drop(RedisConnectionError("closed"))
