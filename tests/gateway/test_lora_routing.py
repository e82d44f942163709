"""LoRA adapters on sim workers behind a gateway, through the real ``openai`` SDK: listing,
routing to holders, loading on another worker when every holder is busy (within its cap),
never on a worker without LoRA, and 404 for an adapter nobody registered."""

from __future__ import annotations

import asyncio

import httpx
import openai
import orjson
import pytest
import redis

from sluice import keys
from tests.conftest import wait_for
from tests.long_streams import busy_slots, hold

BASE = "lora-base"


@pytest.fixture(scope="module")
def fleet(start_worker, start_gateway):
    """Holder: holds ``sql`` (one slot); spare: LoRA on, room for one adapter; plain: no LoRA."""
    holder = start_worker(BASE, "--lora", "sql=/adapters/sql", sim_max_seqs=1, sim_ttft_ms=0, sim_token_ms=20)
    spare = start_worker(BASE, "--max-loras", "1", sim_max_seqs=1, sim_ttft_ms=0, sim_token_ms=20)
    plain = start_worker(BASE, sim_max_seqs=4, sim_ttft_ms=0, sim_token_ms=20)
    return holder, spare, plain, start_gateway()


def _records(client: redis.Redis) -> dict[str, dict[str, object]]:
    return {k.decode(): orjson.loads(v) for k, v in client.hgetall(keys.admission(BASE).workers).items()}


def test_models_lists_the_adapter_with_its_base_model_as_parent(fleet) -> None:
    gateway = fleet[3]
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as client:
        listed = {m.id: m for m in client.models.list().data}
        assert listed["sql"].model_extra == {"parent": BASE, "root": "/adapters/sql"}
        assert BASE in listed
        assert client.models.retrieve("sql").model_extra["parent"] == BASE


def test_an_adapter_runs_on_its_holder_and_changes_the_output(fleet, redis_client: redis.Redis) -> None:
    holder, spare, plain, gateway = fleet
    messages = [{"role": "user", "content": "what is a join"}]
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as client:
        tuned = [client.chat.completions.create(model="sql", messages=messages, max_tokens=8) for _ in range(3)]
        base = client.chat.completions.create(model=BASE, messages=messages, max_tokens=8)
    assert {r.choices[0].message.content for r in tuned} == {tuned[0].choices[0].message.content}
    assert tuned[0].choices[0].message.content != base.choices[0].message.content
    assert tuned[0].model == "sql"
    records = _records(redis_client)
    assert records[holder.name]["loras"] == ["sql"]
    assert records[spare.name]["loras"] == [], "the adapter spread while its holder was free"
    assert "loras" not in records[plain.name]


async def test_a_busy_holder_spills_the_adapter_to_a_worker_with_room(fleet, redis_client: redis.Redis) -> None:
    holder, spare, plain, gateway = fleet

    def inflight() -> dict[str, int]:
        return busy_slots(redis_client, BASE)

    streams: list[asyncio.Task[None]] = []
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
        try:
            streams.append(asyncio.create_task(hold(client, "sql")))
            await asyncio.to_thread(wait_for, lambda: inflight() == {holder.name: 1}, 20, "the holder busy")
            streams.append(asyncio.create_task(hold(client, "sql")))
            await asyncio.to_thread(wait_for, lambda: inflight() == {holder.name: 1, spare.name: 1}, 20,
                                    "the spare loading it")
            # Both are full (one slot each), and the plain worker has no LoRA: the next waits.
            body = {"model": "sql", "prompt": "short", "max_tokens": 2}
            queued = asyncio.create_task(client.post("/v1/completions", json=body))
            # The spare registers the adapter once it has loaded it, after its slot was granted
            # (a loaded CI machine read the record in between).
            await asyncio.to_thread(wait_for, lambda: _records(redis_client)[spare.name].get("loras") == ["sql"],
                                    20, "the spare's record to name the adapter")
        finally:
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
        answered = await queued
    assert answered.status_code == 200, answered.text
    assert answered.json()["model"] == "sql"
    assert plain.name not in inflight()


def test_an_adapter_nobody_registered_is_a_404(fleet) -> None:
    gateway = fleet[3]
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as err:
            client.chat.completions.create(model="no-such-adapter", messages=[{"role": "user", "content": "x"}])
    assert err.value.code == "model_not_found"


def test_an_adapter_tokenizes_nothing_it_is_refused_by_task(fleet) -> None:
    """Regression (merging adapters with pooling): /tokenize naming an adapter was granted a
    slot on its holder, whose /internal/pool serves the base model only (a 404 there)."""
    gateway = fleet[3]
    resp = httpx.post(gateway.url + "/tokenize", json={"model": "sql", "prompt": "select"}, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "task_not_served" and "'sql'" in resp.json()["error"]["message"]
    assert httpx.post(gateway.url + "/tokenize", json={"model": BASE, "prompt": "select"}, timeout=30).status_code == 200


def test_an_adapter_has_its_own_budget_and_default_priority(fleet, start_gateway) -> None:
    gateway = start_gateway(env={"SLUICE_GATEWAY_NAME_LIMITS": '{"sql": {"rpm": 2, "priority": 7}}'})
    ask = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 2}
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as client:
        for _ in range(2):
            raw = client.chat.completions.with_raw_response.create(model="sql", **ask)
            assert raw.headers["x-sluice-priority"] == "7"
        with pytest.raises(openai.RateLimitError) as err:
            client.chat.completions.create(model="sql", **ask)
        assert "model:sql" in err.value.message
        # Its base model and an explicit priority are the adapter's business only.
        for _ in range(3):
            raw = client.chat.completions.with_raw_response.create(model=BASE, **ask)
            assert raw.headers["x-sluice-priority"] == "0"


def test_an_unloaded_adapter_leaves_the_workers_record(fleet, redis_client: redis.Redis) -> None:
    holder = fleet[0]
    assert httpx.delete(holder.url + "/internal/adapters/nothing-here").status_code == 404
    assert httpx.delete(holder.url + "/internal/adapters/sql").json() == {"name": "sql", "unloaded": True}
    assert _records(redis_client)[holder.name]["loras"] == []
