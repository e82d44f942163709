"""Embeddings, scores, rerank and tokenizing: wire models and response builders. No I/O.

``POST /v1/embeddings`` is OpenAI's; ``/v1/score``, ``/v1/rerank``, ``/tokenize`` and
``/detokenize`` are vLLM's (0.32) shapes. Each request becomes one internal pool request
(engine_worker/pooling.py) sent to a worker serving its task (sluice/tasks.py), admitted
and charged as a completion is: its prompt tokens count against the key's TPM, its
priority class orders the queue, its deadline bounds the wait.

>>> EmbeddingRequest.model_validate({"model": "sim", "input": ["a", "b"]}).inputs()
['a', 'b']
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine_worker.pooling import float32_base64
from gateway.surfaces.openai import ChatMessage, ModelName, Prompt, TokenIds, UserId, prompts_chars
from sluice.errors import UpstreamFailed
from sluice.lines import RAW_KEY
from sluice.tasks import EMBED, SCORE, TOKENIZE, Task

#: Inputs in one request: OpenAI's limit for embeddings (and the worker's, engine_worker/pooling.py).
MAX_INPUTS = 2048

#: Fields vLLM's pooling requests take that change the answer and that are not honoured here:
#: a 400 naming the field, never a silent drop.
REFUSED_FIELDS = {
    "truncate_prompt_tokens": "truncation is not supported; send inputs that fit the model's context",
    "use_activation": "use_activation is not supported",
    "normalize": "normalize is not supported (embeddings come as the model pools them)",
    "mm_processor_kwargs": "multimodal inputs are not supported",
    "instruction": "score instructions (chat-template scoring) are not supported",
    "chat_template_kwargs": "chat_template_kwargs is not supported here",
}


class _PoolingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: ModelName
    user: UserId | None = None
    #: Lower runs first; also header X-Sluice-Priority or service_tier (as on completions).
    priority: int | None = None
    service_tier: str | None = None

    def refusal(self) -> tuple[str, str] | None:
        extra = self.model_extra or {}
        name = next((n for n in sorted(extra) if n in REFUSED_FIELDS and extra[n] is not None), None)
        return None if name is None else (name, REFUSED_FIELDS[name])

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class EmbeddingRequest(_PoolingFields):
    #: A text, texts, token ids, or lists of token ids (one embedding each).
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    #: Matryoshka models only; any other model refuses it (400).
    dimensions: int | None = Field(default=None, ge=1)

    TASK: ClassVar[Task] = EMBED

    @model_validator(mode="after")
    def _inputs(self) -> EmbeddingRequest:
        items = self.inputs()
        if len(items) > MAX_INPUTS:
            raise ValueError(f"input: at most {MAX_INPUTS} inputs per request")
        if any(not item for item in items):
            raise ValueError("input: an input must not be empty")
        return self

    def inputs(self) -> list[str | list[int]]:
        value = self.input
        if isinstance(value, str):
            return [value]
        if all(isinstance(v, int) for v in value):
            return [value]  # type: ignore[list-item]
        return list(value)  # type: ignore[arg-type]

    def payload(self) -> dict[str, Any]:
        return {"op": "embed", "input": self.inputs(), "dimensions": self.dimensions, "vectors_apart": True,
                "encoding_format": "base64" if self.encoding_format == "base64" else "float_text"}

    def prompt_chars(self) -> int:
        return prompts_chars(self.inputs())


#: A side of a score: one text or several (vLLM also takes multimodal parts: refused).
ScoreSide = Annotated[str | list[str], Field(min_length=1)]


class ScoreRequest(_PoolingFields):
    """vLLM's ``/score``: (queries, documents), (queries, items), (data_1, data_2) or
    (text_1, text_2); 1:1, 1:N or N:N."""

    queries: ScoreSide | None = None
    documents: ScoreSide | None = None
    items: ScoreSide | None = None
    data_1: ScoreSide | None = None
    data_2: ScoreSide | None = None
    text_1: ScoreSide | None = None
    text_2: ScoreSide | None = None

    TASK: ClassVar[Task] = SCORE

    @model_validator(mode="after")
    def _one_pairing(self) -> ScoreRequest:
        complete = [p for p in _PAIRINGS if getattr(self, p[0]) is not None and getattr(self, p[1]) is not None]
        named = {f for p in _PAIRINGS for f in p if getattr(self, f) is not None}
        if len(complete) != 1 or named != set(complete[0]):
            raise ValueError("give exactly one pair of fields: queries and documents (or items), data_1 and "
                             "data_2, or text_1 and text_2")
        pairs(*self.sides())  # 1:1, 1:N or N:N
        return self

    def sides(self) -> tuple[list[str], list[str]]:
        first, second = next(p for p in _PAIRINGS if getattr(self, p[0]) is not None and getattr(self, p[1]) is not None)
        return _listed(getattr(self, first)), _listed(getattr(self, second))

    def payload(self) -> dict[str, Any]:
        text_1, text_2 = pairs(*self.sides())
        return {"op": "score", "text_1": text_1, "text_2": text_2}

    def prompt_chars(self) -> int:
        text_1, text_2 = pairs(*self.sides())
        return prompts_chars(text_1) + prompts_chars(text_2)


_PAIRINGS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


class RerankRequest(_PoolingFields):
    """vLLM's ``/rerank`` (Jina's and Cohere's shape): documents ordered by relevance."""

    query: str
    documents: ScoreSide
    #: The best ``top_n`` results; 0 (the default): all of them.
    top_n: int = Field(default=0, ge=0)

    TASK: ClassVar[Task] = SCORE

    @model_validator(mode="after")
    def _bounded(self) -> RerankRequest:
        if len(_listed(self.documents)) > MAX_INPUTS:
            raise ValueError(f"documents: at most {MAX_INPUTS} per request")
        return self

    def payload(self) -> dict[str, Any]:
        documents = _listed(self.documents)
        return {"op": "score", "text_1": [self.query] * len(documents), "text_2": documents}

    def prompt_chars(self) -> int:
        documents = _listed(self.documents)
        return len(self.query) * len(documents) + prompts_chars(documents)


class TokenizeRequest(_PoolingFields):
    """vLLM's ``/tokenize``: a ``prompt``, or chat ``messages`` through the model's template."""

    model: ModelName | None = None  # type: ignore[assignment]
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    TASK: ClassVar[Task] = TOKENIZE

    @model_validator(mode="after")
    def _one_source(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self

    def payload(self) -> dict[str, Any]:
        if self.messages is not None:
            return {"op": "tokenize", "messages": [m.model_dump(exclude_none=True) for m in self.messages],
                    "add_generation_prompt": self.add_generation_prompt,
                    "return_token_strs": self.return_token_strs}
        # vLLM's defaults: special tokens for a prompt, none added around a rendered chat.
        return {"op": "tokenize", "prompt": self.prompt, "return_token_strs": self.return_token_strs,
                "add_special_tokens": True if self.add_special_tokens is None else self.add_special_tokens}

    def prompt_chars(self) -> int:
        if self.prompt is not None:
            return len(self.prompt)
        return sum(len(orjson.dumps(m.content)) for m in self.messages or ())


class DetokenizeRequest(_PoolingFields):
    model: ModelName | None = None  # type: ignore[assignment]
    tokens: TokenIds = Field(max_length=1_000_000)

    TASK: ClassVar[Task] = TOKENIZE

    def payload(self) -> dict[str, Any]:
        return {"op": "detokenize", "tokens": self.tokens}

    def prompt_chars(self) -> int:
        return 4 * len(self.tokens)


PoolingRequest = EmbeddingRequest | ScoreRequest | RerankRequest | TokenizeRequest | DetokenizeRequest


def pairs(first: list[str], second: list[str]) -> tuple[list[str], list[str]]:
    """vLLM's pairing: one first text against every second one (1:N), or pairwise (N:N)."""
    if not first or not second:
        raise ValueError("at least one text must be given on each side")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError("input lengths must be either 1:1, 1:N or N:N")
    if len(first) > MAX_INPUTS:
        raise ValueError(f"at most {MAX_INPUTS} pairs per request")
    return first, second


def _listed(side: str | list[str]) -> list[str]:
    return [side] if isinstance(side, str) else list(side)


# -- responses -----------------------------------------------------------------------


#: A body made of pieces: sent in order, a piece at most once (gateway/relay/pooling.py).
Pieces = list[bytes | memoryview]


def embedding_body(req: EmbeddingRequest, answer: dict[str, Any]) -> bytes | Pieces:
    """The client's body. The vectors come made by the worker, as strings the gateway passes
    on, in their own line before the answer (its ``raw``: the body's pieces, none parsed or
    copied here; :func:`embedding_pieces`), or in the answer (a worker of the version before):
    base64 (``embeddings_base64``), or each vector's JSON text (``embeddings_text``, put in
    the body as it is). Their 8.4M floats, parsed and rendered again here, held the gateway's
    loop about 0.7 s for a 1,024 x 4,096 answer, and the strings, parsed, 0.2 s. A worker of
    an earlier version still sends floats, rendered (or packed) here."""
    raw = answer.get(RAW_KEY)
    if raw is not None:
        return embedding_pieces(req, answer, raw)
    usage = _usage(answer)
    made = answer.get("embeddings_base64")
    texts = answer.get("embeddings_text")
    if made is not None:
        vectors = made
    elif texts is not None:
        vectors = [orjson.Fragment(text) for text in texts]
    elif req.encoding_format == "base64":
        vectors = [float32_base64(v) for v in answer["embeddings"]]
    else:
        vectors = answer["embeddings"]
    data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
    return orjson.dumps({"object": "list", "data": data, "model": req.model,
                         "usage": {"prompt_tokens": usage, "total_tokens": usage}})


def embedding_pieces(req: EmbeddingRequest, answer: dict[str, Any], raw: list[memoryview]) -> Pieces:
    """The bytes :func:`embedding_body` makes of the same vectors, as pieces: each vector's
    bytes as the worker made them (``raw``), between its object's head and end."""
    if len(raw) != len(req.inputs()):
        raise UpstreamFailed(f"the worker's answer has {len(raw)} embeddings for {len(req.inputs())} inputs")
    pieces: Pieces = [b'{"object":"list","data":[']
    for index, vector in enumerate(raw):
        pieces += (b'%s{"object":"embedding","index":%d,"embedding":' % (b"," if index else b"", index),
                   vector, b"}")
    usage = _usage(answer)
    pieces.append(b'],"model":%s,"usage":%s}' % (orjson.dumps(req.model), orjson.dumps(
        {"prompt_tokens": usage, "total_tokens": usage})))
    return pieces


def score_body(req: ScoreRequest, answer: dict[str, Any]) -> bytes:
    usage = _usage(answer)
    return orjson.dumps({
        "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": req.model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(answer["scores"])],
        "usage": {"prompt_tokens": usage, "total_tokens": usage, "completion_tokens": 0},
    })


def rerank_body(req: RerankRequest, answer: dict[str, Any]) -> bytes:
    documents = _listed(req.documents)
    results = [{"index": i, "document": {"text": documents[i]}, "relevance_score": s}
               for i, s in enumerate(answer["scores"])]
    results.sort(key=lambda r: -r["relevance_score"])
    if req.top_n:
        results = results[:req.top_n]
    usage = _usage(answer)
    return orjson.dumps({"id": f"rerank-{uuid.uuid4().hex}", "model": req.model, "results": results,
                         "usage": {"prompt_tokens": usage, "total_tokens": usage}})


def tokenize_body(req: TokenizeRequest, answer: dict[str, Any]) -> bytes:
    tokens = answer["tokens"]
    return orjson.dumps({"count": len(tokens), "max_model_len": answer.get("max_model_len", 0), "tokens": tokens,
                         "token_strs": answer.get("token_strs") if req.return_token_strs else None})


def detokenize_body(req: DetokenizeRequest, answer: dict[str, Any]) -> bytes:
    return orjson.dumps({"prompt": answer["prompt"]})


def render(req: PoolingRequest, answer: dict[str, Any]) -> bytes | Pieces:
    if isinstance(req, EmbeddingRequest):
        return embedding_body(req, answer)
    if isinstance(req, ScoreRequest):
        return score_body(req, answer)
    if isinstance(req, RerankRequest):
        return rerank_body(req, answer)
    if isinstance(req, TokenizeRequest):
        return tokenize_body(req, answer)
    return detokenize_body(req, answer)


def _usage(answer: dict[str, Any]) -> int:
    return int((answer.get("usage") or {}).get("prompt_tokens", 0))
