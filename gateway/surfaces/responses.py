"""The Responses API (``POST /v1/responses``) on top of chat completions.

A Responses request becomes a :class:`ChatCompletionRequest` (instructions → system
message, input items → messages, flat function tools → chat tools, ``text.format`` →
``response_format``), so admission, priority, deadlines, rate limits, tracing,
tools and structured outputs are the chat path's. Only the rendering differs:
one ``response`` object, or the typed SSE events ``client.responses.create`` and
``client.responses.stream`` consume. Nothing is stored: ``previous_response_id``
and ``store: true`` are refused.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.surfaces.openai import (ChatCompletionRequest, ModelName, PiecedText, ToolCallAssembler, UserId,
                                     first_refused)
from sluice.errors import InvalidRequest

#: Fields that change what a Responses request means and that this gateway cannot honour.
REFUSED_FIELDS = {
    "previous_response_id": "responses are not stored; send the whole conversation as input",
    "conversation": "conversations are not stored; send the whole conversation as input",
    "background": "background responses are not supported",
    "prompt": "stored prompt templates are not supported",
    "reasoning": "this gateway's models do no reasoning",
    "include": "no extra output data (reasoning, logprobs, sources) is available",
    "max_tool_calls": "max_tool_calls is not supported",
}


class ResponsesFunctionTool(BaseModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedChoice(BaseModel):
    type: Literal["function"]
    name: str


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: ModelName
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    tools: list[ResponsesFunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedChoice | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_output_tokens: int | None = Field(default=None, ge=1)
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    #: Echoed in the response only; bounded as OpenAI bounds it (16 pairs, keys of 64
    #: characters, values of 512).
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = \
        Field(default=None, max_length=16)
    user: UserId | None = None
    #: A session for routing (gateway/admission/affinity.py), as on chat completions.
    prompt_cache_key: UserId | None = None
    service_tier: str | None = None
    #: Lower runs first; as on chat completions.
    priority: int | None = None
    truncation: Literal["disabled"] | None = None

    @model_validator(mode="after")
    def _no_store(self) -> ResponsesRequest:
        if self.store:
            raise ValueError("store: responses are not stored here; send store: false")
        return self

    def refusal(self) -> tuple[str, str] | None:
        return first_refused(self.model_extra or {}, REFUSED_FIELDS)

    def to_chat(self) -> ChatCompletionRequest:
        """The chat completion this response is generated as (its validation errors name
        the chat field; the Responses names are kept where they are the same)."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        messages.extend(input_messages(self.input))
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream,
            "priority": self.priority, "service_tier": self.service_tier, "user": self.user,
            "prompt_cache_key": self.prompt_cache_key,
        }
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
            body["parallel_tool_calls"] = self.parallel_tool_calls
        if isinstance(self.tool_choice, ResponsesNamedChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            body["response_format"] = response_format(fmt)
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})


def response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    """``text.format`` (flat) as chat's ``response_format`` (nested under json_schema)."""
    if fmt.get("type") != "json_schema":
        return fmt
    schema = {k: fmt[k] for k in ("name", "schema", "description", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def _text(content: Any, index: int) -> str | list[dict[str, Any]]:
    """Input content: a string, or text parts (input_text / output_text); an image, a
    file or audio is refused by name, never dropped."""
    if isinstance(content, str):
        return content
    parts = []
    for part in content or ():
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise InvalidRequest(f"input[{index}]: content parts of type {kind!r} are not supported (text only)",
                                 param="input")
        parts.append({"type": "text", "text": part.get("text")})
    return parts


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages: messages, function calls (consecutive calls
    join one assistant turn), function call outputs (tool turns)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role", "user"), "content": _text(item.get("content"), index)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else orjson.dumps(output).decode()})
        else:
            raise InvalidRequest(f"input[{index}]: items of type {kind!r} are not supported", param="input")
    return messages


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def _message(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _function_call(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


class ResponseShape:
    """One response's identity and the request fields a ``response`` object echoes."""

    kind: Literal["responses"] = "responses"

    def events(self) -> ResponseEvents:
        return ResponseEvents(self)

    def json_body(self, text: str, finish_reason: str | None, stop_sequence: str | None,
                  calls: list[dict[str, Any]], usage: dict[str, Any]) -> bytes:
        return response_body(self, text, finish_reason, calls, usage)

    def __init__(self, req: ResponsesRequest) -> None:
        self.id = "resp_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self._req = req

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
             finish_reason: str | None = None) -> dict[str, Any]:
        req = self._req
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        text = req.text or {"format": {"type": "text"}}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": req.model, "output": output, "usage": None if usage is None else _usage(usage),
            "error": None, "incomplete_details": incomplete, "instructions": req.instructions,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "tool_choice": (req.tool_choice.model_dump() if isinstance(req.tool_choice, ResponsesNamedChoice)
                            else req.tool_choice or "auto"),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "text": text, "previous_response_id": None, "reasoning": None,
            "store": False, "truncation": "disabled", "user": req.user,
        }


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def response_body(shape: ResponseShape, text: str, finish_reason: str | None, calls: list[dict[str, Any]],
                  usage: dict[str, Any]) -> bytes:
    """The whole ``response`` object, for a non-streamed request."""
    output: list[dict[str, Any]] = []
    if text or not calls:
        output.append(_message("msg_" + uuid.uuid4().hex, text, "completed"))
    output.extend(_function_call("fc_" + uuid.uuid4().hex, call, "completed") for call in calls)
    return orjson.dumps(shape.body(status_of(finish_reason), output, usage))


class ResponseEvents:
    """The typed SSE events of a streamed response, built as worker lines arrive.

    Output items open when their first piece arrives (a message on its first text,
    a function call on its first delta) and all close, in order, at the end.
    """

    def __init__(self, shape: ResponseShape) -> None:
        self._shape = shape
        self._seq = 0
        self._items: list[dict[str, Any]] = []  # output items, in output_index order
        self._message: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its item
        self._assembler = ToolCallAssembler()
        self._finish: str | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def start(self) -> list[bytes]:
        body = self._shape.body("in_progress", [], None)
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def line(self, line: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        text = line.get("text", "")
        if text:
            message = self._open_message(out)
            message["text"].add(text)
            out.append(self._event("response.output_text.delta", item_id=message["id"],
                                   output_index=message["index"], content_index=0, delta=text, logprobs=[]))
        for delta in line.get("tc") or ():
            self._tool_delta(delta, out)
        self._finish = line.get("finish_reason") or self._finish
        return out

    def _open_message(self, out: list[bytes]) -> dict[str, Any]:
        """The message item, announced (item and its text part) on first use."""
        if self._message is None:
            self._message = {"id": "msg_" + uuid.uuid4().hex, "text": PiecedText(), "index": len(self._items)}
            self._items.append(self._message)
            out.append(self._event("response.output_item.added", output_index=self._message["index"],
                                   item=_message(self._message["id"], "", "in_progress")))
            out.append(self._event("response.content_part.added", item_id=self._message["id"],
                                   output_index=self._message["index"], content_index=0,
                                   part={"type": "output_text", "text": "", "annotations": []}))
        return self._message

    def _tool_delta(self, delta: dict[str, Any], out: list[bytes]) -> None:
        """One tool-call delta: a new function_call item on its first, then its arguments."""
        self._assembler.add([delta])
        tool = int(delta["index"])
        item = self._calls.get(tool)
        if item is None:
            item = self._calls[tool] = {"id": "fc_" + uuid.uuid4().hex, "index": len(self._items), "tool": tool}
            self._items.append(item)
            call = self._assembler.call(tool)
            opened = {**call, "function": {**call["function"], "arguments": ""}}
            out.append(self._event("response.output_item.added", output_index=item["index"],
                                   item=_function_call(item["id"], opened, "in_progress")))
        arguments = (delta.get("function") or {}).get("arguments")
        if arguments:
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=item["index"], delta=arguments))

    def finish(self, usage: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if not self._items:
            self._open_message(out)  # an empty answer is still one (empty) message, as unstreamed
        output: list[dict[str, Any]] = []
        for item in self._items:
            if item is self._message:
                text = item["text"].value()
                done = _message(item["id"], text, "completed")
                part = done["content"][0]
                out.append(self._event("response.output_text.done", item_id=item["id"], output_index=item["index"],
                                       content_index=0, text=text, logprobs=[]))
                out.append(self._event("response.content_part.done", item_id=item["id"],
                                       output_index=item["index"], content_index=0, part=part))
            else:
                done = _function_call(item["id"], self._assembler.call(item["tool"]), "completed")
                out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                       output_index=item["index"], name=done["name"], arguments=done["arguments"]))
            out.append(self._event("response.output_item.done", output_index=item["index"], item=done))
            output.append(done)
        status = status_of(self._finish)
        body = self._shape.body(status, output, usage)
        out.append(self._event("response.completed" if status == "completed" else "response.incomplete",
                               response=body))
        return out
