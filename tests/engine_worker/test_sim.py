"""The simulator engine: deterministic, resumable, honours stop and max_tokens."""

from __future__ import annotations

from engine_worker.engines.sim import SimEngine
from engine_worker.protocol import Delta, GenerateRequest


async def _run(engine: SimEngine, **fields: object) -> list[Delta]:
    request = GenerateRequest(request_id="r", model="sim", **fields)  # type: ignore[arg-type]
    return [d async for d in engine.generate(request)]


async def _engine() -> SimEngine:
    engine = SimEngine(ttft_ms=0, token_ms=0, max_seqs=4)
    await engine.start()
    return engine


async def test_same_prompt_same_tokens_and_seed_changes_them() -> None:
    engine = await _engine()
    try:
        a = await _run(engine, prompt="hello", max_tokens=20)
        b = await _run(engine, prompt="hello", max_tokens=20)
        c = await _run(engine, prompt="hello", max_tokens=20, seed=1)
    finally:
        await engine.shutdown()
    ids = lambda ds: [i for d in ds for i in d.token_ids]  # noqa: E731
    assert ids(a) == ids(b) and ids(a) != ids(c)
    assert a[-1].finish_reason == "length" and a[-1].usage is not None
    assert a[-1].usage.completion_tokens == 20


async def test_resume_continues_token_for_token() -> None:
    engine = await _engine()
    try:
        full = await _run(engine, prompt="resume me", max_tokens=30)
        ids = [i for d in full for i in d.token_ids]
        rest = await _run(engine, prompt="resume me", max_tokens=20, resume_token_ids=ids[:10])
    finally:
        await engine.shutdown()
    assert [i for d in rest for i in d.token_ids] == ids[10:]
    assert "".join(d.text for d in full[:10]) + "".join(d.text for d in rest) == "".join(
        d.text for d in full
    )


async def test_natural_end_is_stop() -> None:
    engine = await _engine()
    try:
        deltas = await _run(engine, prompt="no limit")
    finally:
        await engine.shutdown()
    assert deltas[-1].finish_reason == "stop"
    assert 32 <= len(deltas) < 256


async def test_closing_the_stream_aborts_and_frees_the_slot() -> None:
    engine = SimEngine(ttft_ms=0, token_ms=5, max_seqs=2)
    await engine.start()
    try:
        request = GenerateRequest(request_id="r", model="sim", prompt="long", max_tokens=200)
        stream = engine.generate(request)
        await anext(stream)
        assert engine.stats().running == 1
        await stream.aclose()  # type: ignore[attr-defined]
        assert engine.stats().running == 0
        assert engine.aborted == 1
    finally:
        await engine.shutdown()


async def test_max_seqs_queues_the_rest() -> None:
    engine = SimEngine(ttft_ms=0, token_ms=2, max_seqs=2)
    await engine.start()
    try:
        streams = [
            engine.generate(GenerateRequest(request_id=str(i), model="sim", prompt=str(i), max_tokens=50))
            for i in range(3)
        ]
        for s in streams[:2]:
            await anext(s)
        stats = engine.stats()
        assert stats.running == 2
        for s in streams:
            await s.aclose()  # type: ignore[attr-defined]
    finally:
        await engine.shutdown()


async def test_ignore_eos_runs_to_max_tokens() -> None:
    engine = await _engine()
    try:
        deltas = await _run(engine, prompt="no limit", max_tokens=400, ignore_eos=True)
    finally:
        await engine.shutdown()
    assert len(deltas) == 400 and deltas[-1].finish_reason == "length"
