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
from typing import Any

log = logging.getLogger("sluice.gateway")

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
