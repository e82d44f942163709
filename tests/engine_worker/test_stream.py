"""The worker's NDJSON response (engine_worker/stream.py) on its own: a gateway that hangs up
closes the engine's stream at once, before its first token or between two, and a
cancellation from elsewhere (the server stopping) is not swallowed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from engine_worker.protocol import Delta
from engine_worker.stream import NDJSONStream


class Engine:
    """One request's deltas: ``first`` tokens at once, then none until released; records
    whether the stream was closed (what aborts the request in a real engine)."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.closed = False
        self.release = asyncio.Event()

    async def deltas(self) -> AsyncIterator[Delta]:
        try:
            for i in range(self.first):
                yield Delta(token_ids=[i], text=f"t{i}")
            await self.release.wait()
            yield Delta(token_ids=[99], text="end", finish_reason="stop")
        finally:
            self.closed = True


class Gateway:
    """The ASGI side: what was sent, and a hang-up on demand."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)


def _stream(engine: Engine, ends: list[str]) -> NDJSONStream:
    return NDJSONStream(engine.deltas(), lambda: ends.append("start"), lambda: ends.append("done"))


@pytest.mark.parametrize("first", [0, 2], ids=["before-the-first-token", "between-two-tokens"])
async def test_a_hang_up_closes_the_engine_stream_at_once(first: int) -> None:
    engine, gateway, ends = Engine(first), Gateway(), []
    task = asyncio.create_task(_stream(engine, ends)({"type": "http"}, gateway.receive, gateway.send))
    await asyncio.sleep(0.05)
    assert not task.done() and not engine.closed
    gateway.gone.set()
    await asyncio.wait({task}, timeout=1)  # (wait_for would cancel it: a stream that ignores the hang-up)
    assert task.done(), "the hang-up did not end the stream"
    task.cancel()
    assert task.result() is None  # ended quietly: a hang-up is no error
    assert engine.closed and ends == ["start", "done"]
    bodies = [m for m in gateway.sent if m["type"] == "http.response.body"]
    assert len(bodies) == first  # what was sent before the hang-up, and nothing after
    assert task.cancelling() == 0  # the cancellation it used is not left on the task


async def test_a_whole_stream_ends_its_body_and_closes_the_engine_stream() -> None:
    engine, gateway, ends = Engine(1), Gateway(), []
    engine.release.set()
    await asyncio.wait_for(_stream(engine, ends)({"type": "http"}, gateway.receive, gateway.send), 1)
    assert [m.get("status") for m in gateway.sent if m["type"] == "http.response.start"] == [200]
    assert gateway.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert engine.closed and ends == ["start", "done"]


async def test_a_cancellation_from_elsewhere_is_not_swallowed() -> None:
    engine, gateway, ends = Engine(1), Gateway(), []
    task = asyncio.create_task(_stream(engine, ends)({"type": "http"}, gateway.receive, gateway.send))
    await asyncio.sleep(0.05)
    task.cancel()  # the server stopping, not the gateway hanging up
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.closed and ends == ["start", "done"]


async def test_a_cancellation_from_elsewhere_during_a_hang_up_is_not_swallowed() -> None:
    """The hang-up's own cancellation is taken back; one from elsewhere at the same moment stays."""
    engine, gateway, ends = Engine(1), Gateway(), []
    task = asyncio.create_task(_stream(engine, ends)({"type": "http"}, gateway.receive, gateway.send))
    await asyncio.sleep(0.05)
    gateway.gone.set()
    await asyncio.sleep(0)  # the watcher runs: its cancellation is on the task
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.closed and ends == ["start", "done"]


async def test_a_hang_up_ends_the_stream_even_when_the_engine_swallows_the_cancellation() -> None:
    """An engine generator that catches the cancellation and goes on yielding is closed at its
    next token instead of streaming to a gateway that left."""
    closed: list[bool] = []

    async def deaf() -> AsyncIterator[Delta]:
        try:
            yield Delta(token_ids=[0], text="t0")
            for i in range(1, 1000):
                try:
                    await asyncio.sleep(0.01)
                except asyncio.CancelledError:
                    pass  # swallowed: the engine goes on
                yield Delta(token_ids=[i], text=f"t{i}")
        finally:
            closed.append(True)

    gateway, ends = Gateway(), []
    stream = NDJSONStream(deaf(), lambda: ends.append("start"), lambda: ends.append("done"))
    task = asyncio.create_task(stream({"type": "http"}, gateway.receive, gateway.send))
    await asyncio.sleep(0.05)
    sent = len(gateway.sent)
    gateway.gone.set()
    await asyncio.wait({task}, timeout=1)
    assert task.done(), "the stream went on after the hang-up"
    assert task.result() is None and task.cancelling() == 0
    assert closed == [True] and ends == ["start", "done"]
    assert len(gateway.sent) <= sent + 1  # (a token of the same loop turn as the hang-up), not the rest
