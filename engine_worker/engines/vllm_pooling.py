"""vLLM's half of the non-generating tasks: embeddings through ``AsyncLLM.encode``, and
tokenizing with the engine's tokenizer (a generating engine tokenizes too).

With ``--task embed`` the worker starts vLLM with ``runner="pooling", convert="embed"``:
vLLM turns the causal LM into an embedding model (the last token's hidden state,
normalised), so the default model serves ``/v1/embeddings``. Each input is one engine
request, all of them at once, so vLLM batches them as it batches generations; a request
whose client leaves is aborted inside vLLM (``encode`` aborts when cancelled).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from engine_worker.engines.prompts import as_token_ids, chat_messages, checked_ids
from engine_worker.engines.vllm_compat import vllm_api
from engine_worker.engines.vllm_engine import VllmEngine
from engine_worker.pooling import Pooled, PoolRequest, Tokenized
from sluice.errors import InvalidRequest


class VllmPooling:
    def __init__(self, engine: VllmEngine) -> None:
        self._engine = engine

    def _ids(self, item: str | list[int], param: str, add_special_tokens: bool = True) -> list[int]:
        tokenizer = self._engine.tokenizer
        if isinstance(item, list):
            return checked_ids(item, len(tokenizer), param)
        return as_token_ids(tokenizer.encode(item, add_special_tokens=add_special_tokens))

    async def embed(self, request: PoolRequest, inputs: list[str | list[int]]) -> Pooled:
        vllm = vllm_api()
        limit = self._engine.max_model_len
        prompts = [self._ids(item, "input") for item in inputs]
        for index, ids in enumerate(prompts):
            if ids and len(ids) <= limit:
                continue
            what, param = _named(request, index, inputs[index])
            if not ids:
                raise InvalidRequest(f"{what} is empty (no tokens)", param=param)
            raise InvalidRequest(f"{what} is {len(ids)} tokens; this model's context is {limit} tokens",
                                 param=param, code="context_length_exceeded")
        try:
            params = vllm.PoolingParams(task="embed", dimensions=request.dimensions)
            params.verify(self._engine.llm.model_config)  # dimensions on a model without Matryoshka: a 400
        except vllm.client_errors as exc:
            raise InvalidRequest(str(exc), param="dimensions") from None
        tag = uuid.uuid4().hex[:8]

        async def one(index: int, ids: list[int]) -> Any:
            last: Any = None
            async for out in self._engine.llm.encode(vllm.TokensPrompt(prompt_token_ids=ids), params,
                                                     request_id=f"{request.request_id}-{index}-{tag}",
                                                     priority=request.priority):
                last = out
            if last is None:
                raise RuntimeError("the engine returned no embedding")
            # float32 on the CPU as numpy's (engine_worker/pooling.py writes it without a
            # Python float per value); a bfloat16 tensor widens exactly.
            return last.outputs.data.float().cpu().numpy()

        try:
            vectors = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
        except vllm.client_errors as exc:
            raise InvalidRequest(str(exc), param="input") from None
        return Pooled(list(vectors), sum(len(ids) for ids in prompts))

    async def tokenize(self, request: PoolRequest) -> Tokenized:
        tokenizer = self._engine.tokenizer
        if request.messages is not None:
            from jinja2 import TemplateError

            try:
                ids = as_token_ids(tokenizer.apply_chat_template(
                    chat_messages(request.messages), add_generation_prompt=request.add_generation_prompt,
                    tokenize=True))
            except TemplateError as exc:
                raise InvalidRequest(f"the model's chat template refused these messages: {exc}",
                                     param="messages") from None
        else:
            ids = self._ids(request.prompt or "", "prompt", request.add_special_tokens)
        strs = [str(t) for t in tokenizer.convert_ids_to_tokens(ids)] if request.return_token_strs else None
        return Tokenized(ids, strs, self._engine.max_model_len)

    async def detokenize(self, request: PoolRequest) -> str:
        return str(self._engine.tokenizer.decode(self._ids(request.tokens or [], "tokens")))


def _named(request: PoolRequest, index: int, item: str | list[int]) -> tuple[str, str | None]:
    """How an error names one input: ``input[i]`` of an embedding request; for a score or a
    rerank (whose texts the worker de-duplicates, query first: no index of the client's),
    the text itself, shortened."""
    if request.op == "embed":
        return f"input[{index}]", "input"
    text = item if isinstance(item, str) else ""
    return f"the text to score {text[:40]!r}{'...' if len(text) > 40 else ''}", None
