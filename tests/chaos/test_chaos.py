"""Chaos: many streams over several sim workers while workers are SIGKILLed and replaced.

Every request must end complete or with one clean in-band error, and every
completed stream must equal the simulator's deterministic reference token for
token. Prints the figures (run with ``-s`` to see them, or read the report line).
The full-size run (2,000 streams, 4 workers, >= 25 kills) is
``sluice bench --scenario resilience --resilience-phases chaos``.
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import threading
import time

import httpx
import orjson
import pytest

from sluice.commands.bench_resilience import TokenErrors, reference_words

pytestmark = pytest.mark.chaos

MODEL = "chaos"
REQUESTS = 300
CONCURRENCY = 24


async def _stream(client: httpx.AsyncClient, i: int) -> dict:
    tokens = 60 + (i * 37) % 80
    messages = [{"role": "user", "content": f"chaos request {i}"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": tokens, "seed": i,
            "ignore_eos": True, "stream": True}
    started = time.monotonic()
    text, errors, finish = "", 0, None
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers={"x-request-id": f"chaos-{i}"}) as resp:
        if resp.status_code != 200:
            return {"i": i, "status": resp.status_code, "ok": False, "duration": time.monotonic() - started}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = orjson.loads(line[6:])
            if "error" in data:
                errors += 1
                continue
            choice = data["choices"][0]
            text += choice["delta"].get("content") or ""
            finish = choice["finish_reason"] or finish
    reference = reference_words(messages, i, tokens)
    return {"i": i, "status": 200, "ok": errors == 0 and finish == "length", "errors": errors,
            "words": text.split(), "reference": reference, "duration": time.monotonic() - started}


def test_chaos_kills_lose_and_duplicate_nothing(start_worker, start_gateway) -> None:
    flags = {"sim_token_ms": 8, "sim_max_seqs": 16, "sim_ttft_ms": 5}
    workers = [start_worker(MODEL, **flags) for _ in range(3)]
    gateway = start_gateway(env={"SLUICE_GATEWAY_MAX_MIGRATIONS": "4", "SLUICE_GATEWAY_STALL_TIMEOUT_S": "3"})
    stop = threading.Event()
    kills = 0
    rng = random.Random(7)

    def chaos() -> None:
        nonlocal kills
        while not stop.wait(rng.uniform(0.4, 0.9)):
            victim = workers.pop(rng.randrange(len(workers)))
            victim.kill()
            kills += 1
            workers.append(start_worker(MODEL, **flags))

    async def load() -> list[dict]:
        limits = httpx.Limits(max_connections=CONCURRENCY + 4)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60, limits=limits) as client:
            sem = asyncio.Semaphore(CONCURRENCY)

            async def one(i: int) -> dict:
                async with sem:
                    return await _stream(client, i)

            return await asyncio.gather(*(one(i) for i in range(REQUESTS)))

    killer = threading.Thread(target=chaos, daemon=True)
    killer.start()
    try:
        results = asyncio.run(load())
    finally:
        stop.set()
        killer.join(30)

    tokens = TokenErrors()
    for r in results:
        if r["status"] == 200 and r["ok"]:
            tokens.add(r["reference"], r["words"])
    migrated = _migrations(gateway.log_path.read_text())
    completed = [r for r in results if r["status"] == 200 and r["ok"]]
    failed = len(results) - len(completed)
    plain = [r["duration"] for r in completed if migrated.get(f"chaos-{r['i']}", 0) == 0]
    moved = [r["duration"] for r in completed if migrated.get(f"chaos-{r['i']}", 0) > 0]
    extra_p99 = (
        sorted(moved)[int(0.99 * (len(moved) - 1))] - statistics.median(plain) if moved and plain else 0.0
    )
    print(
        f"\nCHAOS requests={len(results)} kills={kills} completed={len(completed)} failed={failed} "
        f"lost_tokens={tokens.lost} skipped_tokens={tokens.skipped} duplicated_tokens={tokens.duplicated} migrations={sum(migrated.values())} "
        f"migrated_requests={len(moved)} p99_extra_latency_migrated={extra_p99 * 1000:.0f}ms"
    )
    assert kills >= 3
    assert tokens.total == 0, tokens
    assert len(completed) >= 0.99 * len(results), [r for r in results if not r["ok"]][:3]
    assert sum(migrated.values()) > 0


def _migrations(log: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2))
            for m in re.finditer(r"request_id=(\S+) .*? migrations=(\d+)", log)}
