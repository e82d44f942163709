"""``--engine openai --relay direct``: the worker only registers the server (capacity,
health, load) and the gateway streams from it itself. Every test of the worker relay
(test_openai_upstream.py) runs again here against workers started that way, through a
real gateway with the real ``openai`` SDK; the tests below check that the worker really
was out of the stream's path."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from loadtest.peers.mock_openai import MODEL, chat_template, tokenize
from sluice import keys
from sluice.engine_server import parse_relay_url, relay_url
from tests.engine_worker.test_openai_upstream import *  # the same tests, direct relay
from tests.engine_worker.test_openai_upstream import received, reference


@pytest.fixture(scope="module")
def workers(mocks, start_worker):
    started = [start_worker("mockv", engine="openai", upstream_url=m.url, upstream_poll_ms=100, relay="direct")
               for m in mocks["vllm"]]
    started.append(start_worker("mockg", engine="openai", upstream_url=mocks["generic"].url,
                                upstream_poll_ms=100, relay="direct"))
    return started


@pytest.fixture(scope="module")  # type: ignore[no-redef]  # this module's workers
def gateway(workers, start_gateway):
    # A migration with no worker left to take it waits 2 s, not 15, before its in-band error.
    return start_gateway(env={"SLUICE_GATEWAY_MIGRATION_WAIT_S": "2"})


@pytest.fixture(scope="module")  # type: ignore[no-redef]  # workers a test starts itself
def relay() -> dict[str, str]:
    return {"relay": "direct"}


def served(worker) -> int:
    return int(httpx.get(worker.url + "/health").json()["worker"]["served"])


def test_records_name_the_servers(workers, mocks, redis_client) -> None:
    records = [json.loads(r) for r in redis_client.hvals(keys.workers("mockv"))]
    assert sorted(parse_relay_url(r["url"])[0] for r in records) == sorted(m.url for m in mocks["vllm"])
    assert all(parse_relay_url(r["url"])[2] for r in records)  # vLLM-like: token ids
    (generic,) = [json.loads(r) for r in redis_client.hvals(keys.workers("mockg"))]
    assert parse_relay_url(generic["url"]) == (mocks["generic"].url, MODEL, False)


def test_streams_bypass_the_workers(client, workers) -> None:
    messages = [{"role": "user", "content": "direct relay probe"}]
    resp = client.chat.completions.create(model="mockv", messages=messages, max_tokens=9,
                                          extra_body={"ignore_eos": True})
    assert resp.choices[0].message.content == reference(tokenize(chat_template(messages)), 9)
    assert resp.usage.completion_tokens == 9
    assert resp.usage.prompt_tokens == len(tokenize(chat_template(messages)))
    assert [served(w) for w in workers] == [0, 0, 0]


def test_the_server_gets_its_own_model_name(client, mocks) -> None:
    client.completions.create(model="mockv", prompt="who sent this", max_tokens=2)
    bodies = [b for m in mocks["vllm"] for b in received(m) if b.get("prompt") == "who sent this"]
    assert len(bodies) == 1 and bodies[0]["model"] == MODEL


def test_relay_url_round_trip() -> None:
    url = relay_url("http://10.0.0.7:8000/", "HuggingFaceTB/SmolLM2 135M?&", True)
    assert url.startswith("openai+http://10.0.0.7:8000?")
    assert parse_relay_url(url) == ("http://10.0.0.7:8000", "HuggingFaceTB/SmolLM2 135M?&", True)


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--engine", "sim"], {}, "--relay direct is for --engine openai"),
    (["--engine", "openai", "--upstream-url", "http://127.0.0.1:9"], {"SLUICE_WORKER_UPSTREAM_API_KEY": "k"},
     "cannot use an upstream API key"),
])
def test_direct_relay_refusals(argv: list[str], env: dict[str, str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "sluice", "worker", *argv, "--relay", "direct", "--port", "1"],
                          capture_output=True, text=True, timeout=60, check=False, env={**os.environ, **env})
    assert done.returncode != 0 and message in done.stderr
