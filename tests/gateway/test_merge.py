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
