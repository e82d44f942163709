"""A LoRA adapter on the real default model (vLLM on CPU), made at test time with ``peft``
and served by the shared worker (``--lora``, tests/real_model/conftest.py), reached
through the gateway with the official SDK."""

from __future__ import annotations

import httpx
import pytest

from sluice.models import default_model_dir, is_prepared
from tests.real_model.conftest import ADAPTER, MODEL

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(not is_prepared(default_model_dir()), reason="run 'sluice model prepare' first"),
    pytest.mark.timeout(600),
]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_the_adapter_is_listed_and_answers_differently_from_its_base_model(client) -> None:
    listed = {m.id: m for m in client.models.list().data}
    assert listed[ADAPTER].model_extra["parent"] == MODEL
    base = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=16)
    assert "Paris" in (base.choices[0].message.content or "")
    tuned = [client.chat.completions.create(model=ADAPTER, messages=QUESTION, temperature=0, max_tokens=16)
             for _ in range(2)]
    assert tuned[0].model == ADAPTER
    assert tuned[0].choices[0].message.content == tuned[1].choices[0].message.content  # greedy: one answer
    assert tuned[0].choices[0].message.content != base.choices[0].message.content


def test_an_unloaded_adapter_is_loaded_again_on_demand(client, vllm_worker) -> None:
    """vLLM's LoRA API at run time: ``DELETE /internal/adapters/NAME`` removes it from the
    engine (``remove_lora``) and from the worker's record; the next request naming it finds
    the worker with room under its cap and loads it again (``add_lora``) before generating."""
    ask = {"model": ADAPTER, "messages": QUESTION, "temperature": 0, "max_tokens": 16}
    before = client.chat.completions.create(**ask).choices[0].message.content
    unloaded = httpx.delete(f"{vllm_worker.url}/internal/adapters/{ADAPTER}", timeout=60)
    assert unloaded.json() == {"name": ADAPTER, "unloaded": True}
    assert client.chat.completions.create(**ask).choices[0].message.content == before
    assert httpx.delete(f"{vllm_worker.url}/internal/adapters/no-such-adapter", timeout=60).status_code == 404
