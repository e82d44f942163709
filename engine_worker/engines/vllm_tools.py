"""``tool_choice: auto`` on the vLLM engine: vLLM's own tool-call parsers, chosen per worker.

A model writes tool calls in its own syntax (Hermes ``<tool_call>{...}</tool_call>``,
Llama's JSON, Mistral's ``[TOOL_CALLS]``...); the worker's ``--tool-call-parser``
names the vLLM parser for it (``vllm.tool_parsers.ToolParserManager``). Each request
gets a fresh parser (they keep streaming state), fed every delta as vLLM's own server
feeds it, so content streams as text and calls stream as OpenAI tool-call deltas.
"""

from __future__ import annotations

from typing import Any

from engine_worker.engines.vllm_compat import vllm_api
from engine_worker.protocol import GenerateRequest
from sluice.errors import InvalidRequest


def check_parser(name: str) -> None:
    """Fail at start-up, not at the first request, on a parser vLLM does not know."""
    manager = vllm_api().ToolParserManager
    try:
        manager.get_tool_parser(name)
    except KeyError:
        known = ", ".join(sorted(manager.list_registered()))
        raise ValueError(f"unknown tool-call parser {name!r}; vLLM knows: {known}") from None


class AutoToolCalls:
    """One request's streaming tool-call extraction with a vLLM parser."""

    def __init__(self, parser_name: str | None, tokenizer: Any, request: GenerateRequest) -> None:
        if parser_name is None:
            raise InvalidRequest(
                "tool_choice 'auto' needs a tool-call parser for this model, and this worker has none "
                "(start it with --tool-call-parser NAME); tool_choice 'required', a named function or "
                "'none' work without one", param="tool_choice")
        vllm = vllm_api()
        # Parsers read the tools (names, schemas) from vLLM's own request object.
        self._request = vllm.ChatCompletionRequest.model_validate({
            "messages": [{"role": "user", "content": ""}], "tools": request.tools, "tool_choice": "auto",
            "parallel_tool_calls": request.parallel_tool_calls,
        })
        tools: Any = self._request.tools
        self._parser = vllm.ToolParserManager.get_tool_parser(parser_name)(tokenizer, tools)
        self._parallel = request.parallel_tool_calls
        self._text = ""
        self._ids: list[int] = []
        self.called = False

    def step(self, text: str, ids: list[int], finish: str | None) -> tuple[str, list[dict[str, Any]] | None, str | None]:
        """One engine step: (content, tool-call deltas, finish reason: ``tool_calls`` once a
        call was made)."""
        content, calls = self.feed(text, ids)
        if finish is not None:
            calls += self.finish()
            if self.called and finish == "stop":
                finish = "tool_calls"
        return content, calls or None, finish

    def feed(self, text: str, ids: list[int]) -> tuple[str, list[dict[str, Any]]]:
        """(content, tool-call deltas) for one engine step."""
        previous_text, previous_ids = self._text, self._ids
        self._text, self._ids = previous_text + text, previous_ids + ids
        message = self._parser.extract_tool_calls_streaming(
            previous_text, self._text, text, previous_ids, self._ids, ids, self._request
        )
        if message is None:
            return "", []
        calls = [
            call.model_dump(exclude_none=True)
            for call in message.tool_calls
            if self._parallel or call.index == 0  # parallel_tool_calls: false keeps the first call
        ]
        self.called = self.called or bool(calls)
        return message.content or "", calls

    def finish(self) -> list[dict[str, Any]]:
        """Arguments the parser recognised but had not streamed yet (as vLLM's server sends them)."""
        remaining = self._parser.get_remaining_unstreamed_args() if self.called else ""
        index = len(self._parser.prev_tool_call_arr) - 1
        if not remaining or (index > 0 and not self._parallel):
            return []
        return [{"index": index, "function": {"arguments": remaining}}]
