"""A stand-in for TensorRT-LLM's LLM API, for contract tests only.

It mimics the documented surface our adapter uses: LLM(...), SamplingParams,
generate_async(..., streaming=True) with cumulative outputs, abort(),
get_stats_async(), shutdown(), llm.tokenizer.tokenizer. It generates tokens
from a counter; nothing here is TensorRT-LLM code.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from tensorrt_llm.llmapi import KvCacheConfig

__all__ = ["LLM", "SamplingParams", "KvCacheConfig"]


@dataclass(kw_only=True)
class SamplingParams:
    max_tokens: int = 32
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] | None = None
    n: int = 1
    detokenize: bool = True


class _HFTokenizer:
    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]

    def decode(self, ids: list[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        return "".join(" " + "x" * i for i in ids)  # encode's inverse, up to the letters

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> list[int]:
        return [1] + [len(m["content"]) for m in messages] + [2]


class _TransformersTokenizer:
    def __init__(self) -> None:
        self.tokenizer = _HFTokenizer()


@dataclass
class CompletionOutput:
    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class RequestOutput:
    def __init__(self, llm: LLM, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._llm = llm
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.outputs = [CompletionOutput()]
        self.cached_tokens = llm.cached_tokens
        self.aborted_flag = False

    @property
    def finished(self) -> bool:
        return self.outputs[0].finish_reason is not None

    def abort(self) -> None:
        self.aborted_flag = True
        self._llm.aborts.append(self)

    def __aiter__(self) -> RequestOutput:
        return self

    async def __anext__(self) -> RequestOutput:
        out = self.outputs[0]
        if out.finish_reason is not None:
            raise StopAsyncIteration
        await asyncio.sleep(self._llm.step_s)
        if self.aborted_flag:
            out.finish_reason = "cancelled"
            return self
        n = len(out.token_ids)
        out.token_ids.append(100 + len(self.prompt_token_ids) + n)  # cumulative, like TRT-LLM
        out.text += f" t{len(self.prompt_token_ids) + n}"
        if len(out.token_ids) >= self.params.max_tokens:
            out.finish_reason = "length"
        return self


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        self.model = model
        self.kwargs = kwargs
        self.tokenizer = _TransformersTokenizer()
        self.requests: list[RequestOutput] = []
        self.aborts: list[RequestOutput] = []
        self.cached_tokens = 0
        self.step_s = 0.001
        self.stats_queue: list[dict[str, Any]] = []
        self.shut = False

    def generate_async(
        self, inputs: Any, sampling_params: SamplingParams | None = None, *, streaming: bool = False, **kw: Any
    ) -> RequestOutput:
        ids = list(inputs["prompt_token_ids"]) if isinstance(inputs, dict) else list(inputs)
        result = RequestOutput(self, ids, sampling_params or SamplingParams())
        self.requests.append(result)
        return result

    async def _stats(self, timeout: float) -> Any:
        while self.stats_queue:
            yield self.stats_queue.pop(0)

    def get_stats_async(self, timeout: float = 2) -> Any:
        return self._stats(timeout)

    def shutdown(self) -> None:
        self.shut = True
