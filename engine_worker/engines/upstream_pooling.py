"""An upstream server's embeddings, scores and tokenizer, passed through (``--engine openai``).

``sluice worker --engine openai --task embed --upstream-url ...`` fronts a server that
serves a pooling model (``vllm serve <model> --runner pooling``, or any server with
OpenAI's ``/v1/embeddings``): embeddings go to its ``/v1/embeddings``, scores to vLLM's
``/score`` (its own scoring: cosine for an embedding model, the model's head for a
cross-encoder), tokenizing to vLLM's ``/tokenize`` and ``/detokenize``. A server without
the route is a 400 naming it, not a retry elsewhere.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from engine_worker.engines.openai_upstream import OpenAIUpstreamEngine
from engine_worker.pooling import Pooled, PoolRequest, Tokenized
from sluice.engine_server import upstream_error
from sluice.errors import InvalidRequest, Unavailable


class UpstreamPooling:
    def __init__(self, engine: OpenAIUpstreamEngine) -> None:
        self._engine = engine

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if not self._engine.healthy:
            raise Unavailable("the upstream server is not healthy", retry_after_s=1)
        try:
            response = await self._engine.client.post(path, content=orjson.dumps({"model": self._engine.model, **body}),
                                                      headers={"content-type": "application/json"})
        except httpx.TransportError as exc:
            raise Unavailable(f"upstream server unreachable: {type(exc).__name__}", retry_after_s=1) from None
        if response.status_code in (404, 405):
            raise InvalidRequest(f"the upstream server does not serve {path}")
        if response.status_code != 200:
            raise upstream_error(response.status_code, response.content)
        answer = orjson.loads(response.content)
        if not isinstance(answer, dict):
            raise Unavailable(f"upstream server: {path} answered no JSON object", retry_after_s=1)
        return answer

    async def embed(self, request: PoolRequest, inputs: list[str | list[int]]) -> Pooled:
        body: dict[str, Any] = {"input": inputs, "encoding_format": "float"}
        if request.dimensions is not None:
            body["dimensions"] = request.dimensions
        answer = await self._post("/v1/embeddings", body)
        data = sorted(answer.get("data") or [], key=lambda d: int(d.get("index", 0)))
        return Pooled([[float(x) for x in d["embedding"]] for d in data], _prompt_tokens(answer))

    async def score(self, request: PoolRequest) -> tuple[list[float], int]:
        answer = await self._post("/score", {"text_1": request.text_1, "text_2": request.text_2})
        data = sorted(answer.get("data") or [], key=lambda d: int(d.get("index", 0)))
        return [float(d["score"]) for d in data], _prompt_tokens(answer)

    async def tokenize(self, request: PoolRequest) -> Tokenized:
        body: dict[str, Any] = {"return_token_strs": request.return_token_strs}
        if request.messages is not None:
            body.update(messages=request.messages, add_generation_prompt=request.add_generation_prompt)
        else:
            body.update(prompt=request.prompt, add_special_tokens=request.add_special_tokens)
        answer = await self._post("/tokenize", body)
        return Tokenized([int(t) for t in answer.get("tokens") or []], answer.get("token_strs"),
                         int(answer.get("max_model_len") or 0))

    async def detokenize(self, request: PoolRequest) -> str:
        return str((await self._post("/detokenize", {"tokens": request.tokens})).get("prompt", ""))


def _prompt_tokens(answer: dict[str, Any]) -> int:
    usage = answer.get("usage") or {}
    return int(usage.get("prompt_tokens") or 0)
