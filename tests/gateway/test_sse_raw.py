"""A streaming response as ``curl -N`` sees it."""

from __future__ import annotations

import httpx
import orjson


def test_raw_sse_lines(stack) -> None:
    body = {
        "model": "sim", "stream": True, "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}],
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", stack.url + "/v1/chat/completions", json=body, timeout=10) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["x-request-id"]
        raw = resp.read().decode()
    events = [e for e in raw.split("\n\n") if e.strip()]
    data_lines = []
    for event in events:
        lines = [ln for ln in event.split("\n") if not ln.startswith(":")]
        assert len(lines) == 1 and lines[0].startswith("data: "), event
        data_lines.append(lines[0].removeprefix("data: "))
    assert data_lines[-1] == "[DONE]"
    assert data_lines.count("[DONE]") == 1
    chunks = [orjson.loads(d) for d in data_lines[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
