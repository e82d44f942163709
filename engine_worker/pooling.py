"""The worker's non-generating tasks: ``POST /internal/pool`` (embed, score, tokenize).

Request: a :class:`PoolRequest` JSON body; its ``op`` says which. Response: one NDJSON
line, the whole answer, ending as a generation's last line does (``finish_reason`` and
``usage``), so the gateway reads it with the stream it reads generations with (the same
retries before the first line, the same lease release corrected by usage)::

    {"embeddings": [[0.01, ...], ...], "finish_reason": "stop",
     "usage": {"prompt_tokens": 9, "completion_tokens": 0, "cached_tokens": 0}}
    {"scores": [0.83, 0.12], ...}
    {"tokens": [504, 2365], "token_strs": null, "max_model_len": 2048, ...}
    {"prompt": "Hello world", ...}

A gateway may ask for an embeddings answer's vectors apart (``vectors_apart``): each comes in
a line of its own before the answer (sluice/lines.py ``RAW_MARK``), its JSON value as the
gateway's client gets it::

    =[0.01,...]
    =[0.02,...]
    {"finish_reason": "stop", "usage": {...}}

An engine may give its vectors as float32 arrays (vLLM's: its pooled tensors, never made
into Python floats): their JSON is float32's shortest text, as vLLM's own server and OpenAI
write it (``0.0019690907``, where the same value as a Python float is
``0.001969090662896633``: 1.69x the bytes), the same float32 values when read back. For 1,024
vectors of 4,096 (``loadtest/embed_text_cost.py``, medians of 3): their JSON in 123 ms, where
the floats' lists took 270 ms to make and 198 to write; their base64 in 37 ms, against 100 after
the same 270.
An engine's lists of Python floats (the simulator's, an upstream server's) are written as they
are.

Scores of an embedding model are the cosine similarities of the pair's embeddings, as
vLLM scores with one; an engine that scores natively (an upstream server) says so with a
``score`` method of its own.
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import orjson
from pydantic import BaseModel, Field, model_validator

from engine_worker.protocol import parse_body
from sluice.lines import RAW_KEY, RAW_MARK

_RAW_MARK = bytes((RAW_MARK,))

#: Inputs one request may carry (texts to embed, pairs to score): the gateway's cap too.
MAX_POOL_INPUTS = 2048

Op = Literal["embed", "score", "tokenize", "detokenize"]
#: The registered task each op needs (sluice/tasks.py).
TASK_OF: dict[str, str] = {"embed": "embed", "score": "score", "tokenize": "tokenize", "detokenize": "tokenize"}


class PoolRequest(BaseModel):
    request_id: str = Field(min_length=1, max_length=128)
    model: str
    op: Op
    priority: int = Field(default=0, ge=-1000, le=1000)
    #: embed: texts or token-id lists.
    input: list[str | list[int]] | None = Field(default=None, max_length=MAX_POOL_INPUTS)
    #: embed: a Matryoshka model's output size; refused by a model without one.
    dimensions: int | None = Field(default=None, ge=1)
    #: embed: how the vectors travel. "float": lists of floats (a gateway of an earlier
    #: version's); "base64": each as OpenAI's base64 of its float32 bytes; "float_text": each
    #: as its JSON text in a string. Both are made here, so a gateway passes strings on instead
    #: of parsing every float and rendering it again.
    encoding_format: Literal["float", "base64", "float_text"] = "float"
    #: embed: the vectors, as ``encoding_format`` makes them (base64 in quotes, the floats'
    #: text), each in a line of its own before the answer's (above): a gateway puts them in its
    #: client's body unparsed. A worker of an earlier version ignores it (strings in the answer).
    vectors_apart: bool = False
    #: score: pairs (text_1[i], text_2[i]).
    text_1: list[str] | None = Field(default=None, max_length=MAX_POOL_INPUTS)
    text_2: list[str] | None = Field(default=None, max_length=MAX_POOL_INPUTS)
    #: tokenize: a prompt, or chat messages rendered by the model's chat template.
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    #: detokenize.
    tokens: list[int] | None = None

    @model_validator(mode="after")
    def _fields_of_op(self) -> PoolRequest:
        needed = {"embed": ("input",), "score": ("text_1", "text_2"), "detokenize": ("tokens",)}.get(self.op, ())
        for name in needed:
            if getattr(self, name) is None:
                raise ValueError(f"op {self.op!r} needs {name!r}")
        if self.op == "score" and len(self.text_1 or ()) != len(self.text_2 or ()):
            raise ValueError("text_1 and text_2 must pair up (equal lengths)")
        if self.op == "tokenize" and (self.prompt is None) == (self.messages is None):
            raise ValueError("tokenize needs exactly one of 'prompt' and 'messages'")
        return self

    @classmethod
    def parse(cls, body: bytes) -> PoolRequest:
        return parse_body(cls, body, "pool")


@dataclass(slots=True)
class Pooled:
    """Embeddings of a request's inputs, in order, and the prompt tokens they took. A vector
    is a list of floats or a float32 array (numpy's, as an engine's tensor gives it)."""

    vectors: list[Sequence[float]]
    prompt_tokens: int


@dataclass(slots=True)
class Tokenized:
    tokens: list[int]
    token_strs: list[str] | None
    max_model_len: int


class PoolingEngine(Protocol):
    """What an engine that serves the non-generating tasks implements."""

    async def embed(self, request: PoolRequest, inputs: list[str | list[int]]) -> Pooled: ...

    async def tokenize(self, request: PoolRequest) -> Tokenized: ...

    async def detokenize(self, request: PoolRequest) -> str: ...


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


async def answer(engine: Any, request: PoolRequest) -> dict[str, Any]:
    """The line answering ``request`` (without its ending), with the bytes of its raw lines
    (vectors apart) as its ``RAW_KEY``."""
    if request.op == "embed":
        assert request.input is not None
        pooled = await engine.embed(request, request.input)
        usage = _usage(pooled.prompt_tokens)
        if request.vectors_apart:
            values = [orjson.dumps(float32_base64(v)) if request.encoding_format == "base64" else vector_json(v)
                      for v in pooled.vectors]
            return {"usage": usage, RAW_KEY: values}
        if request.encoding_format == "base64":
            return {"embeddings_base64": [float32_base64(v) for v in pooled.vectors], "usage": usage}
        if request.encoding_format == "float_text":
            return {"embeddings_text": [vector_json(v).decode() for v in pooled.vectors], "usage": usage}
        return {"embeddings": pooled.vectors, "usage": usage}
    if request.op == "score":
        if hasattr(engine, "score"):  # scores natively (a cross-encoder behind an upstream server)
            scores, used = await engine.score(request)
            return {"scores": scores, "usage": _usage(used)}
        assert request.text_1 is not None and request.text_2 is not None
        # Each distinct text embedded once (a rerank's query appears in every pair).
        texts = list(dict.fromkeys([*request.text_1, *request.text_2]))
        pooled = await engine.embed(request, texts)  # type: ignore[arg-type]
        # As Python floats once per text (a float32 array's values summed in float64 below).
        vector = dict(zip(texts, (list(map(float, v)) for v in pooled.vectors), strict=True))
        scores = [cosine(vector[a], vector[b]) for a, b in zip(request.text_1, request.text_2, strict=True)]
        return {"scores": scores, "usage": _usage(pooled.prompt_tokens)}
    if request.op == "tokenize":
        done = await engine.tokenize(request)
        return {"tokens": done.tokens, "token_strs": done.token_strs, "max_model_len": done.max_model_len,
                "usage": _usage(len(done.tokens))}
    assert request.tokens is not None
    return {"prompt": await engine.detokenize(request), "usage": _usage(len(request.tokens))}


def vector_json(vector: Sequence[float]) -> bytes:
    """A vector's JSON array: a float32 array's values as float32's shortest text, a list's
    as they are (see the module)."""
    return orjson.dumps(vector, option=orjson.OPT_SERIALIZE_NUMPY)


def float32_base64(vector: Sequence[float]) -> str:
    """OpenAI's base64 encoding of an embedding: its little-endian float32 bytes (what the
    SDK asks for by default, and decodes)."""
    astype = getattr(vector, "astype", None)  # a numpy array: its bytes, not a float per value
    raw = astype("<f4", copy=False).tobytes() if astype is not None else struct.pack(f"<{len(vector)}f", *vector)
    return base64.b64encode(raw).decode()


def encode_line(answer: dict[str, Any]) -> bytes:
    raw = answer.pop(RAW_KEY, None)
    line = orjson.dumps({**answer, "finish_reason": "stop"}, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
    if raw is None:
        return line
    parts = []
    for value in raw:
        parts += (_RAW_MARK, value, b"\n")
    parts.append(line)
    return b"".join(parts)


def _usage(prompt_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "cached_tokens": 0}
