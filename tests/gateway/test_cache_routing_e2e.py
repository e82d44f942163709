"""Cache routing end to end: sim workers with prefix caches behind a gateway, the real
``openai`` SDK: shared system prompts come back cached, the router's expectation matches
what the engines report (accuracy), and it all shows in /metrics and the access log."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import redis

from sluice import keys
from sluice.prefix import BLOCK_TOKENS
from tests.conftest import wait_for


def _metric(text: str, name: str, model: str) -> float:
    match = re.search(rf'^{name}{{model="{model}"}} ([0-9.e+]+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_shared_system_prompts_hit_the_cache_and_the_router_knew(
    start_worker, start_gateway, redis_client: redis.Redis,
) -> None:
    model = "prefix-e2e"
    for _ in range(3):
        start_worker(model, sim_prefill_ms_per_token=0.01)
    gateway = start_gateway(env={"SLUICE_GATEWAY_ROUTING": "cache"})
    systems = [" ".join(f"s{k}w{i}" for i in range(3 * BLOCK_TOKENS)) for k in range(3)]
    cached: list[int] = []
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as client:
        for round_ in range(4):
            for k, system in enumerate(systems):
                resp = client.chat.completions.create(
                    model=model, max_tokens=2,
                    messages=[{"role": "system", "content": system}, {"role": "user", "content": f"q{round_}-{k}"}])
                assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
                cached.append(resp.usage.prompt_tokens_details.cached_tokens or 0)
    # "<|system|>" + 192 words: three full shared blocks, cached from the second round on.
    assert cached[:3] == [0, 0, 0]
    assert cached[3:] == [3 * BLOCK_TOKENS] * 9
    metrics = httpx.get(gateway.url + "/metrics").text
    assert _metric(metrics, "sluice_gateway_prefix_expected_tokens_total", model) == 9 * 3 * BLOCK_TOKENS
    assert _metric(metrics, "sluice_gateway_prefix_error_tokens_total", model) == 0
    assert _metric(metrics, "sluice_gateway_cached_tokens_total", model) == 9 * 3 * BLOCK_TOKENS
    log = gateway.log_tail(400)
    assert f"route_matched_blocks=3 route_prompt_blocks=3 route_expected_cached={3 * BLOCK_TOKENS}" in log
    # Every request's pending prefill was given back (at its first token or its release).
    for _ in range(100):
        if not redis_client.hgetall(keys.prefill(model)):
            break
        time.sleep(0.05)
    assert redis_client.hgetall(keys.prefill(model)) == {}
    assert redis_client.hgetall(keys.admission(model).lease_prefill) == {}


async def test_cache_routing_balances_workers_of_different_capacity(
    start_worker, start_gateway, redis_client: redis.Redis,
) -> None:
    """Regression: with no shared prefix, cache routing counted load in requests and filled
    a cap-8 worker to 100% while a cap-64 worker sat at 12%. 24 streams now leave both
    at about the same share of their slots."""
    model = "capacity-mix"
    small = start_worker(model, sim_max_seqs=8, sim_token_ms=20, sim_ttft_ms=0)
    big = start_worker(model, sim_max_seqs=64, sim_token_ms=20, sim_ttft_ms=0)
    gateway = start_gateway(env={"SLUICE_GATEWAY_ROUTING": "cache"})

    def inflight() -> dict[str, int]:
        return {k.decode(): int(v) for k, v in redis_client.hgetall(keys.inflight(model)).items()}

    async def stream(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": model, "prompt": f"question {i}", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            async for _ in resp.aiter_lines():
                pass

    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
        streams = [asyncio.create_task(stream(client, i)) for i in range(24)]
        try:
            await asyncio.to_thread(wait_for, lambda: sum(inflight().values()) == 24, 20, "24 streams")
            used = inflight()
        finally:
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
    on_small, on_big = used.get(small.name, 0), used.get(big.name, 0)
    assert on_small / 8 <= on_big / 64 + 1 / 8, f"small worker {on_small}/8, big worker {on_big}/64"
