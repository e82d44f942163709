"""The precise prefix index on the real model (vLLM on CPU): the worker's KV events and the
gateway's tokenizer name the same blocks, the router predicts ``cached_tokens`` exactly, and
the worker takes the gateway's token ids instead of tokenizing the prompt again.

The shared worker publishes its KV events (``SLUICE_PREFIX_INDEX=precise``, conftest.py); a
gateway of this module's own tokenizes prompts with the model's tokenizer.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from engine_worker.engines.prompts import prompt_token_ids, tokenizer_digest
from engine_worker.protocol import GenerateRequest
from sluice import keys
from sluice.models import default_model_dir, is_prepared
from sluice.prefix_tokens import TOKEN_BLOCK, token_block_hashes
from tests.conftest import Proc, StartGateway, wait_for
from tests.real_model.conftest import MODEL

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(not is_prepared(default_model_dir()), reason="run 'sluice model prepare' first"),
]

SYSTEM = ("You are the lock keeper of the Sluice canal. Boats arrive from the north and the south; "
          "you open the upper gate, let the water settle, and lower each boat gently. ") * 6


@pytest.fixture(scope="module")
def worker(vllm_worker: Proc) -> Proc:
    return vllm_worker


@pytest.fixture(scope="module")
def gateway(worker: Proc, start_gateway: StartGateway) -> Proc:
    return start_gateway(env={"SLUICE_PREFIX_INDEX": "precise", "SLUICE_GATEWAY_TOKENIZER": str(default_model_dir())})


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir()))


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=300) as client:
        yield client


def messages_aligned(tokenizer: Any, question: str) -> tuple[list[dict[str, str]], list[int]]:
    """A conversation whose token count L has L mod 64 in [1, 32]: then vLLM on CPU (blocks of
    32, the last prompt token never cached) finds exactly the prompt's full blocks of 64 again."""
    for pad in range(80):
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": question + " please" * pad}]
        ids = prompt_token_ids(tokenizer, GenerateRequest.model_construct(messages=messages))
        if 1 <= len(ids) % TOKEN_BLOCK <= 32:
            return messages, ids
    raise AssertionError("no padding aligns the prompt")


def metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))


def chat(http: httpx.Client, gateway: Proc, messages: list[dict[str, str]]) -> dict[str, Any]:
    response = http.post(gateway.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    return orjson.loads(response.content)["usage"]


def test_kv_events_name_the_generated_blocks_too(worker: Proc, redis_client: redis.Redis, tokenizer: Any,
                                                   http: httpx.Client) -> None:
    # Straight at the worker: no routing marks anything, so only the engine's KV events
    # can put these blocks in the index -- the completion's blocks included.
    messages, ids = messages_aligned(tokenizer, "Which gate opens first?")
    response = http.post(worker.url + "/internal/generate", json={
        "request_id": "kv-events", "model": MODEL, "messages": messages, "max_tokens": 80,
        "ignore_eos": True, "temperature": 0})
    assert response.status_code == 200, response.text
    out = [i for line in response.text.splitlines() for i in orjson.loads(line).get("ids", [])]
    computed = ids + out[:-1]  # the last token's KV is never computed
    expected = token_block_hashes(computed)
    assert len(expected) > len(ids) // TOKEN_BLOCK  # a block made of generated tokens
    index = keys.prefix_index(MODEL)[0]
    wait_for(lambda: all(worker.name in (redis_client.hget(index, h) or b"").decode().split()
                         for h in expected), 30, "the worker's KV events in the index")


def test_predicted_hit_equals_cached_tokens_for_a_repeated_prefix(gateway: Proc, tokenizer: Any,
                                                                   http: httpx.Client) -> None:
    messages, ids = messages_aligned(tokenizer, "How long does the water take to settle?")
    first = chat(http, gateway, messages)
    assert first["prompt_tokens"] == len(ids)  # the gateway tokenized as the worker did
    before = http.get(gateway.url + "/metrics").text
    again = chat(http, gateway, messages)
    after = http.get(gateway.url + "/metrics").text
    cached = again["prompt_tokens_details"]["cached_tokens"]
    predicted = metric(after, "sluice_gateway_prefix_expected_tokens_total") - metric(
        before, "sluice_gateway_prefix_expected_tokens_total")
    error = metric(after, "sluice_gateway_prefix_error_tokens_total") - metric(
        before, "sluice_gateway_prefix_error_tokens_total")
    assert cached == len(ids) // TOKEN_BLOCK * TOKEN_BLOCK > 0
    assert (predicted, error) == (cached, 0)


def test_the_worker_takes_the_gateways_prompt_ids_when_their_tokenizer_is_its_own(
        worker: Proc, gateway: Proc, tokenizer: Any, http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Which gate opens first?"}]
    own = prompt_token_ids(tokenizer, GenerateRequest.model_construct(messages=messages))
    sent = own + own  # not this prompt's ids: the prompt's length shows whose ids vLLM ran

    def prompt_tokens(digest: str) -> int:
        response = http.post(worker.url + "/internal/generate", json={
            "request_id": f"ids-{digest}", "model": MODEL, "messages": messages, "max_tokens": 1,
            "temperature": 0, "gateway_prompt_ids": sent, "gateway_tokenizer": digest})
        assert response.status_code == 200, response.text
        return int(orjson.loads(response.text.splitlines()[-1])["usage"]["prompt_tokens"])

    def taken() -> float:
        return metric(http.get(worker.url + "/metrics").text, "sluice_worker_gateway_prompt_ids_total")

    before = taken()
    # The gateway's AutoTokenizer and vLLM's tokenizer of the same folder have one digest.
    assert prompt_tokens(tokenizer_digest(tokenizer)) == len(sent)
    assert prompt_tokens("0" * 16) == len(own)  # another tokenizer's ids: the worker's own
    assert taken() == before + 1
    # Through a precise-index gateway: its ids travel with the prompt and are taken.
    chat(http, gateway, messages)
    assert taken() == before + 2


def test_a_gateway_with_a_tokenizer_sends_its_ids_whatever_its_index(
        worker: Proc, start_gateway: StartGateway, http: httpx.Client) -> None:
    """The approximate index (the default) and a tokenizer folder: the gateway's processes
    tokenize, the worker's one process need not (its frontend bounds short requests on a GPU).
    The gateway does so without torch: it would hold ~330 MB more a process."""
    approx = start_gateway(env={"SLUICE_GATEWAY_TOKENIZER": str(default_model_dir())})
    assert "libtorch" not in Path(f"/proc/{approx.process.pid}/maps").read_text()

    def taken() -> float:
        return metric(http.get(worker.url + "/metrics").text, "sluice_worker_gateway_prompt_ids_total")

    before = taken()
    answer = chat(http, approx, [{"role": "user", "content": "Which gate closes last?"}])
    assert answer["prompt_tokens"] > 0
    assert taken() == before + 1
