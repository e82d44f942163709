"""Redis at its ``maxmemory`` with ``noeviction`` (what the README asks for): it answers, and
refuses every write with ``OOM command not allowed``. Requests get a 503 that says so (not
"unreachable"), a resumable stream holds its events until they are journaled and goes on
once Redis takes writes again, and the gateway's log says it once per few seconds, not
once per request or per journal write (a stream logged every 50 ms, 60 lines in 3 s).

Against a private Redis: ``CONFIG SET maxmemory`` below what it holds makes it full at once."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import redis

from sluice.embedded_redis import EmbeddedRedis

MODEL = "full"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def _log_lines(proc, text: str) -> list[str]:
    return [line for line in proc.log_path.read_text().splitlines() if text in line]


def test_a_full_redis_is_a_503_that_says_so_and_a_resumable_stream_waits_it_out(start_worker, start_gateway) -> None:
    with EmbeddedRedis(args=["--maxmemory-policy", "noeviction"]) as server:
        start_worker(MODEL, redis_at=server.url, sim_token_ms=50, sim_ttft_ms=0)
        gateway = start_gateway(redis_at=server.url)
        admin = redis.Redis.from_url(server.url)
        sdk = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
        events: list[tuple[float, str]] = []
        full_for = None
        with httpx.stream("POST", gateway.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 60, "stream": True},
                          headers={"Idempotency-Key": "through-a-full-redis"}, timeout=60) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("id: "):
                    events.append((time.monotonic(), line[4:]))
                if len(events) == 10 and full_for is None:
                    admin.config_set("maxmemory", "100kb")  # below what it holds: every write refused
                    full_for = time.monotonic()
                    for _ in range(20):  # every request meanwhile: a 503 that names the cause
                        with pytest.raises(openai.APIStatusError) as refused:
                            sdk.chat.completions.create(**CHAT, max_tokens=2)
                        assert refused.value.status_code == 503
                        assert "full" in refused.value.message and refused.value.response.headers["retry-after"]
                    time.sleep(max(0.0, 2.5 - (time.monotonic() - full_for)))
                    admin.config_set("maxmemory", "0")
                    freed_at = time.monotonic()
        assert full_for is not None
        numbers = [int(event_id.partition(".")[0]) for _, event_id in events]
        assert numbers == list(range(1, 61))  # every event once, in order
        # None of them reached the client while Redis refused to journal it.
        assert not [n for (at, _), n in zip(events, numbers) if n > 11 and full_for + 0.2 < at < freed_at]
        with httpx.stream("GET", gateway.url + "/v1/streams/through-a-full-redis",
                          headers={"Last-Event-ID": events[-1][1]}, timeout=30) as resp:
            assert resp.status_code == 200 and list(resp.iter_lines())[0] == "data: [DONE]"
        # The worker's heartbeat lapsed while Redis refused it; its next beat (within 0.2 s)
        # makes it live again, so a request sent at once may be told to retry: the SDK does.
        assert sdk.with_options(max_retries=3).chat.completions.create(**CHAT, max_tokens=2).choices[0].message.content
        refusals = _log_lines(gateway, "Redis refuses writes: it is at its maxmemory")
        assert 2 <= len(refusals) <= 4, refusals  # the requests' line and the journal's; was 20 + ~50
        admin.close()


def test_a_stream_that_cannot_migrate_while_redis_is_full_is_told_so(start_worker, start_gateway) -> None:
    """A stream whose worker dies while Redis refuses writes waits to migrate (a new slot is a
    write), then ends with an error that names the fault: it said "the gateway's state store
    is unreachable" whatever the fault, sending an operator to the network."""
    with EmbeddedRedis(args=["--maxmemory-policy", "noeviction"]) as server:
        worker = start_worker(MODEL, redis_at=server.url, sim_token_ms=50, sim_ttft_ms=0)
        gateway = start_gateway(redis_at=server.url, env={"SLUICE_GATEWAY_MIGRATION_WAIT_S": "1"})
        admin = redis.Redis.from_url(server.url)
        lines: list[str] = []
        try:
            with httpx.stream("POST", gateway.url + "/v1/chat/completions",
                              json={**CHAT, "max_tokens": 200, "stream": True}, timeout=60) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    lines.append(line)
                    if len(lines) == 10:
                        admin.config_set("maxmemory", "100kb")  # below what it holds: every write refused
                        worker.kill()
        finally:
            admin.config_set("maxmemory", "0")
            admin.close()
        errors = [line for line in lines if line.startswith('data: {"error"')]
        assert len(errors) == 1, lines[-3:]
        assert "could not migrate" in errors[0] and "state store is full" in errors[0], errors[0]
