"""The simulator's prefix cache: blocks of 64 words, an LRU of limited capacity, prefill
time that grows with the uncached tokens, cached_tokens in usage, and KV events named by
the gateway's block hashes."""

from __future__ import annotations

import time

from engine_worker.engines.prefix_cache import PrefixCache
from engine_worker.engines.sim import SimEngine
from engine_worker.protocol import Delta, GenerateRequest
from sluice.prefix import BLOCK_TOKENS, block_hashes, chat_text


def _words(tag: str, count: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(count))


async def _run(engine: SimEngine, prompt: str) -> tuple[list[Delta], float]:
    started = time.monotonic()
    request = GenerateRequest(request_id="r", model="sim", prompt=prompt, max_tokens=2)
    deltas = [d async for d in engine.generate(request)]
    return deltas, time.monotonic() - started


async def test_shared_prefix_is_cached_and_prefills_faster() -> None:
    # 3 ms a prefilled token: the cold prefill takes ~1.1 s and the warm ~0.1 s, so a pause of
    # the test process (a loaded machine) cannot turn one into the other (at 0.5 ms, ~70 ms could).
    engine = SimEngine(ttft_ms=0, token_ms=1, max_seqs=4, prefill_ms_per_token=3, prefill_chunk=4096,
                       cache_blocks=64)
    await engine.start()
    try:
        prefix = _words("p", 5 * BLOCK_TOKENS)
        first, cold_s = await _run(engine, prefix + " " + _words("a", 40))
        second, warm_s = await _run(engine, prefix + " " + _words("b", 40))
    finally:
        await engine.shutdown()
    assert first[-1].usage is not None and second[-1].usage is not None
    assert first[-1].usage.cached_tokens == 0
    assert second[-1].usage.cached_tokens == 5 * BLOCK_TOKENS  # the shared blocks, not the question's
    assert second[-1].usage.prompt_tokens == 5 * BLOCK_TOKENS + 40
    # 360 uncached tokens x 3 ms vs 40: the warm prefill is several times shorter.
    assert cold_s > 2 * warm_s


async def test_kv_events_name_the_gateways_block_hashes() -> None:
    engine = SimEngine(ttft_ms=0, token_ms=0, max_seqs=4, cache_blocks=64)
    await engine.start()
    try:
        messages = [{"role": "system", "content": _words("s", 64)}, {"role": "user", "content": "hi"}]
        request = GenerateRequest(request_id="r", model="sim", messages=messages, max_tokens=1)
        [d async for d in engine.generate(request)]
    finally:
        await engine.shutdown()
    events = engine.take_kv_events()
    assert events == [{"type": "stored", "block_hashes": block_hashes(chat_text(messages))}]
    assert engine.take_kv_events() == []


def test_lru_evicts_least_recently_used_blocks_and_reports_them() -> None:
    cache = PrefixCache(capacity_blocks=4)
    a, b = block_hashes(_words("a", 2 * BLOCK_TOKENS)), block_hashes(_words("b", 2 * BLOCK_TOKENS))
    cache.store(a)
    cache.store(b)
    assert cache.match(a) == 2  # a is now the most recent
    cache.take_events()
    cache.store(block_hashes(_words("c", 2 * BLOCK_TOKENS)))
    assert cache.match(b) == 0 and cache.match(a) == 2
    assert cache.take_events()[-1] == {"type": "removed", "block_hashes": b[::-1]}  # tail first


def test_a_prefix_is_evicted_from_its_end() -> None:
    """Regression: the head of a prompt was its least recently used block, so eviction
    took the head and left a tail no prompt could ever match."""
    cache = PrefixCache(capacity_blocks=4)
    a = block_hashes(_words("a", 3 * BLOCK_TOKENS))
    cache.store(a)
    cache.store(block_hashes(_words("b", 2 * BLOCK_TOKENS)))
    assert cache.match(a) == 2


def test_a_prefix_longer_than_the_cache_keeps_its_head() -> None:
    cache = PrefixCache(capacity_blocks=3)
    hashes = block_hashes(_words("x", 5 * BLOCK_TOKENS))
    cache.store(hashes)
    assert cache.match(hashes) == 3  # the first three blocks, usable as a prefix
