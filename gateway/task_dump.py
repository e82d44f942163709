"""``kill -USR1 <gateway pid>``: log every asyncio task of the process with where it waits.

A stream that hangs (no event, no error) leaves nothing in the logs by definition; its
producer, reader and clean-up are tasks parked on some await. This shows which, without
stopping the process (the nemesis sends it to every gateway when a request hung)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import io
import logging
import signal

log = logging.getLogger("sluice.gateway")

#: Frames shown per task, innermost last.
STACK_LIMIT = 12


def install() -> None:
    """Dump the tasks on SIGUSR1 (where the platform has it and a loop runs)."""
    with contextlib.suppress(AttributeError, NotImplementedError, RuntimeError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump)


def awaiting(coro: object) -> list[str]:
    """Where a suspended coroutine waits: its chain of awaits (``cr_await``, an async
    generator's ``ag_await``), outermost first, as ``file:line in function``."""
    where: list[str] = []
    while coro is not None and len(where) < STACK_LIMIT:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            where.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or getattr(coro, "gi_yieldfrom", None)
        if type(coro).__name__ in ("async_generator_asend", "async_generator_athrow"):
            # ``async for``/``aclose`` await one of these, which hides its generator.
            coro = next((g for g in gc.get_referents(coro) if inspect.isasyncgen(g)), None)
    return where


def dump() -> None:
    tasks = asyncio.all_tasks()
    out = io.StringIO()
    for task in sorted(tasks, key=lambda t: t.get_name()):
        out.write(f"--- {task.get_name()}\n")
        for line in awaiting(task.get_coro()):
            out.write(f"    {line}\n")
    log.warning("SIGUSR1: %d asyncio tasks\n%s", len(tasks), out.getvalue())
