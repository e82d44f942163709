"""Deadlines once a stream runs: a silent worker is left for another, and the request's own
deadline ends the stream with one in-band error (gateway/relay/upstream.py's stall watch)."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import orjson

from tests.conftest import streaming, wait_for


def test_a_worker_that_goes_silent_mid_stream_is_left_for_another(start_worker, start_gateway) -> None:
    model = "silent"
    workers = [start_worker(model, sim_token_ms=20), start_worker(model, sim_token_ms=20)]
    gateway = start_gateway(env={"SLUICE_GATEWAY_STALL_TIMEOUT_S": "1"})
    # 3 s of stream (no early end of sequence): the victim is still streaming once the test
    # has found it and stopped it, on a loaded machine too (at 1.2 s it could finish first).
    body = {"model": model, "prompt": "go quiet", "max_tokens": 150, "seed": 5, "temperature": 0,
            "extra_body": {"ignore_eos": True}}
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=15) as client:
        reference = client.completions.create(**body).choices[0].text
        stream = iter(client.completions.create(**body, stream=True))
        texts = [next(stream).choices[0].text for _ in range(5)]
        wait_for(lambda: any(streaming(w) == 1 for w in workers), 2, "the stream's worker")
        victim = next(w for w in workers if streaming(w) == 1)
        os.killpg(victim.pid, signal.SIGSTOP)  # alive, connected, silent
        try:
            stopped = time.monotonic()
            texts += [chunk.choices[0].text for chunk in stream if chunk.choices]
            waited = time.monotonic() - stopped
        finally:
            os.killpg(victim.pid, signal.SIGCONT)
    assert "".join(texts) == reference  # continued on the other worker, token-exact
    assert 1.0 <= waited < 20, waited  # after the stall timeout, not the worker's heartbeat


def test_the_request_deadline_ends_a_running_stream_with_one_in_band_error(start_worker, start_gateway) -> None:
    start_worker("deadline", sim_token_ms=100, sim_ttft_ms=0)
    gateway = start_gateway()
    body = {"model": "deadline", "prompt": "slow", "max_tokens": 200, "ignore_eos": True, "stream": True}
    started = time.monotonic()
    with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=30,
                      headers={"X-Sluice-Timeout-Ms": "1500"}) as resp:
        assert resp.status_code == 200
        raw = resp.read().decode()
    elapsed = time.monotonic() - started
    data = [e.removeprefix("data: ") for e in raw.split("\n\n") if e.startswith("data: ")]
    assert data[-1] == "[DONE]"
    error = orjson.loads(data[-2])["error"]
    assert error["code"] == "request_timeout", error
    tokens = [orjson.loads(d) for d in data[:-2]]
    assert 3 <= len(tokens) < 30 and all(t["choices"][0]["finish_reason"] is None for t in tokens)
    assert 1.5 <= elapsed < 8, elapsed
