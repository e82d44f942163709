"""Structured output and tool calls, the engine-independent part.

What a request constrains decoding to (:func:`decoding_constraint`):

- ``tool_mode`` required: a JSON array of ``{"name", "parameters"}`` objects, one
  ``anyOf`` branch per tool (the shape vLLM's own server uses for required tool calls);
  at most one item when ``parallel_tool_calls`` is false;
- ``tool_mode`` ``{"name": N}``: the arguments object of function N;
- otherwise ``response_format``'s constraint, if any.

:class:`ForcedCalls` turns such constrained output into OpenAI tool-call deltas: a
named call streams its arguments as they are generated; a required call's array is
read once it is complete. ``auto`` needs a model-specific parser: the vLLM engine
uses vLLM's (``engine_worker/engines/vllm_tools.py``).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from engine_worker.protocol import GenerateRequest

EMPTY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


def _parameters(request: GenerateRequest, name: str) -> dict[str, Any]:
    for tool in request.tools or ():
        function = tool.get("function") or {}
        if function.get("name") == name:
            return function.get("parameters") or EMPTY_OBJECT
    raise KeyError(name)


def forced_schema(request: GenerateRequest) -> dict[str, Any] | None:
    """The JSON schema of a forced (required or named) tool call, or None."""
    mode = request.tool_mode
    if isinstance(mode, dict):
        return _parameters(request, mode["name"])
    if mode != "required":
        return None
    branches = []
    for tool in request.tools or ():
        function = tool["function"]
        branches.append({
            "properties": {
                "name": {"type": "string", "enum": [function["name"]]},
                "parameters": function.get("parameters") or EMPTY_OBJECT,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
    if not request.parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def decoding_constraint(request: GenerateRequest) -> dict[str, Any] | None:
    """``{"json": schema}`` / ``{"json_object": True}`` / None; a forced tool call wins
    over ``response_format`` (the answer is the call, not a message)."""
    schema = forced_schema(request)
    if schema is not None:
        return {"json": schema}
    return request.structured


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ForcedCalls:
    """Constrained output of a forced tool call, as tool-call deltas.

    >>> calls = ForcedCalls({"name": "f"})
    >>> calls.feed('{"x": 1}')[0]["function"]
    {'name': 'f', 'arguments': '{"x": 1}'}
    """

    def __init__(self, mode: str | dict[str, str]) -> None:
        self._named = mode["name"] if isinstance(mode, dict) else None
        self._text = ""
        self._opened = False

    @property
    def finish_reason(self) -> str:
        # OpenAI's convention, which vLLM's server follows: "stop" for a named function.
        return "stop" if self._named else "tool_calls"

    def step(self, text: str, ids: list[int], finish: str | None) -> tuple[str, list[dict[str, Any]] | None, str | None]:
        """One engine step: (content, tool-call deltas, finish reason). Output cut short by
        ``max_tokens`` before a required call's array closed comes back as text."""
        calls = self.feed(text)
        content = ""
        if finish is not None:
            calls += self.finish()
            if finish == "stop":
                finish = self.finish_reason
            elif not calls:
                content = self.leftover_text()
        return content, calls or None, finish

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Deltas for newly generated text: a named call's arguments stream as they come."""
        self._text += text
        if self._named is None:
            return []
        if not self._opened:
            self._opened = True
            return [{"index": 0, "id": call_id(), "type": "function",
                     "function": {"name": self._named, "arguments": text}}]
        return [{"index": 0, "function": {"arguments": text}}] if text else []

    def finish(self) -> list[dict[str, Any]]:
        """A required call's deltas once its array is complete (nothing for a named call:
        it has streamed). Output that is not the constrained JSON (cut by ``max_tokens``)
        gives no calls."""
        if self._named is not None:
            return [] if self._opened else self.feed("")
        try:
            items = json.loads(self._text)
        except json.JSONDecodeError:
            return []
        return [
            {"index": i, "id": call_id(), "type": "function",
             "function": {"name": item["name"], "arguments": json.dumps(item["parameters"], ensure_ascii=False)}}
            for i, item in enumerate(items)
            if isinstance(item, dict) and "name" in item and "parameters" in item
        ]

    def leftover_text(self) -> str:
        """Text a required call could not turn into calls (the client gets it as content)."""
        return self._text if self._named is None else ""
