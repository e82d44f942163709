"""The default model as an embedding model: vLLM on CPU with ``--task embed`` (``runner=
"pooling", convert="embed"``), through the gateway and the official SDK.

One module-scoped worker (a pooling runner: its own engine, its own model name) beside the
shared generating one, behind the shared gateway; a few requests. SmolLM2-135M was trained to generate, not to embed: its pooled last-token state
still puts a paraphrase nearer than an unrelated sentence, which is what is checked, with
the shapes, the base64 encoding, the scores and the tokenizer round trip.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import httpx
import openai
import pytest

from sluice.models import default_model_dir, is_prepared
from tests.conftest import Proc, StartWorker
from tests.real_model.conftest import MODEL as GENERATING

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not is_prepared(default_model_dir()), reason="run 'sluice model prepare' first"),
]

MODEL = "smol-embed"
CAT = "The cat sat on the mat."
CAT_AGAIN = "A cat is sitting on a mat."
MARKETS = "Stock markets fell sharply after the central bank raised interest rates."


@pytest.fixture(scope="module")
def gateway(start_worker: StartWorker, vllm_gateway: Proc) -> Proc:
    start_worker(MODEL, engine="vllm", task="embed", vllm_max_num_seqs=8, env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    return vllm_gateway


@pytest.fixture
def client(gateway: Proc) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=300) as sdk:
        yield sdk


def _cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_embeddings_shapes_similarity_and_base64(client: openai.OpenAI) -> None:
    floats = client.embeddings.create(model=MODEL, input=[CAT, CAT_AGAIN, MARKETS], encoding_format="float")
    vectors = [d.embedding for d in floats.data]
    assert [d.index for d in floats.data] == [0, 1, 2]
    assert {len(v) for v in vectors} == {576}  # SmolLM2-135M's hidden size
    assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-3 for v in vectors)  # normalised
    assert _cosine(vectors[0], vectors[1]) > _cosine(vectors[0], vectors[2])
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 10
    # The SDK's default: base64 on the wire, decoded by the SDK (float32).
    decoded = client.embeddings.create(model=MODEL, input=CAT).data[0].embedding
    assert max(abs(x - y) for x, y in zip(decoded, vectors[0], strict=True)) < 1e-5
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MODEL, input=CAT, dimensions=64)
    assert "dimensions" in str(refused.value)


def test_rerank_score_and_tokenize(gateway: Proc) -> None:
    with httpx.Client(base_url=gateway.url, timeout=300) as http:
        ranked = http.post("/v1/rerank", json={"model": MODEL, "query": CAT, "documents": [MARKETS, CAT_AGAIN]})
        assert ranked.status_code == 200, ranked.text
        assert [r["index"] for r in ranked.json()["results"]] == [1, 0]
        scored = http.post("/v1/score", json={"model": MODEL, "text_1": CAT, "text_2": [CAT_AGAIN, MARKETS]}).json()
        assert [d["index"] for d in scored["data"]] == [0, 1]
        assert scored["data"][0]["score"] > scored["data"][1]["score"]
        tokens = http.post("/tokenize", json={"model": MODEL, "prompt": CAT}).json()
        assert tokens["count"] == len(tokens["tokens"]) > 3 and tokens["max_model_len"] == 2048
        assert http.post("/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json()["prompt"] == CAT
        refused = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "task_not_served"
        # The generating worker tokenizes too (its chat template), and embeds nothing.
        chat = http.post("/tokenize", json={"model": GENERATING, "messages": [{"role": "user", "content": CAT}]}).json()
        assert chat["count"] > tokens["count"]
        assert CAT in http.post("/detokenize", json={"model": GENERATING, "tokens": chat["tokens"]}).json()["prompt"]
        assert http.post("/v1/embeddings", json={"model": GENERATING, "input": CAT}).status_code == 400


def test_an_empty_text_to_rerank_is_named_as_the_client_sent_it(gateway: Proc) -> None:
    """Regression: an empty document (no tokens with this tokenizer) was refused as
    "input[1] is empty", param "input": an index into the worker's de-duplicated texts
    (query first), in a request that has no ``input``."""
    with httpx.Client(base_url=gateway.url, timeout=300) as http:
        for body in ({"query": CAT, "documents": ["", CAT_AGAIN]}, {"query": "", "documents": [CAT]}):
            refused = http.post("/v1/rerank", json={"model": MODEL, **body})
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert "input" not in error["message"] and error["param"] is None, error
            assert "empty" in error["message"], error
