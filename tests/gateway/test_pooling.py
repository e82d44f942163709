"""Embeddings, score, rerank and tokenize through the gateway, on simulator workers: the
official SDK for embeddings, httpx for vLLM's routes. The simulator's answers are exact
functions of the text (engine_worker/engines/sim_pooling.py), so every number is checked.

A private Redis: the TPM test creates an API key, which switches its gateway to keys.
"""

from __future__ import annotations

import base64
import struct
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from engine_worker.engines.sim import VOCAB
from engine_worker.engines.sim_pooling import SIM_EMBED_DIM, sim_detokenize, sim_embedding
from engine_worker.pooling import cosine
from sluice.embedded_redis import EmbeddedRedis
from tests.conftest import ROOT, Proc

MODEL = "pool"
GEN_ONLY = "pool-gen"
CAT, CAT_AGAIN, MARKETS = "the cat sat on the mat", "a cat sat on a mat", "stock markets fell sharply today"


@pytest.fixture(scope="module")
def pool_redis() -> Iterator[str]:
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture(scope="module")
def stack(pool_redis: str, start_worker, start_gateway) -> tuple[Proc, Proc, Proc, str]:
    """One model served by a generating worker and an embedding one; another model
    served by a generating worker only; one gateway, with one API key."""
    generator = start_worker(MODEL, redis_at=pool_redis)
    embedder = start_worker(MODEL, redis_at=pool_redis, task="embed")
    start_worker(GEN_ONLY, redis_at=pool_redis)
    key = _create_key(pool_redis)  # first: a gateway that starts with a key enforces keys at once
    gateway = start_gateway(redis_at=pool_redis)
    return gateway, generator, embedder, key


def _create_key(redis_url: str, *flags: str) -> str:
    result = subprocess.run([sys.executable, "-m", "sluice", "keys", "create", "--name", "pool", *flags,
                             "--redis-url", redis_url], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.fixture
def client(stack) -> Iterator[openai.OpenAI]:
    gateway, _, _, key = stack
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0) as sdk:
        yield sdk


@pytest.fixture
def http(stack) -> Iterator[httpx.Client]:
    gateway, _, _, key = stack
    with httpx.Client(base_url=gateway.url, headers={"authorization": f"Bearer {key}"}, timeout=30) as c:
        yield c


def _served(worker: Proc) -> int:
    return int(httpx.get(worker.url + "/health").json()["worker"]["served"])


def test_embeddings_through_the_sdk_float_and_base64(client: openai.OpenAI) -> None:
    floats = client.embeddings.create(model=MODEL, input=[CAT, MARKETS], encoding_format="float")
    assert floats.object == "list" and floats.model == MODEL
    assert [d.index for d in floats.data] == [0, 1]
    assert floats.data[0].embedding == sim_embedding(CAT)  # exact: JSON floats round-trip
    assert floats.data[1].embedding == sim_embedding(MARKETS)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == 6 + 5
    # The SDK asks for base64 by default and decodes it: float32 values.
    decoded = client.embeddings.create(model=MODEL, input=CAT).data[0].embedding
    assert len(decoded) == SIM_EMBED_DIM
    assert decoded == [struct.unpack("<f", struct.pack("<f", x))[0] for x in sim_embedding(CAT)]


def test_base64_on_the_wire_is_little_endian_float32(http: httpx.Client) -> None:
    body = http.post("/v1/embeddings", json={"model": MODEL, "input": CAT, "encoding_format": "base64"}).json()
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert len(raw) == 4 * SIM_EMBED_DIM
    assert list(struct.unpack(f"<{SIM_EMBED_DIM}f", raw)) == pytest.approx(sim_embedding(CAT), abs=1e-6)


def test_token_array_inputs(client: openai.OpenAI) -> None:
    ids = [3, 14, 15, 92]
    one = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert len(one.data) == 1 and one.data[0].embedding == sim_embedding(sim_detokenize(ids))
    assert one.usage.prompt_tokens == 4
    two = client.embeddings.create(model=MODEL, input=[ids, [7, 8]], encoding_format="float")
    assert [d.embedding for d in two.data] == [sim_embedding(sim_detokenize(ids)), sim_embedding(sim_detokenize([7, 8]))]
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MODEL, input=[len(VOCAB) + 5])
    assert refused.value.body["param"] == "input"  # type: ignore[index]


def test_bad_embedding_requests_are_clear_400s(client: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MODEL, input=CAT, dimensions=16)
    assert refused.value.body["param"] == "dimensions"  # type: ignore[index]
    assert "Matryoshka" in refused.value.body["message"]  # type: ignore[index]
    for body, param in [({"model": MODEL, "input": []}, "input"), ({"model": MODEL, "input": ""}, "input"),
                        ({"model": MODEL, "input": CAT, "encoding_format": "int8"}, "encoding_format"),
                        ({"model": MODEL, "input": CAT, "truncate_prompt_tokens": 4}, "truncate_prompt_tokens")]:
        resp = http.post("/v1/embeddings", json=body)
        assert resp.status_code == 400, (body, resp.text)
        assert resp.json()["error"]["type"] == "invalid_request_error"
        assert resp.json()["error"]["param"] == param, resp.text


def test_score_one_to_n_and_n_to_n(http: httpx.Client) -> None:
    resp = http.post("/v1/score", json={"model": MODEL, "text_1": CAT, "text_2": [CAT_AGAIN, MARKETS]})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "list" and body["id"].startswith("score-")
    assert [d["object"] for d in body["data"]] == ["score", "score"]
    expected = [cosine(sim_embedding(CAT), sim_embedding(t)) for t in (CAT_AGAIN, MARKETS)]
    assert [d["score"] for d in body["data"]] == pytest.approx(expected)
    assert expected[0] > expected[1]
    pairwise = http.post("/score", json={"model": MODEL, "queries": [CAT, MARKETS], "documents": [MARKETS, MARKETS]})
    assert [d["score"] for d in pairwise.json()["data"]] == pytest.approx(
        [cosine(sim_embedding(CAT), sim_embedding(MARKETS)), 1.0])
    mismatched = http.post("/v1/score", json={"model": MODEL, "text_1": [CAT, CAT], "text_2": [CAT, CAT, CAT]})
    assert mismatched.status_code == 400 and "1:1, 1:N or N:N" in mismatched.json()["error"]["message"]


def test_rerank_orders_by_relevance_with_top_n(http: httpx.Client) -> None:
    docs = [MARKETS, CAT_AGAIN, CAT]
    body = http.post("/v1/rerank", json={"model": MODEL, "query": CAT, "documents": docs}).json()
    scores = [cosine(sim_embedding(CAT), sim_embedding(d)) for d in docs]
    order = sorted(range(3), key=lambda i: -scores[i])
    assert [r["index"] for r in body["results"]] == order == [2, 1, 0]
    assert [r["document"]["text"] for r in body["results"]] == [docs[i] for i in order]
    assert body["results"][0]["relevance_score"] == pytest.approx(1.0)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    top = http.post("/rerank", json={"model": MODEL, "query": CAT, "documents": docs, "top_n": 1}).json()
    assert [r["index"] for r in top["results"]] == [2]


def test_tokenize_and_detokenize(http: httpx.Client) -> None:
    words = " ".join(VOCAB[i] for i in (5, 6, 7))
    body = http.post("/tokenize", json={"model": MODEL, "prompt": words, "return_token_strs": True}).json()
    assert body == {"count": 3, "max_model_len": 32768, "tokens": [5, 6, 7], "token_strs": [VOCAB[5], VOCAB[6], VOCAB[7]]}
    assert http.post("/detokenize", json={"model": MODEL, "tokens": [5, 6, 7]}).json() == {"prompt": words}
    chat = http.post("/tokenize", json={"model": GEN_ONLY, "messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] == len(chat["tokens"]) == 3  # "<|user|> hi <|assistant|>": generating workers tokenize too
    both = http.post("/tokenize", json={"model": MODEL, "prompt": "x", "messages": [{"role": "user", "content": "x"}]})
    assert both.status_code == 400


def test_a_task_no_worker_serves_is_a_400_naming_it(client: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=GEN_ONLY, input=CAT)
    error = refused.value.body
    assert error["code"] == "task_not_served" and "'embed'" in error["message"]  # type: ignore[index]
    resp = http.post("/v1/rerank", json={"model": GEN_ONLY, "query": CAT, "documents": [CAT]})
    assert resp.status_code == 400 and "'score'" in resp.json()["error"]["message"]
    missing = http.post("/v1/embeddings", json={"model": "nobody-serves-this", "input": CAT})
    assert missing.status_code == 404


def test_each_task_goes_to_the_workers_serving_it(stack, client: openai.OpenAI) -> None:
    _, generator, embedder, _ = stack
    before = _served(generator), _served(embedder)
    for _ in range(6):
        client.embeddings.create(model=MODEL, input=CAT)
        client.completions.create(model=MODEL, prompt=CAT, max_tokens=2)
    assert (_served(generator) - before[0], _served(embedder) - before[1]) == (6, 6)


def test_embeddings_are_charged_to_the_keys_tpm(stack, pool_redis: str) -> None:
    gateway = stack[0]
    key = _create_key(pool_redis, "--tpm", "100", "--rpm", "1000")
    time.sleep(2.1)
    text = " ".join(["word"] * 60)  # 60 prompt tokens; estimated at 299 // 4 + 1 = 75
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0) as sdk:
        first = sdk.embeddings.with_raw_response.create(model=MODEL, input=text)
        assert first.parse().usage.prompt_tokens == 60
        assert int(first.headers["x-ratelimit-remaining-tokens"]) <= 100 - 75
        with pytest.raises(openai.RateLimitError) as limited:
            sdk.embeddings.create(model=MODEL, input=text)  # 60 used + 75 estimated > 100
    assert limited.value.response.headers["retry-after"]
