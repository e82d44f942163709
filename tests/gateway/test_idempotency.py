"""Idempotency-Key: one generation per key."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import uuid

import httpx
import openai
import pytest

from gateway.streams.idempotency import scoped
from sluice import keys
from tests.conftest import streaming, wait_for
from tests.gateway.test_resumable import _events


def _served(worker) -> int:
    return int(httpx.get(worker.url + "/health").json()["worker"]["served"])


@pytest.fixture(scope="module")
def idem(start_worker, start_gateway):
    worker = start_worker("idem", sim_token_ms=10, sim_ttft_ms=0)
    return worker, start_gateway()


async def test_concurrent_callers_share_one_generation(idem) -> None:
    worker, gateway = idem
    before = _served(worker)
    key = {"Idempotency-Key": uuid.uuid4().hex}
    body = {"model": "idem", "prompt": "once", "max_tokens": 20, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        first, second = await asyncio.gather(
            client.post("/v1/completions", json=body, headers=key),
            client.post("/v1/completions", json=body, headers=key),
        )
        third = await client.post("/v1/completions", json=body, headers=key)
    assert first.status_code == second.status_code == third.status_code == 200
    assert first.json() == second.json() == third.json()  # same id, same text
    assert third.headers["idempotent-replayed"] == "true"
    assert _served(worker) == before + 1


def test_same_key_other_body_is_409(idem) -> None:
    _, gateway = idem
    key = uuid.uuid4().hex
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0) as client:
        client.completions.create(model="idem", prompt="a", max_tokens=2,
                                  extra_headers={"Idempotency-Key": key})
        with pytest.raises(openai.ConflictError):
            client.completions.create(model="idem", prompt="b", max_tokens=2,
                                      extra_headers={"Idempotency-Key": key})


def test_failed_generation_frees_the_key(idem) -> None:
    _, gateway = idem
    key = {"Idempotency-Key": uuid.uuid4().hex}
    bad = httpx.post(gateway.url + "/v1/completions", headers=key,
                     json={"model": "no-such-model", "prompt": "x"})
    assert bad.status_code == 404
    # The first call claimed the key, then failed: the key was forgotten, so the retry
    # runs instead of waiting forever on a result that will never come.
    good = httpx.post(gateway.url + "/v1/completions", headers=key,
                      json={"model": "no-such-model", "prompt": "x"})
    assert good.status_code == 404


@pytest.mark.parametrize("stream", [True, False])
def test_a_key_whose_gateway_died_before_the_first_token_runs_again_at_once(
    start_worker, start_gateway, stream: bool
) -> None:
    """Regression: the pending record outlived the gateway that claimed it by ~10 minutes:
    a streaming retry on another gateway waited 90 s for a stream that never began, then
    got 404, and a non-streaming one waited out its whole deadline. The claim now lives on
    ``:live``, which only a live owner renews."""
    worker = start_worker("idem-dies", sim_ttft_ms=3000, sim_token_ms=5)
    dying, other = start_gateway(), start_gateway()
    key = uuid.uuid4().hex
    body = {"model": "idem-dies", "prompt": "the first token never came", "max_tokens": 5, "ignore_eos": True,
            "stream": stream}

    def first_attempt() -> None:
        with contextlib.suppress(httpx.HTTPError):  # its gateway is killed under it
            httpx.post(dying.url + "/v1/completions", json=body, headers={"Idempotency-Key": key}, timeout=30)

    attempt = threading.Thread(target=first_attempt)
    attempt.start()
    wait_for(lambda: streaming(worker) == 1, 10, "the first attempt to reach the worker")
    dying.kill()
    attempt.join()
    if stream:  # nothing began: said at once, not after 90 s
        assert httpx.get(other.url + f"/v1/streams/{key}", timeout=20).status_code == 404
    retry = httpx.post(other.url + "/v1/completions", json=body, headers={"Idempotency-Key": key}, timeout=20)
    assert retry.status_code == 200, retry.text
    if stream:
        events = _events(retry.text.splitlines())
        assert events[-1][1] == "[DONE]" and not any('"error"' in d for _, d in events), events
        assert len([i for i, _ in events if i]) == 5
    else:
        assert retry.json()["usage"]["completion_tokens"] == 5


def test_a_gateway_that_stalled_past_its_claim_follows_the_retry_that_took_it(
    start_worker, start_gateway, redis_client
) -> None:
    """A claim is only as alive as its gateway: one stalled past ``:live``'s TTL before its
    first token (SIGSTOP here) loses the key to the client's retry on another gateway. When
    it wakes it must not start a second generation: its client follows the retry's stream."""
    worker = start_worker("idem-stall", sim_ttft_ms=2000, sim_token_ms=5)
    stalled, other = start_gateway(), start_gateway()
    key = {"Idempotency-Key": uuid.uuid4().hex}
    body = {"model": "idem-stall", "prompt": "stall before the first token", "max_tokens": 8, "ignore_eos": True,
            "stream": True}
    answers: dict[str, str] = {}

    def post(name: str, gateway) -> None:
        answers[name] = httpx.post(gateway.url + "/v1/completions", json=body, headers=key, timeout=30).text

    first = threading.Thread(target=post, args=("first", stalled))
    first.start()
    wait_for(lambda: streaming(worker) == 1, 10, "the first attempt to reach the worker")
    os.kill(stalled.pid, signal.SIGSTOP)
    record = keys.idempotency(scoped("-", key["Idempotency-Key"]))
    claimed_by = redis_client.hget(record, "owner")
    try:
        retry = threading.Thread(target=post, args=("retry", other))
        retry.start()
        wait_for(lambda: redis_client.hget(record, "owner") != claimed_by, 15, "the retry to claim the key")
    finally:
        os.kill(stalled.pid, signal.SIGCONT)
    first.join(30)
    retry.join(30)
    events = {name: _events(text.splitlines()) for name, text in answers.items()}
    assert events["first"] == events["retry"], "two generations for one key"
    assert events["retry"][-1][1] == "[DONE]" and len([i for i, _ in events["retry"] if i]) == 8
