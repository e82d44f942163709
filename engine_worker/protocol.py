"""The internal wire format between gateway and worker.

Request: ``POST /internal/generate`` with a :class:`GenerateRequest` JSON body.
Response: NDJSON, one line per engine step::

    {"ids": [318, 257], "text": " the cat"}
    {"ids": [13], "text": ".", "finish_reason": "stop",
     "usage": {"prompt_tokens": 12, "completion_tokens": 3, "cached_tokens": 0}}

Optional keys: ``lp`` (log-probabilities), ``tc`` (tool-call deltas in OpenAI's
streamed shape; the finish reason is then ``tool_calls``), ``echo`` (the prompt's
text, first line only), ``kv_transfer_params`` (a prefill hop's finishing line: where a
decode engine finds the prompt's KV). A failure after the stream started is one ``{"error": {...}}`` line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypedDict, TypeVar

import orjson
from pydantic import BaseModel, Field, ValidationError

from sluice.errors import InvalidRequest


class GenerateRequest(BaseModel):
    request_id: str = Field(min_length=1, max_length=128)
    model: str
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = Field(default=None, min_length=1)
    #: The prompt's token ids as the gateway computed them for the precise prefix index, and
    #: the digest of the tokenizer it used: a worker whose tokenizer has that digest takes
    #: them instead of tokenizing the prompt again (engines/prompts.py ``PromptIds``).
    gateway_prompt_ids: list[int] | None = Field(default=None, min_length=1, max_length=1_000_000)
    gateway_tokenizer: str | None = Field(default=None, max_length=64)
    #: Completions: send the prompt's text back first (in the first line's ``echo``).
    echo: bool = False
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = Field(default_factory=list, max_length=16)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    logit_bias: dict[str, float] | None = None
    #: A decoding constraint: ``{"json": schema}`` or ``{"json_object": true}``.
    structured: dict[str, Any] | None = None
    #: OpenAI ``tools`` (function definitions), passed to the chat template.
    tools: list[dict[str, Any]] | None = None
    #: "none", "auto" (the worker's tool-call parser), "required", or {"name": ...}.
    tool_mode: str | dict[str, str] | None = None
    parallel_tool_calls: bool = True
    #: vLLM extensions: generate exactly up to max_tokens / at least min_tokens.
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    #: Log-probabilities per token: None = off, k = the sampled token plus the top k.
    logprobs: int | None = Field(default=None, ge=0, le=20)
    priority: int = Field(default=0, ge=-1000, le=1000)
    #: The LoRA adapter this request runs with (its ``model`` when that is not the worker's
    #: base model); set by the worker once it holds the adapter, never sent.
    adapter: str | None = Field(default=None, exclude=True)
    #: W3C trace context for the engine; set by the worker from its own span, never sent.
    trace_headers: dict[str, str] | None = Field(default=None, exclude=True)
    #: Token ids already delivered to the client by an earlier worker (migration).
    resume_token_ids: list[int] = Field(default_factory=list, max_length=1_000_000)
    #: Characters of text the client already has for those ids. An engine may hold text
    #: back (a possible stop string, a partial UTF-8 character) while sending the ids;
    #: the resuming worker emits that held-back text first.
    resume_text_chars: int | None = Field(default=None, ge=0)
    #: Prefill/decode disaggregation (gateway/relay/disagg.py): vLLM's KV connector parameters.
    #: A prefill hop sends ``{"do_remote_decode": true, ...}``; a decode hop sends what its
    #: prefill's finishing line returned.
    kv_transfer_params: dict[str, Any] | None = None
    #: The client takes the answer whole and it is short (gateway/surfaces/openai.py
    #: ``answered_whole``): an engine behind an OpenAI-compatible server asks it for one JSON
    #: answer, and its one line is the finishing one. The other engines stream as ever.
    whole: bool = False

    @classmethod
    def parse(cls, body: bytes) -> GenerateRequest:
        return parse_body(cls, body, "generate")


M = TypeVar("M", bound=BaseModel)


def parse_body(model: type[M], body: bytes, what: str) -> M:
    """An internal request from its JSON; a bad one is an :class:`InvalidRequest` naming the field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise InvalidRequest(f"invalid {what} request: {first['msg']}",
                             param=".".join(str(p) for p in first["loc"]) or None) from None


class KVEvent(TypedDict):
    """A change to an engine's prefix cache, named like vLLM's KV events (``BlockStored``,
    ``BlockRemoved``, ``AllBlocksCleared``): blocks by their chained hashes."""

    type: Literal["stored", "removed", "cleared"]
    block_hashes: list[str]


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }


@dataclass(slots=True)
class Delta:
    """What one engine step produced for one request."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    #: Per token: [token text, logprob, [[alternative text, logprob], ...]].
    logprobs: list[list[Any]] | None = None
    #: Tool-call deltas in OpenAI's streamed shape (``index``, ``id``, ``function``).
    tool_calls: list[dict[str, Any]] | None = None
    #: The prompt's text, sent back before the completion (completions' ``echo``).
    echo: str | None = None
    #: The stop string that ended the generation (finish reason "stop"), when one did:
    #: Anthropic's ``stop_sequence`` (an end of sequence is none).
    stop_sequence: str | None = None
    #: A prefill hop's finishing delta: the KV connector's parameters for the decode engine.
    kv_transfer_params: dict[str, Any] | None = None

    def encode(self) -> bytes:
        return orjson.dumps(self.line()) + b"\n"

    def line(self) -> dict[str, Any]:
        """The NDJSON line a worker sends for this delta, as a dict."""
        line: dict[str, Any] = {"ids": self.token_ids, "text": self.text}
        if self.tool_calls:
            line["tc"] = self.tool_calls
        if self.echo:
            line["echo"] = self.echo
        if self.logprobs is not None:
            line["lp"] = self.logprobs
        if self.finish_reason is not None:
            line["finish_reason"] = self.finish_reason
        if self.usage is not None:
            line["usage"] = self.usage.as_dict()
        if self.stop_sequence is not None:
            line["stop_sequence"] = self.stop_sequence
        if self.kv_transfer_params is not None:
            line["kv_transfer_params"] = self.kv_transfer_params
        return line


def stop_string(finish_reason: str | None, stop_reason: object) -> str | None:
    """The stop string an engine says ended a generation: vLLM, TensorRT-LLM and vLLM's
    server name it in ``stop_reason`` (a stop token's id, or nothing for an end of
    sequence, is no string)."""
    return stop_reason if finish_reason == "stop" and isinstance(stop_reason, str) and stop_reason else None
