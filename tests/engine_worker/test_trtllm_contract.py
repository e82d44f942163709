"""The TensorRT-LLM adapter against a stand-in of its documented LLM API.

This checks our mapping (arguments, cumulative-to-delta, abort, stats), not
TensorRT-LLM itself, which has never run on our machines.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from engine_worker.engines.trtllm_engine import TrtllmEngine
from engine_worker.protocol import GenerateRequest

STANDINS = str(Path(__file__).parent / "standins")


@pytest.fixture
async def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> TrtllmEngine:
    monkeypatch.syspath_prepend(STANDINS)
    for name in [m for m in sys.modules if m.startswith("tensorrt_llm")]:
        monkeypatch.delitem(sys.modules, name)
    eng = TrtllmEngine(tmp_path, max_batch_size=8, max_seq_len=64, kv_cache_fraction=0.5)
    await eng.start()
    yield eng
    await eng.shutdown()


async def test_llm_constructed_with_block_reuse_and_stats(engine: TrtllmEngine) -> None:
    kwargs = engine._llm.kwargs
    assert kwargs["kv_cache_config"].enable_block_reuse is True
    assert kwargs["kv_cache_config"].free_gpu_memory_fraction == 0.5
    assert kwargs["enable_iter_perf_stats"] is True
    assert kwargs["max_batch_size"] == 8 and kwargs["max_seq_len"] == 64
    assert engine.capacity == 8


async def test_cumulative_outputs_become_deltas(engine: TrtllmEngine) -> None:
    engine._llm.cached_tokens = 3
    request = GenerateRequest(request_id="r", model="m", prompt="a bb ccc", max_tokens=4, temperature=0)
    deltas = [d async for d in engine.generate(request)]
    sent = engine._llm.requests[-1]
    assert sent.prompt_token_ids == [1, 2, 3]
    assert sent.params.top_k == 1 and sent.params.max_tokens == 4  # greedy via top_k
    assert [d.token_ids for d in deltas] == [[103], [104], [105], [106]]
    assert "".join(d.text for d in deltas) == " t3 t4 t5 t6"
    assert deltas[-1].finish_reason == "length"
    assert deltas[-1].usage is not None
    assert (deltas[-1].usage.prompt_tokens, deltas[-1].usage.completion_tokens) == (3, 4)
    assert deltas[-1].usage.cached_tokens == 3


async def test_resume_appends_sent_tokens_to_prompt(engine: TrtllmEngine) -> None:
    request = GenerateRequest(
        request_id="r", model="m", messages=[{"role": "user", "content": "hey"}],
        max_tokens=2, resume_token_ids=[7, 8],
    )
    [d async for d in engine.generate(request)]
    assert engine._llm.requests[-1].prompt_token_ids == [1, 3, 2, 7, 8]


async def test_closing_the_stream_aborts(engine: TrtllmEngine) -> None:
    request = GenerateRequest(request_id="r", model="m", prompt="x", max_tokens=50)
    stream = engine.generate(request)
    await anext(stream)
    await stream.aclose()  # type: ignore[attr-defined]
    assert engine._llm.aborts == [engine._llm.requests[-1]]
    assert engine.aborted == 1


async def test_context_overflow_is_a_400(engine: TrtllmEngine) -> None:
    from sluice.errors import InvalidRequest

    request = GenerateRequest(request_id="r", model="m", prompt="x " * 70)
    with pytest.raises(InvalidRequest) as info:
        await anext(engine.generate(request))
    assert info.value.code == "context_length_exceeded"


async def test_iteration_stats_map_to_engine_stats(engine: TrtllmEngine) -> None:
    engine._apply_stats({
        "numActiveRequests": 5, "numQueuedRequests": 2,
        "kvCacheStats": {"maxNumBlocks": 100, "usedNumBlocks": 25, "reusedBlocks": 30, "missedBlocks": 10},
    })
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.kv_usage) == (5, 2, 0.25)
    assert (stats.prefix_hits, stats.prefix_queries) == (30, 40)
