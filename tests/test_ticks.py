"""sluice/ticks.py: ``asyncio.timeout``'s behaviour to a tick's precision, for many requests
on one loop timer, and what its wheel holds once the scopes have ended."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import uvloop

from sluice import ticks


async def test_a_block_past_its_deadline_ends_with_timeout_error_a_tick_late_at_most() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        async with ticks.timeout(0.1) as scope:
            await asyncio.sleep(5)
    took = time.monotonic() - started
    assert scope.expired()
    assert 0.1 <= took < 1.0, took  # never early; a tick late (and a loaded loop's lateness)
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]  # its own cancellation undone


async def test_a_block_that_ends_in_time_leaves_nothing_behind() -> None:
    async with ticks.timeout(5) as scope:
        await asyncio.sleep(0)
    assert not scope.expired()
    assert ticks.wheel().pending() == 0


async def test_a_deadline_already_past_cancels_at_the_next_tick() -> None:
    with pytest.raises(TimeoutError):
        async with ticks.timeout(-1):
            await asyncio.sleep(1)


async def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    entered = asyncio.Event()

    async def waits() -> None:
        async with ticks.timeout(5):
            entered.set()
            await asyncio.sleep(5)

    task = asyncio.create_task(waits())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_cancellation_that_comes_after_the_deadline_is_not_swallowed() -> None:
    """The deadline's cancellation is taken inside the block, then the task is cancelled
    again: the block ends in CancelledError (as asyncio.timeout), not TimeoutError."""
    async def waits() -> None:
        async with ticks.timeout(0.05):
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(5)  # the deadline's cancellation, taken here
            asyncio.current_task().cancel()  # type: ignore[union-attr]  # and another
            await asyncio.sleep(5)

    task = asyncio.create_task(waits())
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_nested_scopes_each_answer_for_their_own_deadline() -> None:
    with pytest.raises(TimeoutError):
        async with ticks.timeout(5) as outer:
            async with ticks.timeout(0.05) as inner:
                await asyncio.sleep(5)
    assert inner.expired() and not outer.expired()


async def test_many_scopes_end_and_the_wheel_holds_nothing_nor_more_ticks_than_it_needs() -> None:
    """10,000 scopes with deadlines a minute ahead, all ended: no entry and no set stays, and
    the heap keeps one tick per tick in which scopes were made, not one per scope."""
    for i in range(10_000):
        async with ticks.timeout(60 + (i % 3) * ticks.TICK_S):
            pass
    wheel = ticks.wheel()
    assert wheel.pending() == 0
    assert not wheel._buckets
    assert len(wheel._ticks) < 200, len(wheel._ticks)


async def test_scopes_of_many_tasks_fire_together_on_one_timer() -> None:
    async def one(delay: float) -> float:
        started = time.monotonic()
        with contextlib.suppress(TimeoutError):
            async with ticks.timeout(delay):
                await asyncio.sleep(5)
        return time.monotonic() - started

    took = await asyncio.gather(*(one(0.05 + (i % 4) * 0.05) for i in range(400)))
    for i, t in enumerate(took):
        assert 0.05 + (i % 4) * 0.05 <= t < 2.0, (i, t)  # never early; a loaded loop may be late
    assert ticks.wheel().pending() == 0


def test_a_closed_loop_and_its_wheel_are_let_go() -> None:
    """A loop that closes with scopes' ticks still ahead (any loop that served requests) is
    not kept alive by its wheel's timer once another loop's wheel is made."""
    import gc
    import weakref

    async def leave_a_tick_ahead() -> weakref.ref[asyncio.AbstractEventLoop]:
        async with ticks.timeout(60):
            pass
        return weakref.ref(asyncio.get_running_loop())

    loops = [asyncio.run(leave_a_tick_ahead()) for _ in range(3)]
    asyncio.run(asyncio.sleep(0))  # one more loop: its wheel is made, the closed ones' let go
    gc.collect()
    assert [ref() for ref in loops[:2]] == [None, None]


def test_each_event_loop_has_its_own_wheel_under_uvloop_too() -> None:
    async def expire() -> bool:
        with contextlib.suppress(TimeoutError):
            async with ticks.timeout(0.03) as scope:
                await asyncio.sleep(5)
        return scope.expired()

    assert asyncio.run(expire())
    assert uvloop.run(expire())
    assert asyncio.run(expire())


def test_under_uvloop_a_tick_fires_once_not_until_its_millisecond_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvloop's clock is in whole milliseconds: a timer on time read a hair before its tick,
    and the wheel, re-armed for the same tick, ran again at once, hundreds of times a tick."""
    calls = 0
    fire = ticks._Wheel._fire

    def counted(self: ticks._Wheel) -> None:
        nonlocal calls
        calls += 1
        fire(self)

    monkeypatch.setattr(ticks._Wheel, "_fire", counted)

    async def scopes() -> None:
        for i in range(40):
            with contextlib.suppress(TimeoutError):
                async with ticks.timeout(0.01 + (i % 8) * ticks.TICK_S):
                    await asyncio.sleep(5)

    uvloop.run(scopes())
    assert 40 <= calls < 100, calls
