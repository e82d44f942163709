"""Clean-up that must run to its end, without holding up the answer it follows.

A request that failed or ran out of time still owes Redis some writes: a grant given back,
a queue entry removed, a rate-limit charge refunded, an Idempotency-Key let go. They used to
run inline and shielded from cancellation, before the error went out; with a stalled Redis
each waited out its command's deadline (5 s on one server, 12 s on a Cluster), so a request
with 1 s left answered 5-18 s later (the nemesis, Cluster). Handed to :func:`detach`, they
run to their end in a task of their own, and the error goes out at once.

>>> detach(admission.release(lease), "releasing a grant nobody waits for")
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger("sluice.gateway")

T = TypeVar("T")

#: The clean-ups running now: a task the loop holds only weakly could be collected mid-way.
_running: set[asyncio.Task[Any]] = set()


def detach(work: Coroutine[Any, Any, Any], what: str) -> asyncio.Task[Any]:
    """Run ``work`` in a task of its own; its failure is logged (``what`` says what it was),
    never raised. The task is not cancelled with its caller."""
    task = asyncio.get_running_loop().create_task(work)
    _running.add(task)

    def landed(done: asyncio.Task[Any]) -> None:
        _running.discard(done)
        if not done.cancelled() and done.exception() is not None:
            log.warning("%s failed: %s", what, done.exception())

    task.add_done_callback(landed)
    return task


def pending() -> int:
    """How many clean-ups are still running (tests, shutdown)."""
    return len(_running)


async def to_the_end(work: Coroutine[Any, Any, T]) -> T:
    """Await ``work``, a clean-up, so that this task's cancellation does not cut it short;
    a cancellation that came meanwhile goes on up once it has ended.

    Why not ``anyio.CancelScope(shield=True)``, which the gateway used: it shields only from
    anyio's own cancel scopes, and nothing in the gateway cancels through one. Every
    cancellation here is asyncio's ``Task.cancel`` (the SSE response's watch for a client
    that left, ``asyncio.timeout``, uvicorn at shutdown), and that went through the scope into
    the clean-up (tests/test_aftercare.py). It also cost about 7 µs a scope, two per
    streamed request (py-spy, loadtest/peers/README.md).

    A task being cancelled (the clean-up runs because of that) runs ``work`` in a task of
    its own and waits for it through any further cancellation: there a second one, such as
    uvicorn's at shutdown, is what could come. A task that is not runs ``work`` inline, for
    nothing: the common end of a request. A first cancellation arriving in that short
    window still cuts the clean-up, as it did through anyio's scope."""
    current = asyncio.current_task()
    if current is None or not current.cancelling():
        return await work
    inner = asyncio.get_running_loop().create_task(work)
    cancelled_again = False
    while not inner.done():
        try:
            await asyncio.wait([inner])  # a cancellation of this wait leaves ``inner`` running
        except asyncio.CancelledError:
            cancelled_again = True
    if cancelled_again:  # the cancellation goes on up, even past a clean-up that failed
        failure = None if inner.cancelled() else inner.exception()
        raise asyncio.CancelledError from failure
    return inner.result()
