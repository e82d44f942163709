"""The Anthropic Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) on
top of chat completions.

A Messages request becomes a :class:`ChatCompletionRequest` (``system`` → a system
message, ``tool_use`` blocks → an assistant turn's tool calls, ``tool_result`` blocks →
tool turns, tools' ``input_schema`` → function parameters, ``tool_choice`` any → required,
``stop_sequences`` → stop, ``metadata.user_id`` → user), so admission, priority,
deadlines, quotas, retries, migration and resumable streams are the chat path's. Only the
rendering differs: one ``message`` object, or Anthropic's event sequence::

    message_start, ping,
    (content_block_start, content_block_delta*, content_block_stop)*,
    message_delta (stop_reason, usage), message_stop

Errors on these routes are Anthropic's ``{"type": "error", "error": {"type", "message"}}``
with the gateway's HTTP status (:func:`error_response`), in-band as ``event: error`` once
a stream runs (:func:`anthropic_frames` rewrites the relay's and the journal's own error
events and drops the ``[DONE]`` a resumable stream's journal ends with).

Usage follows Anthropic's split: ``input_tokens`` are the prompt tokens the engine did not
find in its prefix cache, ``cache_read_input_tokens`` those it did. A stream's
``message_start`` cannot know the prompt's size yet (workers report usage with the last
token), so it says 0; ``message_delta`` carries every count, as Anthropic's does.

Images, documents, thinking, server tools and a final assistant turn (prefill) are
refused by name, never dropped.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.responses import Response

from gateway.surfaces.openai import DONE, ChatCompletionRequest, ModelName, ToolCallAssembler, UserId, first_refused
from sluice.errors import InvalidRequest, SluiceError, UpstreamFailed

#: Fields that change what a Messages request means and that this gateway cannot honour.
REFUSED_FIELDS = {
    "mcp_servers": "MCP servers are not supported",
    "container": "code execution containers are not supported",
    "context_management": "context management is not supported",
}

_TOOL_NAME = r"^[A-Za-z0-9_.-]+$"


class MessagesTool(BaseModel):
    """A client tool; Anthropic's server tools (web search, bash, ...) run nowhere here."""

    model_config = ConfigDict(extra="allow")  # cache_control: a hint with no meaning here

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=64, pattern=_TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"server tools ({kind!r}) are not supported; only custom tools with an input_schema")
        return value


class MessagesToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> MessagesToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("type 'tool' needs the tool's name")  # the field is named by its location
        return self


class MessageParam(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class OutputFormat(BaseModel):
    type: Literal["json_schema"]
    #: ``schema`` on the wire (a pydantic BaseModel attribute name, hence the alias).
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: OutputFormat | None = None
    effort: str | None = None

    @field_validator("effort")
    @classmethod
    def _one_effort(cls, value: str | None) -> None:
        if value is not None:
            raise ValueError("effort levels are not supported: this gateway's models have one")


class MessagesMetadata(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user_id: UserId | None = None


class _Conversation(BaseModel):
    """What ``/v1/messages`` and ``/v1/messages/count_tokens`` share: the prompt."""

    # strict: each top-level field takes its own JSON type only, as Anthropic's API does
    # (lax mode took ``max_tokens: true`` as 1 and ``stream: "yes"`` as a stream).
    model_config = ConfigDict(extra="allow", strict=True)

    model: ModelName
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[MessagesTool] | None = Field(default=None, max_length=128)
    tool_choice: MessagesToolChoice | None = None
    thinking: dict[str, Any] | None = None

    def refusal(self) -> tuple[str, str] | None:
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            return "thinking", "this gateway's models do no extended thinking"
        return first_refused(self.model_extra or {}, REFUSED_FIELDS)

    def chat_body(self) -> dict[str, Any]:
        """The chat completion's fields for this conversation (prompt, tools)."""
        body: dict[str, Any] = {"model": self.model, "messages": chat_messages(self.system, self.messages)}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.input_schema}} for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                                   else {"auto": "auto", "any": "required", "none": "none"}[choice.type])
            if choice.disable_parallel_tool_use and self.tools:
                body["parallel_tool_calls"] = False
        return body


class MessagesRequest(_Conversation):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: MessagesMetadata | None = None
    stream: bool = False
    #: Anthropic's capacity tiers; priority here comes from ``X-Sluice-Priority``.
    service_tier: Literal["auto", "standard_only"] | None = None
    #: ``format``: a JSON schema the answer follows (structured outputs).
    output_config: OutputConfig | None = None

    def to_chat(self) -> ChatCompletionRequest:
        """The chat completion this message is generated as."""
        body = {
            **self.chat_body(), "max_tokens": self.max_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k or None, "stop": self.stop_sequences, "stream": self.stream,
            "user": self.metadata.user_id if self.metadata else None,
        }
        fmt = self.output_config.format if self.output_config else None
        if fmt is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": fmt.json_schema}}
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})


class CountTokensRequest(_Conversation):
    def to_chat(self) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate(self.chat_body())


def _texts(blocks: list[dict[str, Any]], where: str) -> str:
    """Text blocks as one string; anything else refused by name."""
    texts = []
    for index, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise _unsupported(kind, f"{where}.{index}")
        texts.append(_text_of(block, f"{where}.{index}"))
    return "\n".join(texts)


def _text_of(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidRequest(f"{where}: a text block needs a string 'text'", param=where)
    return text


def _unsupported(kind: object, where: str) -> InvalidRequest:
    if kind in ("image", "document"):
        why = f"{kind} content blocks are not supported: this gateway's models take text only"
    elif kind in ("thinking", "redacted_thinking"):
        why = f"{kind} blocks are not supported: this gateway's models do no extended thinking"
    else:
        why = f"content blocks of type {kind!r} are not supported here"
    return InvalidRequest(f"{where}: {why}", param=where)


def _call_id(block: dict[str, Any], field: str, where: str) -> str:
    """A tool call's id as the block gives it: the string that pairs a tool_use with its
    tool_result (anything else would reach the chat template as some other id)."""
    value = block.get(field)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{where}: a {block.get('type')} block needs a string {field!r}", param=where)
    return value


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    content = block.get("content", "")
    if isinstance(content, list):
        content = _texts(content, f"{where}.content")
    elif not isinstance(content, str):
        raise InvalidRequest(f"{where}: content must be a string or text blocks", param=where)
    return {"role": "tool", "tool_call_id": _call_id(block, "tool_use_id", where), "content": content}


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    name, arguments = block.get("name"), block.get("input", {})
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        raise InvalidRequest(f"{where}: a tool_use block needs a name and an input object", param=where)
    return {"id": _call_id(block, "id", where), "type": "function",
            "function": {"name": name, "arguments": orjson.dumps(arguments).decode()}}


def chat_messages(system: str | list[dict[str, Any]] | None, messages: list[MessageParam]) -> list[dict[str, Any]]:
    """The conversation as chat messages. In a user turn, text and tool results keep their
    order (each tool result its own tool turn); an assistant turn's text and tool_use blocks
    become one assistant message with its tool calls."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": system if isinstance(system, str) else _texts(system, "system")})
    for i, message in enumerate(messages):
        where = f"messages.{i}.content"
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(message.content):
            kind = block.get("type")
            if kind == "text":
                texts.append(_text_of(block, f"{where}.{j}"))
            elif kind == "tool_use" and message.role == "assistant":
                calls.append(_tool_call(block, f"{where}.{j}"))
            elif kind == "tool_result" and message.role == "user":
                if texts:
                    out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                out.append(_tool_result(block, f"{where}.{j}"))
            elif kind in ("tool_use", "tool_result"):
                raise InvalidRequest(f"{where}.{j}: a {kind} block belongs in "
                                     f"{'an assistant' if kind == 'tool_use' else 'a user'} turn", param=where)
            else:
                raise _unsupported(kind, f"{where}.{j}")
        if message.role == "assistant":
            turn: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) or None}
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
        elif texts or not message.content:
            out.append({"role": "user", "content": "\n".join(texts)})
    if messages[-1].role == "assistant":
        # A chat template closes the assistant's turn and opens a new one: what a prefill
        # asks for (continue this very text) would silently not happen.
        raise InvalidRequest("messages: a final assistant turn (prefill) is not supported; end with a user turn",
                             param="messages")
    return out


def stop_reason(finish_reason: str | None, stop_sequence: str | None, called: bool) -> str:
    """Anthropic's reason; ``called``: the answer holds tool calls (a forced call ends with
    OpenAI's "stop", and is still Anthropic's "tool_use")."""
    if finish_reason == "length":
        return "max_tokens"
    if finish_reason == "tool_calls" or called:
        return "tool_use"
    return "stop_sequence" if stop_sequence else "end_turn"


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _tool_input(arguments: str) -> dict[str, Any]:
    """A whole tool call's arguments as ``input``: a JSON object, or the call is no answer."""
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise UpstreamFailed("the model's tool call arguments are not a JSON object", code="bad_tool_call")
    return value


def _tool_id(call_id: str) -> str:
    return call_id or "toolu_" + uuid.uuid4().hex


class MessageShape:
    """One message's identity, and how it is rendered."""

    kind: Literal["messages"] = "messages"

    def __init__(self, req: MessagesRequest | CountTokensRequest) -> None:
        self.id = "msg_" + uuid.uuid4().hex
        self.model = req.model

    def message(self, content: list[dict[str, Any]], reason: str | None, stop_sequence: str | None,
                usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": stop_sequence, "usage": usage}

    def events(self) -> MessageEvents:
        return MessageEvents(self)

    def json_body(self, text: str, finish_reason: str | None, stop_sequence: str | None,
                  calls: list[dict[str, Any]], usage: dict[str, Any]) -> bytes:
        content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
        content.extend({"type": "tool_use", "id": _tool_id(call["id"]), "name": call["function"]["name"],
                        "input": _tool_input(call["function"]["arguments"])} for call in calls)
        reason = stop_reason(finish_reason, stop_sequence, bool(calls))
        return orjson.dumps(self.message(content, reason, stop_sequence if reason == "stop_sequence" else None,
                                         _usage(usage)))


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


_TEXT_DELTA = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'


class MessageEvents:
    """Anthropic's streamed events, built as worker lines arrive.

    Content blocks are sequential: a text block opens on the first text, a tool_use block
    on a call's first delta, and opening one closes the block before it."""

    def __init__(self, shape: MessageShape) -> None:
        self._shape = shape
        self._blocks = 0  # blocks opened so far: the next one's index
        self._open: int | None = None  # the open block's index
        self._text_open = False
        self._tools: dict[int, int] = {}  # tool-call index -> its block's index
        self._assembler = ToolCallAssembler()
        self._finish: str | None = None
        self._stop_sequence: str | None = None

    def start(self) -> list[bytes]:
        usage = {"input_tokens": 0, "output_tokens": 0}
        return [_event("message_start", {"type": "message_start",
                                         "message": self._shape.message([], None, None, usage)}),
                _event("ping", {"type": "ping"})]

    def line(self, line: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        text = line.get("text", "")
        if text:
            if not self._text_open:
                self._begin({"type": "text", "text": ""}, out)
                self._text_open = True
            out.append(_TEXT_DELTA + str(self._open).encode() + b',"delta":{"type":"text_delta","text":'
                       + orjson.dumps(text) + b"}}\n\n")
        for delta in line.get("tc") or ():
            self._tool_delta(delta, out)
        if line.get("finish_reason"):
            self._finish = line["finish_reason"]
            self._stop_sequence = line.get("stop_sequence")
        return out

    def _begin(self, block: dict[str, Any], out: list[bytes]) -> int:
        self._close(out)
        index = self._open = self._blocks
        self._blocks += 1
        out.append(_event("content_block_start", {"type": "content_block_start", "index": index,
                                                  "content_block": block}))
        return index

    def _close(self, out: list[bytes]) -> None:
        if self._open is not None:
            out.append(_event("content_block_stop", {"type": "content_block_stop", "index": self._open}))
            self._open = None
            self._text_open = False

    def _tool_delta(self, delta: dict[str, Any], out: list[bytes]) -> None:
        self._assembler.add([delta])
        tool = int(delta["index"])
        block = self._tools.get(tool)
        if block is None:
            call = self._assembler.call(tool)
            block = self._tools[tool] = self._begin(
                {"type": "tool_use", "id": _tool_id(call["id"]), "name": call["function"]["name"], "input": {}}, out)
        arguments = (delta.get("function") or {}).get("arguments")
        if arguments:
            out.append(_event("content_block_delta", {"type": "content_block_delta", "index": block,
                                                      "delta": {"type": "input_json_delta",
                                                                "partial_json": arguments}}))

    def finish(self, usage: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        self._close(out)
        reason = stop_reason(self._finish, self._stop_sequence, bool(self._tools))
        delta = {"stop_reason": reason, "stop_sequence": self._stop_sequence if reason == "stop_sequence" else None}
        out.append(_event("message_delta", {"type": "message_delta", "delta": delta, "usage": _usage(usage)}))
        out.append(_event("message_stop", {"type": "message_stop"}))
        return out


# Errors ---------------------------------------------------------------------------------

#: Anthropic's error type for each of the gateway's (OpenAI) types; a status refines it.
_TYPES = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "rate_limit_error": "rate_limit_error",
    "service_unavailable": "overloaded_error",
    "timeout": "timeout_error",
    "server_error": "api_error",
}
_BY_STATUS = {403: "permission_error", 404: "not_found_error", 413: "request_too_large"}


def error_type(status: int, openai_type: str | None, code: str | None = None) -> str:
    if status in _BY_STATUS or code in ("model_not_found", "not_found"):
        return _BY_STATUS.get(status, "not_found_error")
    return _TYPES.get(openai_type or "", "api_error" if status >= 500 or status == 0 else "invalid_request_error")


def error_body(kind: str, message: str) -> bytes:
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


def error_response(exc: SluiceError, headers: dict[str, str] | None = None) -> Response:
    """The JSON rendering on these routes: the gateway's status, Anthropic's body, and
    ``Retry-After`` / ``x-ratelimit-*`` as on every route."""
    return Response(error_body(error_type(exc.status, exc.type, exc.code), exc.message), status_code=exc.status,
                    media_type="application/json", headers={**exc.headers(), **(headers or {})})


_ERROR_DATA = b'data: {"error":'


def _error_frame(frame: bytes) -> bytes:
    """An in-band error event in OpenAI's shape (from the relay or a stream's journal) as
    Anthropic's ``event: error``; its ``id:`` line, if any, is kept."""
    at = frame.index(_ERROR_DATA)
    err = orjson.loads(frame[at + len(b"data: "):])["error"]
    kind = error_type(0, err.get("type"), err.get("code"))
    return frame[:at] + b"event: error\ndata: " + error_body(kind, str(err.get("message") or "")) + b"\n\n"


async def anthropic_frames(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A Messages stream as the client gets it: the chat path's in-band errors rewritten,
    and without the ``[DONE]`` that marks a journaled stream's end (Anthropic's ends with
    ``message_stop``, or an error). Closing this closes ``events``."""
    async with contextlib.aclosing(events):  # type: ignore[type-var]
        async for frame in events:
            if frame == DONE:
                continue
            # An error is the only event of a Messages stream that is not ``event: ...``.
            if _ERROR_DATA in frame[:40]:
                frame = _error_frame(frame)
            yield frame


def credential(headers: Any) -> str | None:
    """The Sluice key as ``Authorization`` carries it: from ``x-api-key`` (what the
    Anthropic SDK sends) or ``Authorization: Bearer`` (its ``auth_token``)."""
    key = headers.get("x-api-key")
    return f"Bearer {key}" if key else headers.get("authorization")
