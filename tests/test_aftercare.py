"""sluice/aftercare.py's ``to_the_end``: a clean-up that a second cancellation cannot cut,
and why anyio's shielded scope, which the gateway used, was not that."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import pytest

from sluice.aftercare import to_the_end


async def _cancelled_twice(clean_up: Callable[[Callable[[], Any]], Any]) -> list[str]:
    """A request task cancelled while it works, and again while its clean-up runs (as uvicorn
    cancels at shutdown); the steps its clean-up got through."""
    steps: list[str] = []

    async def work() -> None:
        steps.append("clean-up began")
        await asyncio.sleep(0.2)  # a Redis round trip, say
        steps.append("clean-up ended")

    async def request() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await clean_up(work)
            raise

    task = await _cancel_twice(request())
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert task.cancelled()
    return steps


async def _cancel_twice(request: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """``request`` as a task, cancelled once as it works, and again during its clean-up."""
    task = asyncio.get_running_loop().create_task(request)
    await asyncio.sleep(0.02)
    task.cancel()
    await asyncio.sleep(0.02)
    task.cancel()
    return task


async def test_a_clean_up_runs_to_its_end_through_a_second_cancellation() -> None:
    assert await _cancelled_twice(lambda work: to_the_end(work())) == ["clean-up began", "clean-up ended"]


async def test_anyio_s_shielded_scope_lets_asyncio_s_cancellation_through() -> None:
    """What the gateway relied on before: every cancellation in the gateway is asyncio's, and
    this scope shields only from anyio's own."""

    async def shielded(work: Callable[[], Any]) -> None:
        with anyio.CancelScope(shield=True):
            await work()

    assert await _cancelled_twice(shielded) == ["clean-up began"]


async def test_a_clean_up_nobody_cancels_runs_inline_and_returns_its_result() -> None:
    outer = asyncio.current_task()

    async def work() -> object:
        return asyncio.current_task()

    assert await to_the_end(work()) is outer  # no task of its own: the common end of a request


async def test_a_clean_up_that_fails_during_a_second_cancellation_still_ends_cancelled() -> None:
    """The cancellation is not lost to the clean-up's error (a caller could answer that error
    and go on, and uvicorn's cancellation at shutdown would be ignored); the error is its cause."""
    async def work() -> None:
        await asyncio.sleep(0.1)
        raise ValueError("Redis said no")

    async def request() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await to_the_end(work())
            raise

    task = await _cancel_twice(request())
    with pytest.raises(asyncio.CancelledError) as cancelled:
        await task
    assert isinstance(cancelled.value.__cause__, ValueError)
