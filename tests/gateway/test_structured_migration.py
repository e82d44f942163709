"""Migration under a grammar: a stream of constrained JSON (response_format, a forced tool
call) whose worker dies mid-stream ends with one clean in-band error, never with JSON
spliced from two grammars; the same stream without a grammar migrates and completes."""

from __future__ import annotations

import httpx
import orjson
import pytest

LONG = {"type": "object", "properties": {"story": {"type": "string", "minLength": 1200}}, "required": ["story"]}
MESSAGES = [{"role": "user", "content": "Tell me a long story."}]


def _stream_killing_the_worker(gateway_url: str, body: dict, kill) -> tuple[str, list[dict], bool]:
    """Stream ``body``; after three content chunks, ``kill()``. Returns (content, errors, done)."""
    text, errors, done, chunks = "", [], False, 0
    with httpx.stream("POST", gateway_url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            data = orjson.loads(line[6:])
            if "error" in data:
                errors.append(data["error"])
                continue
            delta = data["choices"][0]["delta"]
            text += delta.get("content") or ""
            for call in delta.get("tool_calls") or ():
                text += call["function"].get("arguments") or ""
            chunks += 1
            if chunks == 3:
                kill()
    return text, errors, done


@pytest.mark.parametrize("constraint", ["response_format", "named_tool", "none"])
def test_a_stream_under_a_grammar_does_not_migrate(start_worker, start_gateway, constraint: str) -> None:
    model = f"grammar-migration-{constraint}"
    first = start_worker(model, sim_token_ms=40)
    gateway = start_gateway()
    body: dict = {"model": model, "messages": MESSAGES, "max_tokens": 400}
    if constraint == "response_format":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "story", "schema": LONG}}
    elif constraint == "named_tool":
        body["tools"] = [{"type": "function", "function": {"name": "tell", "parameters": LONG}}]
        body["tool_choice"] = {"type": "function", "function": {"name": "tell"}}
    else:
        body["ignore_eos"] = True
    started = []

    def replace_the_worker() -> None:
        # The stream runs on `first` (the only worker); a second one is where it could move
        # (a fast one: the rest of a migrated stream need not take another 15 s).
        started.append(start_worker(model, sim_token_ms=1))
        first.kill()

    try:
        text, errors, done = _stream_killing_the_worker(gateway.url, body, replace_the_worker)
    finally:
        for worker in started:
            worker.stop()
    assert done, "the stream always ends with [DONE]"
    if constraint == "none":
        assert errors == [] and len(text.split()) == 400  # migrated: nothing lost
        return
    (error,) = errors
    assert error["code"] == "worker_lost" and "cannot be resumed" in error["message"]
    assert text.startswith('{"story": "')  # what was sent before the loss is a prefix of one JSON value
