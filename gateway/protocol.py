"""OpenAI wire models (requests) and byte builders (responses). No I/O here.

Requests are validated once with pydantic; chunks are built from byte
templates with orjson, never through a model per chunk (the hot path).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class _SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    #: vLLM extensions, accepted the same way vLLM's own server does.
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    #: Choices per prompt; each runs as its own generation (seed + i when a seed is given).
    n: int = Field(default=1, ge=1)
    user: str | None = None
    #: Lower runs first (vLLM's convention); also header X-Sluice-Priority or service_tier.
    priority: int | None = None
    service_tier: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "text") != "text":
            raise ValueError(f"response_format {value.get('type')!r} (guided decoding) is not supported yet")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def token_limit(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


def worker_payloads(req: ChatCompletionRequest | CompletionRequest, request_id: str) -> list[dict[str, Any]]:
    """One ``POST /internal/generate`` body per choice: prompts x n, in choice-index order."""
    prompts: list[str | None] = list(req.prompts()) if isinstance(req, CompletionRequest) else [None]
    count = len(prompts) * req.n
    return [
        worker_payload(
            req,
            request_id if count == 1 else f"{request_id}-{index}",
            prompts[index // req.n],
            choice=index % req.n,
        )
        for index in range(count)
    ]


def worker_payload(
    req: ChatCompletionRequest | CompletionRequest, request_id: str, prompt: str | None, *, choice: int = 0
) -> dict[str, Any]:
    """The body of ``POST /internal/generate`` for one choice."""
    payload: dict[str, Any] = {
        "request_id": request_id,
        "model": req.model,
        "max_tokens": req.token_limit(),
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "seed": None if req.seed is None else req.seed + choice,
        "stop": req.stop_list(),
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "ignore_eos": req.ignore_eos,
        "min_tokens": req.min_tokens,
        "logprobs": req.logprobs_count(),
    }
    if isinstance(req, ChatCompletionRequest):
        payload["messages"] = [m.model_dump(exclude_none=True) for m in req.messages]
    else:
        payload["prompt"] = prompt
    return payload


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class ChunkWriter:
    """Builds SSE ``data:`` events for one streaming response from byte templates.

    >>> w = ChunkWriter("chat", "sim")
    >>> w.delta(0, "Hi", None, first=True)[:6]
    b'data: '
    """

    def __init__(self, kind: Literal["chat", "text"], model: str, *, id: str | None = None,
                 created: int | None = None) -> None:
        self.kind = kind
        self.id = id or new_id(kind)  # a stream taken over by another gateway keeps its id
        self.created = int(time.time()) if created is None else created
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self._head = (
            b'data: {"id":"' + self.id.encode() + b'","object":"' + obj.encode()
            + b'","created":' + str(self.created).encode()
            + b',"model":' + orjson.dumps(model)
        )
        self._choice_head = self._head + b',"choices":[{"index":'

    def delta(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        *,
        first: bool = False,
        logprobs: dict[str, Any] | None = None,
    ) -> bytes:
        if self.kind == "chat":
            body = {"role": "assistant", "content": text} if first else {"content": text}
            middle = b',"delta":' + orjson.dumps(body)
        else:
            middle = b',"text":' + orjson.dumps(text)
        finish = b"null" if finish_reason is None else orjson.dumps(finish_reason)
        lp = b"null" if logprobs is None else orjson.dumps(logprobs)
        return (
            self._choice_head + str(index).encode() + middle
            + b',"logprobs":' + lp + b',"finish_reason":' + finish + b"}]}\n\n"
        )

    def usage(self, usage: dict[str, Any]) -> bytes:
        return self._head + b',"choices":[],"usage":' + orjson.dumps(usage) + b"}\n\n"


DONE = b"data: [DONE]\n\n"


def new_id(kind: Literal["chat", "text"]) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def completion_body(
    kind: Literal["chat", "text"],
    model: str,
    choices: list[tuple[str, str | None, dict[str, Any] | None]],
    usage: dict[str, Any],
) -> bytes:
    """One ``chat.completion`` or ``text_completion`` JSON body."""
    rendered: list[dict[str, Any]] = []
    for index, (text, finish_reason, logprobs) in enumerate(choices):
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        rendered.append(choice)
    return orjson.dumps(
        {
            "id": new_id(kind),
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": rendered,
            "usage": usage,
        }
    )
