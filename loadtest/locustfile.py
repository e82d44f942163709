"""Streaming load against a Sluice gateway (or any OpenAI-compatible server).

    locust -f loadtest/locustfile.py --headless -u 50 -r 10 -t 60s --host http://127.0.0.1:8000

Besides the request itself, every stream reports two extra locust events:
``ttft`` (time to first token, ms) and ``tokens`` (completion tokens, as the
"response time" column, so its average is tokens per request).
Environment: SLUICE_LOAD_MODEL (default sim), SLUICE_LOAD_MAX_TOKENS (default 64),
SLUICE_LOAD_TOOL_SHARE (default 0: the share of requests that force a tool call,
``tool_choice: "required"``, reported as "chat tools stream"; the simulator answers
them with a schema-valid call).
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import between, task
from locust.contrib.fasthttp import FastHttpUser

MODEL = os.environ.get("SLUICE_LOAD_MODEL", "sim")
MAX_TOKENS = int(os.environ.get("SLUICE_LOAD_MAX_TOKENS", "64"))
TOOL_SHARE = float(os.environ.get("SLUICE_LOAD_TOOL_SHARE", "0"))
TOOLS = [{"type": "function", "function": {"name": "lookup_river", "parameters": {
    "type": "object", "properties": {"river": {"type": "string"}, "year": {"type": "integer"}},
    "required": ["river", "year"]}}}]


class StreamingChatUser(FastHttpUser):
    wait_time = between(0.0, 0.2)

    @task
    def stream_chat(self) -> None:
        body = {
            "model": MODEL,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": f"Write about rivers #{time.monotonic_ns() % 997}"}],
        }
        name = "chat stream"
        if TOOL_SHARE and random.random() < TOOL_SHARE:
            body.update(tools=TOOLS, tool_choice="required")
            name = "chat tools stream"
        started = time.perf_counter()
        first_token_ms: float | None = None
        tokens = 0
        with self.client.post(
            "/v1/chat/completions", json=body, stream=True, catch_response=True, name=name
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"status {resp.status_code}")
                return
            # Line by line: FastResponse.stream and iter_content wait for whole
            # blocks, which would hide the real time to first token.
            raw = resp._response
            while line := raw.readline(b"\n"):
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    resp.failure(data["error"].get("message", "in-band error"))
                    return
                if data.get("choices") and first_token_ms is None:
                    first_token_ms = (time.perf_counter() - started) * 1000
                if data.get("usage"):
                    tokens = data["usage"]["completion_tokens"]
            resp.success()
        if first_token_ms is not None:
            self.environment.events.request.fire(
                request_type="SSE", name="ttft", response_time=first_token_ms,
                response_length=0, exception=None, context={},
            )
        self.environment.events.request.fire(
            request_type="SSE", name="tokens", response_time=tokens,
            response_length=tokens, exception=None, context={},
        )
