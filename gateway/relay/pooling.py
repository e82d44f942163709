"""Serving one embeddings, score, rerank or tokenize request: admit it on a worker that
serves its task, send it, render the one answer.

The worker's answer is one line ending as a generation's last line ends
(engine_worker/pooling.py), so the request rides the completion path's machinery: the
dispatcher's admission (the task's workers only, the model's priority queue, the
tenant's fair share), its retries on another worker until that line arrives (a worker
that is unreachable, answers 5xx, or is too slow before the answer), its deadline; the
lease's release corrects the fair-share charge with the real usage, and the key's TPM
charge is settled with the prompt tokens the engine counted.

Its answer counts in the process's bound on answers being built (gateway/relay/whole_answers.py)
from the moment its worker's response announces its length, before a byte of it is held, until
its body leaves: an embeddings answer is inputs x width floats (2,048 x 4,096 are a 170 MB
line as JSON text, 46 MB as base64, passed on as the worker made them: gateway/surfaces/pooling.py),
and a few at once took a gateway by GBs. Such a body leaves a MiB at a time (:class:`PiecesResponse`),
counted from then on as what its client has not taken (sluice/connection_bounds.py).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.admission.tenancy import Tenancy
from gateway.config import GatewaySettings
from gateway.context import RequestContext
from gateway.relay.upstream import Dispatcher, Line
from gateway.relay.whole_answers import WholeAnswers
from gateway.surfaces.pooling import Pieces, PoolingRequest, render
from sluice.aftercare import to_the_end
from sluice.connection_bounds import CONNECTION, BoundedProtocol
from sluice.errors import UpstreamFailed

log = logging.getLogger("sluice.gateway")

#: Bytes of a pieced body sent before the event loop's other work is let in.
SEND_BYTES = 2**20


class PoolingServing:
    def __init__(self, settings: GatewaySettings, dispatcher: Dispatcher, tenancy: Tenancy,
                 answers: WholeAnswers) -> None:
        self._settings = settings
        self._dispatcher = dispatcher
        self._tenancy = tenancy
        self._answers = answers

    async def serve(self, req: PoolingRequest, ctx: RequestContext) -> Response:
        names = req.unknown_fields()
        if names:
            log.info("ignoring %d unknown request field(s): %s", len(names), ", ".join(names[:8])[:200])
        record = ctx.record
        payload = {"request_id": ctx.internal_id, "model": req.model, **req.payload()}
        answer: Line | None = None
        held = self._answers.open(streamable=False)  # its bytes counted as they arrive, before they are held
        try:
            try:
                upstream = await self._dispatcher.open(req.model, payload, ctx, cost=ctx.cost, task=req.TASK,
                                                       weigh=held.holds)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if held.ended is not None and task is not None and task.uncancel() == 0:
                    raise held.ended from None  # the process's bound ended it (whole_answers.py)
                raise
            held.gathered()  # its one line is in
            try:
                headers = {"x-request-id": ctx.request_id, **ctx.headers,
                           "x-sluice-queue-ms": str(round(record.queue_wait_s * 1000))}
                async for line in upstream.lines(self._settings.stall_timeout_s, ctx.deadline):
                    record.add(0, line)
                    answer = line
            finally:
                await to_the_end(upstream.aclose())
            if answer is None:
                raise UpstreamFailed("the worker sent no answer", code="worker_lost")
            body = render(req, answer)
        except BaseException:
            held.close()
            await to_the_end(self._settle(ctx, 0))
            raise
        if isinstance(body, bytes):
            held.close()
            response: Response = Response(body, media_type="application/json", headers=headers)
        else:
            response = PiecesResponse(body, headers, held.close)  # its bytes count until they leave
        record.finish()
        await self._settle(ctx, record.prompt_tokens)
        return response

    async def _settle(self, ctx: RequestContext, used_tokens: int) -> None:
        """Correct the key's and the model name's TPM charges with the prompt tokens really
        used; once."""
        for charge in ctx.take_charges():
            await self._tenancy.settle_quietly(charge, used_tokens, ctx.request_id)


class PiecesResponse(Response):
    """A JSON body of many pieces (a large embeddings answer, gateway/surfaces/pooling.py),
    joined and sent :data:`SEND_BYTES` at a time, the event loop let go between: made and sent
    whole, a 1,024 x 4,096 answer held the loop for its every byte copied at once. What it has
    not written yet counts as its connection's unsent bytes (sluice/connection_bounds.py: a
    client slower than the least rate is cut, and the largest past the process's bound), as
    the whole body in the transport did. ``handed`` runs once: when the body starts on its
    way (its bytes then counted there), or when the response is dropped unsent."""

    def __init__(self, pieces: Pieces, headers: dict[str, str], handed: Callable[[], None]) -> None:
        self.status_code = 200
        self.background = None
        self._size = sum(map(len, pieces))
        self.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        self.raw_headers += [(b"content-type", b"application/json"), (b"content-length", b"%d" % self._size)]
        self._pieces = pieces
        self._handed = weakref.finalize(self, handed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ref = scope.get(CONNECTION)
        conn: BoundedProtocol | None = None if ref is None else ref()  # (alive while its request runs)
        left = self._size
        # Taken from the end, each piece let go once joined into its batch: what is held is
        # what is not written yet, as the connection's unsent count says.
        pieces, self._pieces = self._pieces[::-1], []
        try:
            if conn is not None:
                conn.hold_unsent(left)
            self._handed()
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            batch: Pieces = []
            size = 0
            if not pieces:
                await send({"type": "http.response.body", "body": b""})
            while pieces:
                piece = pieces.pop()
                batch.append(piece)
                size += len(piece)
                if size >= SEND_BYTES or not pieces:
                    # The batch stays counted until the transport takes it (uvicorn's send
                    # waits for a paused transport first); its client left, or was cut: the
                    # rest would be joined for nobody.
                    if conn is not None and not await conn.writable(scope):
                        return
                    left -= size
                    if conn is not None:
                        conn.hold_unsent(left)
                    await send({"type": "http.response.body", "body": b"".join(batch), "more_body": bool(pieces)})
                    batch.clear()
                    size = 0
                    if pieces:
                        await asyncio.sleep(0)
        finally:
            if conn is not None:
                conn.hold_unsent(0)
            self._handed()
