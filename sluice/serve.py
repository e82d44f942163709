"""Running an ASGI app under uvicorn with Sluice's shutdown rules."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, Generator
from types import FrameType

import uvicorn
from starlette.types import ASGIApp

from sluice.connection_bounds import ConnectionBounds
from sluice.connection_bounds import protocol as bounded_protocol

log = logging.getLogger("sluice.serve")


class Server(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT runs ``on_signal`` (drain) first.

    ``on_signal`` decides when to set ``should_exit``; a second signal forces exit.
    Unlike uvicorn, the signal is not re-raised after serving, so the caller's
    clean-up runs and the process exits 0.
    """

    def __init__(
        self, config: uvicorn.Config, on_signal: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        super().__init__(config)
        self._on_signal = on_signal
        self._signalled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)  # type: ignore[arg-type]

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._on_signal is None or self._signalled or self._loop is None:
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True
            return
        self._signalled = True
        log.info("got %s: draining", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        assert self._on_signal is not None

        async def drain() -> None:
            try:
                await self._on_signal()  # type: ignore[misc]
            finally:
                self.should_exit = True

        self._drain_task = asyncio.create_task(drain(), name="drain")


def uvicorn_config(
    app: ASGIApp, host: str, port: int, *, graceful_s: float, lifespan: bool = False, proxy_headers: bool = True,
    bounds: ConnectionBounds = ConnectionBounds(),
) -> uvicorn.Config:
    """``proxy_headers=False``: the app applies X-Forwarded-* itself where it reads them
    (the gateway's :class:`sluice.lean_routes.Front`). ``bounds``: what a client's connections
    hold (uvicorn's httptools protocol, sluice/connection_bounds.py): a request's head in size
    and time, its body in time, the connections kept open, the answers clients do not take."""
    return uvicorn.Config(
        app,
        proxy_headers=proxy_headers,
        host=host,
        port=port,
        loop="none",
        http=bounded_protocol(bounds),
        lifespan="on" if lifespan else "off",
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=graceful_s,
        timeout_keep_alive=30,
        backlog=4096,
    )


def settle_gc() -> None:
    """Call once the app is built, before serving (the gateway, and the worker once its
    engine has started). Python's cyclic collector otherwise walks every object the imports
    and the start made, none of them ever garbage, in each full collection: in a gateway
    about 100k (modules, pydantic schemas, routes), 50-70 ms of CPU in one stall every few
    seconds under load, and with the young collections about a tenth of a short request's
    CPU in all (loadtest/peers/README.md); in a vLLM worker, whose process holds vLLM's
    frontend, 630k after the imports alone, 255 ms a full collection on the CPU machine, a
    stall of every stream of the worker each time (vLLM's own server freezes its heap the
    same way). What is garbage now is collected first, so that none is frozen;
    ``gc.freeze()`` leaves the rest out of every collection; a larger first threshold runs
    the young collection a tenth as often (the objects of requests in flight are what it
    walks, each time). Cyclic garbage is still collected, later."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(7000, 10, 10)
    log.info("%d objects of the start left out of the garbage collector's walks", gc.get_freeze_count())


def unsettle_gc() -> None:
    """Undo :func:`settle_gc` as the process stops, once its engine is shut down: frozen
    objects are never freed, so extension modules' objects among them (Triton's, in a vLLM
    worker) were reported as leaked at every exit ("nanobind: leaked ... instances")."""
    gc.unfreeze()


def run_async(main: Awaitable[None]) -> None:
    """Run a coroutine on uvloop when available."""
    try:
        import uvloop

        uvloop.run(main)  # type: ignore[arg-type]
    except ImportError:
        asyncio.run(main)  # type: ignore[arg-type]
