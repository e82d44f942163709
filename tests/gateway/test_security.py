"""Hardening: auth that never fails open, workers that answer gateways only, bounded
metrics labels and logs, and malformed input that is a 400, never a 500.

Against a private Redis: API keys there would switch the shared stack to authenticated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
import redis
from pydantic import ValidationError

from gateway.surfaces.body import validation_error
from gateway.surfaces.openai import CompletionRequest
from gateway.surfaces.pooling import EmbeddingRequest
from sluice.embedded_redis import EmbeddedRedis
from tests.conftest import ROOT

TOKEN = "t0ken-for-tests"


@pytest.fixture(scope="module")
def secure_redis():
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture(scope="module")
def secure(secure_redis, start_worker, start_gateway):
    env = {"SLUICE_INTERNAL_TOKEN": TOKEN}
    worker = start_worker("secure", redis_at=secure_redis, env=env, sim_token_ms=0, sim_ttft_ms=0)
    gateway = start_gateway(redis_at=secure_redis, env=env)
    result = subprocess.run([sys.executable, "-m", "sluice", "keys", "create", "--name", "sec",
                             "--redis-url", secure_redis], capture_output=True, text=True, cwd=ROOT, timeout=60)
    key = result.stdout.strip()
    deadline = time.monotonic() + 10
    while httpx.post(gateway.url + "/v1/completions", json={"model": "secure", "prompt": "x"}).status_code != 401:
        assert time.monotonic() < deadline, "keys never enforced"
        time.sleep(0.1)
    return worker, gateway, key


def _complete(url: str, key: str | None = None, **body: object) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/completions", headers=headers, timeout=30,
                      json={"model": "secure", "prompt": "x", "max_tokens": 2, **body})


def test_keys_stay_enforced_after_redis_loses_them(secure, secure_redis) -> None:
    """Regression: after FLUSHALL (or a restart without persistence) the gateway served
    everyone without a key."""
    _, gateway, key = secure
    assert _complete(gateway.url, key).status_code == 200
    client = redis.Redis.from_url(secure_redis)
    try:
        client.flushall()
        time.sleep(2.5)  # past the gateway's 2 s re-check of whether keys exist
        assert _complete(gateway.url).status_code == 401
    finally:
        client.close()
    # The key's record is gone too, but this gateway verified it: it writes it back
    # (tests/gateway/test_key_data_loss.py).
    assert _complete(gateway.url, key).status_code == 200


def test_models_docs_and_metrics_need_credentials_once_keys_exist(secure) -> None:
    _, gateway, _ = secure
    for path in ("/v1/models", "/v1/models/secure", "/openapi.json", "/docs"):
        assert httpx.get(gateway.url + path).status_code == 401, path
    metrics = httpx.get(gateway.url + "/metrics")  # loopback, but keys exist and no admin key is set
    assert metrics.status_code == 401 and "SLUICE_GATEWAY_ADMIN_KEY" in metrics.json()["error"]["message"]


def test_workers_answer_gateways_only(secure) -> None:
    worker, _, _ = secure
    body = {"request_id": "r1", "model": "secure", "prompt": "x", "max_tokens": 2}
    assert httpx.post(worker.url + "/internal/generate", json=body).status_code == 401
    assert httpx.get(worker.url + "/metrics").status_code == 401
    wrong = httpx.post(worker.url + "/internal/generate", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    right = httpx.post(worker.url + "/internal/generate", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert right.status_code == 200
    assert httpx.get(worker.url + "/health").status_code == 200  # probes stay open


def test_worker_caps_are_checked_on_the_worker(secure) -> None:
    worker, _, _ = secure
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for extra in ({"stop": ["x"] * 100}, {"priority": -10**9}):
        body = {"request_id": "r2", "model": "secure", "prompt": "x", "max_tokens": 2, **extra}
        assert httpx.post(worker.url + "/internal/generate", json=body, headers=auth).status_code == 400, extra


def test_a_gateway_without_the_token_gets_503_not_401(secure_redis, secure, start_gateway) -> None:
    stranger = start_gateway(redis_at=secure_redis)
    _, _, key = secure
    resp = _complete(stranger.url, key)
    assert resp.status_code == 503, resp.text


def test_worker_on_a_public_address_needs_the_token() -> None:
    result = subprocess.run([sys.executable, "-m", "sluice", "worker", "--host", "0.0.0.0", "--port", "0",
                             "--redis-url", "redis://127.0.0.1:1/0"],
                            capture_output=True, text=True, cwd=ROOT, timeout=60,
                            env={k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")})
    assert result.returncode == 2 and "SLUICE_INTERNAL_TOKEN" in result.stderr and "Traceback" not in result.stderr


def test_deeply_nested_json_is_400(stack) -> None:
    """Regression: 300 levels passed validation and crashed orjson.dumps when forwarded (500)."""
    nested: object = "x"
    for _ in range(300):
        nested = [nested]
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi", "extra": nested}]}
    resp = httpx.post(stack.url + "/v1/chat/completions", content=json.dumps(body),
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "nests deeper" in resp.json()["error"]["message"]


def test_a_body_of_too_many_arrays_and_objects_is_400_before_it_is_parsed(stack) -> None:
    """Regression: a 2 MB body whose prompt was 500,000 one-token lists held the gateway's
    event loop 1.4 s while it was parsed and validated, to answer 400 for the prompt's size;
    100,000 content parts in one message were served. Both are refused unparsed now; brackets
    inside strings do not count."""
    def post(path: str, body: bytes) -> httpx.Response:
        return httpx.post(stack.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)

    lists = b'{"model":"sim","max_tokens":1,"prompt":[' + b",".join([b"[1]"] * 500_000) + b"]}"
    resp = post("/v1/completions", lists)
    assert resp.status_code == 400 and "more than 32768 arrays and objects" in resp.json()["error"]["message"]
    parts = json.dumps({"model": "sim", "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}] * 100_000}]}).encode()
    resp = post("/v1/chat/completions", parts)
    assert resp.status_code == 400 and "arrays and objects" in resp.json()["error"]["message"]
    text = json.dumps({"model": "sim", "max_tokens": 1, "prompt": '[{"quoted\\": [1]}] ' * 40_000}).encode()
    assert post("/v1/completions", text).status_code == 200


@pytest.mark.parametrize("model", [CompletionRequest, EmbeddingRequest])
def test_a_flat_token_id_prompt_is_validated_as_token_ids_alone(model: type) -> None:
    """Regression: a prompt (or embeddings input) of 1.9M token ids, one array within the
    body's bounds, held a gateway's loop 1.7 s for a 400 (a review): the union of its shapes
    tried the list of texts first and made an error per id. Each shape is now chosen by the
    first item, so a bad id is one error, and the others' shapes make none."""
    field = "prompt" if model is CompletionRequest else "input"
    with pytest.raises(ValidationError) as bad:
        model.model_validate({"model": "m", field: [1] * 100_000 + [-1]})
    assert len(bad.value.errors()) == 1
    assert validation_error(bad.value.errors()).param == f"{field}.100000"
    for value, param, says in ((["a", 1], f"{field}.1", "valid string"), ([1, "a"], f"{field}.1", "valid integer"),
                               ([[1], "a"], f"{field}.1", "valid list"), ({"x": 1}, field, "valid string"),
                               ([], field, "at least 1 item"), ([1.5], f"{field}.0", "fractional part")):
        with pytest.raises(ValidationError) as bad:
            model.model_validate({"model": "m", field: value})
        told = validation_error(bad.value.errors())
        assert told.param == param and says in told.message, (value, told.param, told.message)
    assert model.model_validate({"model": "m", field: [True, 2]}).model_dump()[field] == [1, 2]


def test_invented_model_names_add_no_metric_series(stack) -> None:
    """Regression: every request's model string became a Prometheus label (50 names, 1,600 series)."""
    for i in range(50):
        assert httpx.post(stack.url + "/v1/completions", json={"model": f"invented-{i}", "prompt": "x"}).status_code == 404
    text = httpx.get(stack.url + "/metrics").text
    assert "invented-" not in text
    assert 'model="unknown"' in text


def test_unknown_fields_are_logged_once_per_request_and_capped(stack) -> None:
    """Regression: a request with 20,000 unknown fields produced 20,000 log lines."""
    body = {"model": "sim", "prompt": "x", "max_tokens": 1, **{f"field_{i}": i for i in range(2000)}}
    before = stack.log_path.read_text().count("unknown request field")
    assert httpx.post(stack.url + "/v1/completions", json=body).status_code == 200
    time.sleep(0.2)
    lines = [ln for ln in stack.log_path.read_text().splitlines() if "unknown request field" in ln]
    assert len(lines) - before == 1 and len(lines[-1]) < 600


def test_metrics_know_a_client_behind_a_local_proxy_by_its_own_address(stack) -> None:
    """A local reverse proxy's ``X-Forwarded-For`` names the client, and /metrics (loopback
    clients only, on a gateway without keys) refuses a remote one. uvicorn's proxy-headers
    middleware runs in front of FastAPI's routes only (sluice/lean_routes.py); a completion
    with the header is served as ever."""
    assert httpx.get(stack.url + "/metrics").status_code == 200
    remote = httpx.get(stack.url + "/metrics", headers={"x-forwarded-for": "203.0.113.7"})
    assert remote.status_code == 401 and "loopback" in remote.json()["error"]["message"]
    answer = httpx.post(stack.url + "/v1/completions", headers={"x-forwarded-for": "203.0.113.7"}, timeout=30,
                        json={"model": "sim", "prompt": "x", "max_tokens": 2})
    assert answer.status_code == 200, answer.text


def test_the_depth_bound_counts_as_the_walk_it_replaced() -> None:
    """The level-at-a-time depth check (gateway/surfaces/body.py) gives the verdicts of the
    node-by-node walk it replaced: the object is level 1, each value one below its container,
    a scalar too; past 64, refused."""
    from gateway.surfaces.body import MAX_JSON_DEPTH, _depth

    def nested(lists: int, leaf: object) -> object:
        for _ in range(lists):
            leaf = [leaf]
        return leaf

    assert _depth({}) == 1 and _depth({"a": []}) == 2 and _depth({"a": [1]}) == 3
    assert _depth({"a": nested(MAX_JSON_DEPTH - 2, "x")}) == MAX_JSON_DEPTH  # the scalar at 64
    assert _depth({"a": nested(MAX_JSON_DEPTH - 1, "x")}) > MAX_JSON_DEPTH
    assert _depth({"a": nested(MAX_JSON_DEPTH - 1, None), "b": list(range(100_000))}) > MAX_JSON_DEPTH
