"""The merge of several choices' lines (gateway/streams/migration.py ``_merge``), without HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.relay.upstream import Line
from gateway.streams.migration import _merge


class _Broke(Exception):
    pass


async def _failing() -> AsyncIterator[tuple[int, Line]]:
    await asyncio.sleep(0.05)  # the other choice fills the queue meanwhile
    raise _Broke("a choice failed")
    yield  # an async generator  # pragma: no cover


async def _busy_and_failing_to_close(index: int) -> AsyncIterator[tuple[int, Line]]:
    """Lines as fast as the queue takes them; closing it fails (an upstream whose close
    raised): the cancellation of its pump turns into that error."""
    try:
        while True:
            yield index, {"ids": [1], "text": "x"}
    finally:
        raise RuntimeError("closing the upstream failed")


async def test_a_choice_that_fails_while_another_fills_the_queue_ends_the_merge() -> None:
    """Regression (nemesis seed 7, a hang): one choice of a 16-choice take-over failed while
    the others had filled the merge's queue; their pumps, cancelled in ``put``, failed to
    close their upstreams and then waited for ever to queue that error. The merge's
    clean-up waited on them: the stream never ended and its ``:live`` was refreshed for
    good, so no reader ever took it over again."""
    sources = [_busy_and_failing_to_close(i) for i in range(3)] + [_failing()]

    async def consume() -> None:
        async for _ in _merge(sources):
            await asyncio.sleep(0.01)  # slower than the choices: the queue is full

    with pytest.raises(_Broke):
        await asyncio.wait_for(consume(), 5)


async def _endless(index: int, closed: list[int]) -> AsyncIterator[tuple[int, Line]]:
    try:
        while True:
            yield index, {"ids": [1], "text": "x"}
            await asyncio.sleep(0)
    finally:
        closed.append(index)


def _pumps() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if "_merge.<locals>.pump" in repr(t.get_coro())]


async def test_a_rendered_stream_closed_at_an_event_stops_every_choice_before_its_end_runs() -> None:
    """Regression (nemesis, Cluster: "Task was destroyed but it is pending" for pumps of
    n > 1 streams, mid-run): a producer that stops reading its events (its journal's bound,
    a stream it lost) closes them at a ``yield``. Closing the rendering did not close the
    merged lines under it, so each choice's pump went on reading its worker, and the
    stream's end closed the upstreams under the pumps ("already running") while the
    engines went on generating for nobody, until a garbage collection destroyed the pumps."""
    from types import SimpleNamespace

    from gateway.relay.rendering import sse_events
    from gateway.streams.takeover import LineTap

    closed: list[int] = []
    ended: list[list[int]] = []

    async def end(outcome: object, completed: bool) -> None:
        ended.append(sorted(closed))

    req = SimpleNamespace(model="m", include_usage=lambda: False)
    record = SimpleNamespace(add=lambda index, line: None, request_id="r")
    tap = LineTap(_merge([_endless(i, closed) for i in range(3)]), digest=3)
    events = sse_events("text", req, tap.lines(), record, end)  # type: ignore[arg-type]
    for _ in range(6):
        await anext(events)
    await events.aclose()
    assert ended == [[0, 1, 2]]  # every choice closed, then the end (which closes upstreams)
    assert _pumps() == []
