"""A streaming response as ``curl -N`` sees it."""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest


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


def test_quiet_stream_gets_keepalive_comments_and_still_ends_whole(start_worker, start_gateway) -> None:
    """A stream that sends nothing for a while gets `: ping` comments (proxies close idle
    connections); the events around them are untouched."""
    start_worker("slow-sse", sim_ttft_ms=0, sim_token_ms=800)
    gateway = start_gateway(env={"SLUICE_GATEWAY_SSE_PING_S": "0.2"})
    body = {"model": "slow-sse", "stream": True, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=20) as resp:
        assert resp.status_code == 200
        raw = resp.read().decode()
    events = [e for e in raw.split("\n\n") if e.strip()]
    pings = [e for e in events if e.startswith(":")]
    data = [e.removeprefix("data: ") for e in events if e.startswith("data: ")]
    assert len(pings) + len(data) == len(events)
    # 1.6 s between the first token and the last, a ping at most every 0.2-0.4 s.
    assert len(pings) >= 3, raw
    assert data[-1] == "[DONE]"
    assert [orjson.loads(d)["choices"][0]["finish_reason"] for d in data[:-1]][-1] == "length"


@pytest.mark.parametrize("processes", [1, 3])
def test_a_gateway_stopped_with_sigterm_finishes_its_open_streams(start_worker, start_gateway, processes) -> None:
    """SIGTERM: uvicorn stops taking requests and waits (``shutdown_grace_s``) for the open
    streams, which end whole, not cut off. With several processes the supervisor passes the
    signal on once to each: a second SIGTERM is a child's force-exit (it was sent, and cut
    the streams of `docker stop`)."""
    start_worker("sigterm-sse", sim_ttft_ms=0, sim_token_ms=50)
    gateway = start_gateway(env={"SLUICE_GATEWAY_PROCS": str(processes)})
    body = {"model": "sigterm-sse", "prompt": "x", "max_tokens": 30, "ignore_eos": True, "stream": True}

    def rest_of_stream(first: threading.Barrier) -> list[str]:
        with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=20) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            first.wait(10)
            return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]

    streams = 2 * processes
    first = threading.Barrier(streams + 1)
    with ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(rest_of_stream, first) for _ in range(streams)]
        first.wait(10)
        gateway.process.send_signal(signal.SIGTERM)
        for future in futures:
            data = future.result(30)
            assert data[-1] == "[DONE]"
            assert orjson.loads(data[-2])["choices"][0]["finish_reason"] == "length"
            assert len(data) - 1 == 29  # every token after the first one
    assert gateway.process.wait(10) == 0
