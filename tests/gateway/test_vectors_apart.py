"""Embeddings whose vectors come apart from their answer (engine_worker/pooling.py
``vectors_apart``): the worker's bytes, read by the gateway's line reader in pieces cut
anywhere, make the very body the answer of the version before made; the body leaves in parts, what
is not written yet counted as its connection's unsent bytes. The engine is the simulator's pooling half; the rest is
the gateway's and the worker's own code, no process needed.
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator

import base64

import numpy as np
import orjson
import pytest

from engine_worker.engines.sim_pooling import SimPooling
from engine_worker.pooling import Pooled, PoolRequest, answer, encode_line
from gateway.relay.pooling import SEND_BYTES, PiecesResponse
from gateway.relay.upstream import WorkerLines
from gateway.surfaces.pooling import EmbeddingRequest, embedding_body
from sluice.connection_bounds import CONNECTION
from sluice.errors import UpstreamFailed

INPUTS = ["the cat sat", "on the mat", "stock markets fell", "a", "b c d"]


class _Body:
    """A worker's response body as the gateway's HTTP client hands it on: in pieces."""

    def __init__(self, data: bytes, piece: int) -> None:
        self.headers = {b"content-length": b"%d" % len(data)}
        self._pieces = [data[i:i + piece] for i in range(0, len(data), piece)]

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        for piece in self._pieces:
            yield piece

    async def aclose(self) -> None:
        pass


class _Float32Pooling(SimPooling):
    """An engine whose vectors are float32 arrays, as vLLM's tensors give them
    (engine_worker/engines/vllm_pooling.py); ``as_lists``: the same values as Python floats,
    as that engine gave them before."""

    def __init__(self, dim: int, as_lists: bool = False) -> None:
        super().__init__(dim)
        self.as_lists = as_lists

    async def embed(self, request: PoolRequest, inputs: list[str | list[int]]) -> Pooled:
        pooled = await super().embed(request, inputs)
        arrays = [np.asarray(v, dtype=np.float32) for v in pooled.vectors]
        vectors = [a.tolist() for a in arrays] if self.as_lists else arrays
        return Pooled(vectors, pooled.prompt_tokens)  # type: ignore[arg-type]


async def _worker_line(req: EmbeddingRequest, apart: bool, dim: int, engine: SimPooling | None = None) -> bytes:
    payload = {"request_id": "r1", "model": req.model, **req.payload()}
    if not apart:
        del payload["vectors_apart"]  # as a gateway of the version before asks
    return encode_line(await answer(engine or SimPooling(dim), PoolRequest.model_validate(payload)))


async def _read(data: bytes, piece: int) -> dict:
    lines = [line async for line in WorkerLines(_Body(data, piece))]  # type: ignore[arg-type]
    assert len(lines) == 1  # the raw lines are not lines of their own
    return lines[0]


@pytest.mark.parametrize("encoding", ["float", "base64"])
@pytest.mark.parametrize("piece", [7, 1000, 1 << 20])
def test_the_body_is_the_one_the_answer_made_before(encoding: str, piece: int) -> None:
    req = EmbeddingRequest.model_validate({"model": "pool", "input": INPUTS, "encoding_format": encoding})

    async def both() -> tuple[object, bytes]:
        apart = embedding_body(req, await _read(await _worker_line(req, True, 64), piece))
        whole = embedding_body(req, await _read(await _worker_line(req, False, 64), piece))
        return apart, whole

    apart, whole = asyncio.run(both())
    assert isinstance(apart, list) and isinstance(whole, bytes)
    assert b"".join(apart) == whole


@pytest.mark.parametrize("apart", [True, False])
def test_float32_vectors_are_written_as_float32s_shortest_text(apart: bool) -> None:
    """An engine's float32 arrays (vLLM's) are written without a Python float per value: their
    floats' text is float32's shortest (as vLLM's own server writes it; the float64 digits of
    the same values were 1.69x the bytes on an H100 run), read back as the very float32 values;
    their base64 is the same bytes either way. A worker of the version before could not write
    an array at all."""
    req = {"model": "pool", "input": INPUTS}
    exact = [np.asarray(v, dtype=np.float32) for v in asyncio.run(SimPooling(256).embed(
        PoolRequest.model_validate({"request_id": "r", "op": "embed", **req}), INPUTS)).vectors]

    def body(encoding: str, as_lists: bool) -> bytes:
        er = EmbeddingRequest.model_validate({**req, "encoding_format": encoding})
        line = asyncio.run(_worker_line(er, apart, 256, _Float32Pooling(256, as_lists)))
        made = embedding_body(er, asyncio.run(_read(line, 1000)))
        return b"".join(made) if isinstance(made, list) else made

    floats = body("float", False)
    for got, want in zip(orjson.loads(floats)["data"], exact, strict=True):
        assert (np.asarray(got["embedding"], dtype=np.float32) == want).all()
    assert len(floats) < 0.7 * len(body("float", True))  # the same values as Python floats' digits
    for got, want in zip(orjson.loads(body("base64", False))["data"], exact, strict=True):
        assert base64.b64decode(got["embedding"]) == want.astype("<f4").tobytes()
    assert body("base64", False) == body("base64", True)


def test_an_answer_short_of_its_inputs_is_the_workers_failure() -> None:
    req = EmbeddingRequest.model_validate({"model": "pool", "input": INPUTS})
    line = asyncio.run(_read(asyncio.run(_worker_line(req, True, 8)), 64))
    line["raw"].pop()
    with pytest.raises(UpstreamFailed, match="4 embeddings for 5 inputs"):
        embedding_body(req, line)


class _Connection:
    """What the response tells its connection (sluice/connection_bounds.py ``hold_unsent``),
    and whether it may write on (``writable``: its client has not left)."""

    def __init__(self) -> None:
        self.held: list[int] = []
        self.left = False

    def hold_unsent(self, size: int) -> None:
        self.held.append(size)

    async def writable(self, scope: dict) -> bool:
        return not self.left


def test_a_large_body_leaves_in_parts_its_rest_counted_as_unsent() -> None:
    req = EmbeddingRequest.model_validate({"model": "pool", "input": [f"text {i}" for i in range(64)]})
    pieces = embedding_body(req, asyncio.run(_read(asyncio.run(_worker_line(req, True, 4096)), 1 << 16)))
    assert isinstance(pieces, list)
    size = sum(map(len, pieces))
    assert size > 2 * SEND_BYTES
    handed: list[str] = []
    messages: list[dict] = []
    conn = _Connection()

    async def send(message: dict) -> None:
        assert handed == ["handed"], "the answer bound still counted a body on its way"
        unsent = size - sum(len(m["body"]) for m in messages[1:])  # before this message
        assert conn.held[-1] == unsent - len(message.get("body", b"")), "what is not written is not counted"
        messages.append(message)

    response = PiecesResponse(pieces, {"x-request-id": "r1"}, lambda: handed.append("handed"))
    asyncio.run(response({"type": "http", CONNECTION: weakref.ref(conn)}, None, send))  # type: ignore[arg-type]
    assert handed == ["handed"] and conn.held[-1] == 0
    start, *bodies = messages
    assert (b"content-length", b"%d" % size) in start["headers"]
    assert len(bodies) > 2 and all(m["more_body"] for m in bodies[:-1]) and not bodies[-1].get("more_body")
    assert b"".join(m["body"] for m in bodies) == b"".join(pieces)
    del response
    gc.collect()
    assert handed == ["handed"]  # once

    dropped: list[str] = []
    PiecesResponse(pieces, {}, lambda: dropped.append("handed"))  # never sent (its request failed after)
    gc.collect()
    assert dropped == ["handed"]


def test_a_body_whose_client_left_is_not_made_further() -> None:
    req = EmbeddingRequest.model_validate({"model": "pool", "input": [f"text {i}" for i in range(64)]})
    pieces = embedding_body(req, asyncio.run(_read(asyncio.run(_worker_line(req, True, 4096)), 1 << 16)))
    conn = _Connection()
    bodies: list[bytes] = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            bodies.append(message["body"])
            conn.left = True  # the client hangs up after the first part

    handed: list[str] = []
    response = PiecesResponse(pieces, {}, lambda: handed.append("handed"))
    asyncio.run(response({"type": "http", CONNECTION: weakref.ref(conn)}, None, send))  # type: ignore[arg-type]
    assert len(bodies) == 1 and conn.held[-1] == 0 and handed == ["handed"]
