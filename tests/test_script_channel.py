"""sluice/script_channel.py against a real redis-server: order under concurrency, a script
Redis no longer has, a password and a database, a Redis that restarts or stops answering."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
from collections.abc import AsyncIterator

import pytest
import redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.embedded_redis import EmbeddedRedis, free_port
from sluice.redis_pool import create_pool
from sluice.script_channel import Packed, ScriptChannel, script_runner

ECHO = "redis.call('INCR', KEYS[1]) return {ARGV[1], ARGV[2], redis.call('GET', KEYS[1])}"


@pytest.fixture
async def channel(redis_url: str) -> AsyncIterator[ScriptChannel]:
    """The channel a process opens on one Redis server (``script_runner`` of its pool)."""
    client = await create_pool(redis_url)
    runner = script_runner(client)
    assert isinstance(runner, ScriptChannel)
    yield runner
    await runner.aclose()
    await client.aclose()


async def test_concurrent_calls_get_their_own_replies(channel: ScriptChannel) -> None:
    echo = channel.register_script(ECHO)
    replies = await asyncio.gather(*(echo(keys=["chan:count"], args=[f"call-{i}", i * 0.5]) for i in range(500)))
    assert [r[:2] for r in replies] == [[f"call-{i}".encode(), repr(i * 0.5).encode()] for i in range(500)]
    # Each ran once: the counter saw every call.
    assert sorted(int(r[2]) for r in replies) == list(range(1, 501))


async def test_a_flushed_script_is_sent_again_and_errors_are_redis_errors(channel: ScriptChannel) -> None:
    echo = channel.register_script(ECHO)
    broken = channel.register_script("return redis.call('NOSUCHCOMMAND')")
    await echo(keys=["chan:flush"], args=["a", "b"])
    await channel.request(b"*2\r\n$6\r\nSCRIPT\r\n$5\r\nFLUSH\r\n")
    assert (await echo(keys=["chan:flush"], args=["a", "b"]))[2] == b"2"
    with pytest.raises(ResponseError):
        await broken()
    assert (await echo(keys=["chan:flush"], args=["c", "d"]))[:2] == [b"c", b"d"]  # still in step


async def test_a_reply_whose_handling_fails_fails_its_own_call_and_no_other(channel: ScriptChannel) -> None:
    """A reply is handled in the connection's read callback; an exception there (here: the
    resend of a script Redis lost cannot be made) fails the call whose reply it was, and the
    calls around it, queued in the same write, get their own replies on the same connection.
    (Raised out of the callback, it hung its caller for the test's whole timeout: 120 s.)"""
    echo = channel.register_script(ECHO)
    other = channel.register_script("return ARGV[1]")
    await echo(keys=["chan:guard"], args=["a", "b"])
    await other(args=["x"])
    await channel.request(b"*2\r\n$6\r\nSCRIPT\r\n$5\r\nFLUSH\r\n")
    source = other.script.encode()  # loaded again: only echo is missing now
    await channel.request(b"*3\r\n$6\r\nSCRIPT\r\n$4\r\nLOAD\r\n$%d\r\n%b\r\n" % (len(source), source))

    def cannot(keys: object, args: object) -> bytes:
        raise RuntimeError("the resend cannot be packed")

    echo.evaluate = cannot  # type: ignore[method-assign]
    before, failing, after = other(args=["before"]), echo(keys=["chan:guard"], args=["c", "d"]), other(args=["after"])
    results = await asyncio.wait_for(asyncio.gather(before, failing, after, return_exceptions=True), 5)
    assert results[0] == b"before" and results[2] == b"after", results
    assert isinstance(results[1], RuntimeError), results
    assert channel.connected()
    assert await other(args=["later"]) == b"later"  # still in step


async def test_packed_arguments_reach_the_script_as_the_values_would(channel: ScriptChannel) -> None:
    """Admission's constants lead its scripts' arguments packed once (:class:`Packed`): the
    script sees them, and what follows, as if each had been passed, also when the script is
    sent again whole (EVAL, after Redis lost it)."""
    argv = channel.register_script("return ARGV")
    common = Packed(["gw-1", 30000, 0.5, "least"])
    want = [b"gw-1", b"30000", b"0.5", b"least", b"req-7", b"3", b"[]"]
    assert await argv(keys=["chan:packed"], args=[common, "req-7", 3, b"[]"]) == want
    assert await argv(keys=["chan:packed"], args=[common]) == want[:4]
    await channel.request(b"*2\r\n$6\r\nSCRIPT\r\n$5\r\nFLUSH\r\n")
    assert await argv(keys=["chan:packed"], args=[common, "req-7", 3, b"[]"]) == want


async def test_a_pipeline_answers_as_redis_pys_in_order_with_the_channels_calls(redis_url: str) -> None:
    """The resumable streams' pipelines (an Idempotency-Key's claim and the loss watch's look
    after it, a journal round's scripts) on the channel: one reply per command, in order,
    as redis-py's pipeline gives them; a script Redis lost comes back as ``NoScriptError``
    (not sent again: the caller knows what it queued after it), another error reply as
    ``ResponseError``, raised unless asked for in its place."""
    client = await create_pool(redis_url)
    channel = script_runner(client)
    assert isinstance(channel, ScriptChannel)
    echo = channel.register_script(ECHO)
    try:
        await client.hset("chan:pipe:h", "id", "e-1")
        await echo(keys=["chan:pipe"], args=["a", "b"])  # Redis knows the script now
        pipe = channel.pipeline(transaction=False)
        pipe.evalsha(echo.sha, 1, "chan:pipe", "c", "d")
        pipe.hget("chan:pipe:h", "id")
        pipe.hget("chan:pipe:h", "missing")
        pipe.info("server")
        counted, found, missing, info = await pipe.execute()
        assert counted == [b"c", b"d", b"2"] and found == b"e-1" and missing is None
        assert info["run_id"] == (await client.info("server"))["run_id"]

        await client.script_flush()
        pipe = channel.pipeline()
        pipe.evalsha(echo.sha, 1, "chan:pipe", "e", "f")
        pipe.evalsha(hashlib.sha1(b"return 1").hexdigest(), 0)
        pipe.hget("chan:pipe:h", "id")
        lost, unknown, after = await pipe.execute(raise_on_error=False)
        assert isinstance(lost, NoScriptError) and isinstance(unknown, NoScriptError) and after == b"e-1"
        assert await client.get("chan:pipe") == b"2"  # nothing ran twice
        pipe = channel.pipeline()
        pipe.evalsha(echo.sha, 1, "chan:pipe", "e", "f")
        with pytest.raises(NoScriptError):
            await pipe.execute()
        pipe = channel.pipeline()
        pipe.hget("chan:pipe:h", "id")
        pipe.evalsha("not-a-sha", 0)
        found, wrong = await pipe.execute(raise_on_error=False)
        assert found == b"e-1" and isinstance(wrong, ResponseError)
        assert (await echo(keys=["chan:pipe"], args=["g", "h"]))[:2] == [b"g", b"h"]  # the channel in step
    finally:
        await channel.aclose()
        await client.aclose()


async def test_password_and_database_come_from_the_clients_url() -> None:
    with EmbeddedRedis() as server:
        redis.Redis(port=server.port).config_set("requirepass", "s3cret")
        url = f"redis://:s3cret@127.0.0.1:{server.port}/3"
        client = await create_pool(url)
        channel = script_runner(client)
        assert isinstance(channel, ScriptChannel)
        try:
            await channel.register_script("return redis.call('SET', KEYS[1], 'x')")(keys=["chan:db"])
            assert await client.get("chan:db") == b"x"  # in database 3, where the client looks
            wrong = ScriptChannel("127.0.0.1", server.port, password="nope")
            with pytest.raises(RedisConnectionError):
                await wrong.register_script("return 1")()
            await wrong.aclose()
        finally:
            await channel.aclose()
            await client.aclose()


async def test_a_restarted_redis_is_reached_again_and_a_silent_one_times_out() -> None:
    port = free_port()
    channel = ScriptChannel("127.0.0.1", port, timeout_s=0.5)
    one = channel.register_script("return 1")
    try:
        with EmbeddedRedis(port) as server:
            assert await one() == 1
            first = await _server_seen(channel)
            assert first == redis.Redis(port=port).info("server")["run_id"]
        with pytest.raises(RedisConnectionError):
            await one()  # gone: a Redis error, not a hang
        with pytest.raises(RedisConnectionError):
            await _server_seen(channel)  # a pipeline too
        with EmbeddedRedis(port) as server:
            assert await one() == 1
            # The loss watch's look at a claim reads which server answers from the connection:
            # the new one's, never the one the last connection talked to.
            assert await _server_seen(channel) == redis.Redis(port=port).info("server")["run_id"] != first
            os.kill(server.process.pid, signal.SIGSTOP)  # connected, silent
            try:
                with pytest.raises(RedisTimeoutError):
                    await one()
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
            assert await one() == 1  # a new connection
    finally:
        await channel.aclose()


async def _server_seen(channel: ScriptChannel) -> str:
    pipe = channel.pipeline()
    pipe.info("server")
    (info,) = await pipe.execute()
    return info["run_id"]


async def test_a_cluster_keeps_redis_pys_scripts(redis_cluster_url: str) -> None:
    client = await create_pool(redis_cluster_url)
    try:
        assert isinstance(script_runner(client), RedisCluster)
    finally:
        await client.aclose()
