"""The vLLM worker on a vLLM that has no ``VLLMClientError``, as 0.26.0 (issue 20, item 0).

The installed vLLM is made into that version's shape in the worker's own interpreter: a
``sitecustomize`` loads vLLM's modules as they are, then deletes the name from
``vllm.exceptions``. On 8b41021 every request to such a worker failed (``engine error:
ImportError``, a 503 from the gateway); now they are served, and a request's own fault is
still a 400.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import openai
import pytest

from sluice.models import default_model_dir, is_prepared
from tests.conftest import Proc, StartGateway, StartWorker

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not is_prepared(default_model_dir()), reason="run 'sluice model prepare' first"),
]

MODEL = "smol-no-client-error"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]

SITECUSTOMIZE = """\
import vllm.exceptions, vllm.v1.engine.async_llm
del vllm.exceptions.VLLMClientError
"""


@pytest.fixture(scope="module")
def gateway(start_worker: StartWorker, start_gateway: StartGateway,
            tmp_path_factory: pytest.TempPathFactory) -> Proc:
    site = tmp_path_factory.mktemp("vllm_0_26_exceptions")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    start_worker(MODEL, engine="vllm", vllm_max_num_seqs=4,
                 env={"PYTHONPATH": path, "VLLM_CPU_OMP_THREADS_BIND": "0"})
    return start_gateway()


@pytest.fixture
def client(gateway: Proc) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=300) as sdk:
        yield sdk


def test_vllm_0_26_every_request_failed_with_an_import_error(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=30)
    assert "Paris" in (resp.choices[0].message.content or "")
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=30,
                                            stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == \
        resp.choices[0].message.content


def test_a_schema_the_grammar_cannot_take_is_still_a_400(client: openai.OpenAI) -> None:
    # vLLM refuses the grammar while taking the request (VLLMValidationError; 0.26: ValueError).
    broken = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "broken", "schema": broken}})
    assert caught.value.body["param"] == "response_format"
