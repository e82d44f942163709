"""The worker's NDJSON response: engine deltas out, client disconnect aborts the engine."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from engine_worker.protocol import Delta
from sluice.errors import SluiceError, error_response

log = logging.getLogger("sluice.worker")


class NDJSONStream(Response):
    """Send one line per delta; a disconnect cancels the send loop and closes the engine stream.

    Closing the engine's iterator is what aborts the request inside the engine,
    so a gateway that hangs up frees the sequence at once, not at the next token.
    The disconnect is watched by one asyncio task that cancels the sending one (an anyio
    task group did it before: its cancel scopes, task spawn and ``current_task`` lookups
    were a sixth of a simulator worker's samples under 64 one-token streams, py-spy;
    loadtest/peers/README.md).
    """

    media_type = "application/x-ndjson"

    def __init__(
        self,
        deltas: AsyncIterator[Delta],
        on_start: Callable[[], None],
        on_done: Callable[[], None],
    ) -> None:
        super().__init__(status_code=200)
        self._deltas = deltas
        self._on_start = on_start
        self._on_done = on_done
        self._gone = False  # the gateway hung up

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._on_start()
        sending = asyncio.current_task()
        assert sending is not None

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self._gone = True
            sending.cancel()

        # The body was read by the route: what ``receive`` gives now is the disconnect (or
        # the response's end, after which the watcher is cancelled before it runs again).
        watcher = asyncio.get_running_loop().create_task(watch_disconnect())
        try:
            await self._respond(scope, receive, send)
            if self._gone:  # an engine swallowed the hang-up's cancellation; the loop saw it
                sending.uncancel()
        except asyncio.CancelledError:
            if not self._gone or sending.uncancel() > 0:
                raise  # cancelled from outside (the server stopping), too: not ours to swallow
        except OSError:
            pass  # the gateway went away between two sends
        finally:
            watcher.cancel()
            try:
                # Not cancelled again by the watcher (cancelled above); a server stopping may.
                await self._deltas.aclose()  # type: ignore[attr-defined]
            finally:
                self._on_done()

    async def _respond(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The status waits for the first delta, so a request the engine refuses
        # (prompt too long, bad sampling parameters) is a plain HTTP error.
        try:
            first = await anext(self._deltas, None)
        except SluiceError as exc:
            await error_response(exc)(scope, receive, send)
            return
        except Exception as exc:  # the engine failed before any token: a 500 the gateway retries
            log.exception("engine failed before the first token")
            await error_response(SluiceError(f"engine error: {type(exc).__name__}"))(scope, receive, send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/x-ndjson")],
            }
        )
        try:
            if first is not None:
                await send({"type": "http.response.body", "body": first.encode(), "more_body": True})
                async for delta in self._deltas:
                    if self._gone:  # (an engine generator that swallowed the cancellation goes on)
                        return
                    await send({"type": "http.response.body", "body": delta.encode(), "more_body": True})
        except SluiceError as exc:
            await send({"type": "http.response.body", "body": _line(exc.body()), "more_body": True})
        except Exception as exc:  # an engine failure mid-stream must reach the gateway as a line
            log.exception("engine failed mid-stream")
            err = SluiceError(f"engine error: {type(exc).__name__}")
            await send({"type": "http.response.body", "body": _line(err.body()), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _line(obj: dict[str, object]) -> bytes:
    return orjson.dumps(obj) + b"\n"
