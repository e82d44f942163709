"""Prefill/decode disaggregation on the real model: two vLLM CPU workers joined by vLLM's
ExampleConnector (the prompt's KV through files in a shared folder), behind the gateway.

The prefill worker (``kv_producer``) writes each prompt's KV per layer; the decode worker
(``kv_consumer``) finds it by the prompt's token ids and injects it instead of computing
it. Greedy output through the pair equals the model's aggregated output.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from sluice.models import default_model_dir, is_prepared
from tests.conftest import Proc, StartGateway, StartWorkers

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(not is_prepared(default_model_dir()), reason="run 'sluice model prepare' first"),
]

MODEL = "smol-pd"
#: Longer than two of the CPU engine's 32-token blocks: ExampleConnector moves whole blocks
#: only (a prompt under one block moves nothing and is computed on the decode worker).
PROMPTS = [
    "A canal lock raises and lowers boats between stretches of water of different levels. The lock "
    "keeper closes the lower gates, opens the sluices of the upper gates, and the chamber fills until "
    "the water is level with the upper reach. Explain in one sentence why the gates open only then.",
    "The capital of France is Paris, the capital of Italy is Rome, the capital of Spain is Madrid, the "
    "capital of Portugal is Lisbon, the capital of Austria is Vienna, the capital of Hungary is Budapest, "
    "the capital of Poland is Warsaw, and the capital of Germany is",
]


def connector(role: str, folder: Path) -> str:
    return json.dumps({"kv_connector": "ExampleConnector", "kv_role": role,
                       "kv_connector_extra_config": {"shared_storage_path": str(folder)}})


@pytest.fixture(scope="module")
def pair(start_workers: StartWorkers, tmp_path_factory: pytest.TempPathFactory) -> tuple[Proc, Proc, Path]:
    folder = tmp_path_factory.mktemp("kv")
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    # Side by side: a vLLM start is three processes importing vLLM one after another, one
    # core busy; two starts at once use both cores (one after the other: 80 s in CI).
    prefill, decode = start_workers([
        ((MODEL, "--kv-transfer-config", connector(kv_role, folder)),
         {"engine": "vllm", "role": role, "vllm_max_num_seqs": 4, "env": env})
        for role, kv_role in [("prefill", "kv_producer"), ("decode", "kv_consumer")]
    ])
    return prefill, decode, folder


@pytest.fixture(scope="module")
def client(pair: tuple[Proc, Proc, Path], start_gateway: StartGateway) -> Iterator[openai.OpenAI]:
    gateway = start_gateway()
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=300) as sdk:
        yield sdk


def aggregated(worker: Proc, prompt: str, max_tokens: int) -> str:
    """The model's whole greedy answer from one engine (no KV parameters: no transfer)."""
    body = {"request_id": "ref", "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(worker.url + "/internal/generate", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return "".join(orjson.loads(line).get("text", "") for line in response.text.splitlines())


def test_greedy_output_through_the_pair_is_the_aggregated_output(pair, client) -> None:
    prefill, decode, folder = pair
    for prompt in PROMPTS:
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        assert got.choices[0].text == aggregated(prefill, prompt, 16)
    assert any(folder.iterdir()), "the prefill worker wrote no KV"
    # The decode engine injected the KV the prefill worker wrote (ExampleConnector logs each load).
    assert "Inject KV cache of" in decode.log_path.read_text(errors="replace")
