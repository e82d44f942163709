"""Prefill/decode disaggregation through the gateway (gateway/relay/disagg.py), on role-aware
simulators (engine_worker/engines/sim_kv.py): a model with prefill and decode workers is
served by a pair of them, its output the aggregated output token for token."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import orjson
import pytest

from sluice import keys
from sluice.prefix import BLOCK_TOKENS
from tests.conftest import access_line, streaming, wait_for, worker_alive

PROMPT = "tell me about the sluice gates of the old canal"


def served(worker) -> int:
    """Streams the worker has finished, failed ones included."""
    return int(httpx.get(worker.url + "/health").json()["worker"]["served"])


@pytest.fixture(scope="module")
def gateway(start_gateway, start_worker):
    start_worker("pd-agg")  # the reference: one worker serving whole requests
    return start_gateway()


@pytest.fixture(scope="module")
def client(gateway):
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def reference(client: openai.OpenAI, max_tokens: int, prompt: str = PROMPT) -> str:
    return client.completions.create(model="pd-agg", prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].text


def test_a_pd_model_is_served_by_a_prefill_then_a_decode_worker(client, start_worker) -> None:
    prefill = start_worker("pd", role="prefill")
    decode = start_worker("pd", role="decode")
    for _ in range(2):
        got = client.completions.create(model="pd", prompt=PROMPT, max_tokens=12, temperature=0)
        assert got.choices[0].text == reference(client, 12)
        assert got.usage.completion_tokens == 12
        # The decode worker computed none of the prompt: its KV arrived from the prefill worker.
        assert got.usage.prompt_tokens_details.cached_tokens == got.usage.prompt_tokens
    chunks = client.chat.completions.create(model="pd", messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=9, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ref = client.chat.completions.create(model="pd-agg", messages=[{"role": "user", "content": PROMPT}],
                                         max_tokens=9)
    assert text == ref.choices[0].message.content
    assert served(prefill) == 3 and served(decode) == 3


def test_worker_roles_refuse_the_other_roles_hop_and_unknown_kv(start_worker) -> None:
    prefill = start_worker("pd-direct", role="prefill")
    decode = start_worker("pd-direct", role="decode")
    body = {"request_id": "r1", "model": "pd-direct", "prompt": PROMPT, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}
    lines = httpx.post(prefill.url + "/internal/generate", json=body).text.splitlines()
    params = orjson.loads(lines[-1])["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert httpx.post(decode.url + "/internal/generate", json=body).status_code == 400  # a prefill hop
    other = {**body, "prompt": PROMPT + " and more", "max_tokens": 3, "kv_transfer_params": params}
    refused = httpx.post(decode.url + "/internal/generate", json=other)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "kv_transfer_unknown"
    ok = httpx.post(decode.url + "/internal/generate", json={**other, "prompt": PROMPT})
    assert ok.status_code == 200 and orjson.loads(ok.text.splitlines()[-1])["finish_reason"] == "length"


def test_both_hops_are_retried_before_their_first_token(client, start_worker) -> None:
    """One prefill and one decode worker fail their first request (a worker 500): every
    request is still served, each failed hop retried on the other worker of its role."""
    prefills = [start_worker("pd-retry", role="prefill", sim_fail_first=1, sim_ttft_ms=150),
                start_worker("pd-retry", role="prefill", sim_ttft_ms=150)]
    decodes = [start_worker("pd-retry", role="decode", sim_fail_first=1, sim_token_ms=30),
               start_worker("pd-retry", role="decode", sim_token_ms=30)]
    expected = reference(client, 6)

    def one(_: int) -> str:
        return client.completions.create(model="pd-retry", prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text

    # Concurrent requests spread over both workers of each role (least-loaded routing), so
    # the failing ones are reached. ``served`` counts a worker's streams, failed ones too:
    # each role's workers ran one stream per request plus the one that failed.
    sent = 0
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for _ in range(6):
            assert list(pool.map(one, range(4))) == [expected] * 4
            sent += 4
            if served(prefills[0]) and served(decodes[0]):
                break
    assert served(prefills[0]) and served(decodes[0]), "the failing workers were never reached"
    assert sum(map(served, prefills)) == sent + 1 == sum(map(served, decodes))


def test_both_hops_are_bound_by_the_request_deadline(client, start_worker) -> None:
    start_worker("pd-slow-prefill", role="prefill", sim_ttft_ms=20_000)
    start_worker("pd-slow-prefill", role="decode")
    start_worker("pd-slow-kv", role="prefill")
    start_worker("pd-slow-kv", role="decode", sim_kv_transfer_ms_per_token=2_000)
    for model in ("pd-slow-prefill", "pd-slow-kv"):
        began = time.monotonic()
        with pytest.raises(openai.APIStatusError) as caught:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=4,
                                      extra_headers={"x-sluice-timeout-ms": "700"})
        assert caught.value.status_code == 504, (model, caught.value.response.text)
        assert time.monotonic() - began < 10, model  # the deadline, not the engine, ended it


def test_a_decode_workers_death_migrates_the_stream_token_exact(client, start_worker) -> None:
    prefill = start_worker("pd-mig", role="prefill")
    # Slow enough that the stream is still on its decode worker when the poll below looks,
    # on a loaded machine too (at 40 ms a token a CI run's stream ended first).
    decodes = [start_worker("pd-mig", role="decode", sim_token_ms=150) for _ in range(2)]
    expected = reference(client, 40)
    stream = client.completions.create(model="pd-mig", prompt=PROMPT, max_tokens=40, temperature=0, stream=True)
    pieces = []
    for chunk in stream:
        pieces.append(chunk.choices[0].text if chunk.choices else "")
        if len(pieces) == 5:
            wait_for(lambda: any(streaming(d) for d in decodes), 5, "the decode stream")
            (serving,) = [d for d in decodes if streaming(d)]
            serving.kill()
    assert "".join(pieces) == expected
    # The migration prefilled the prompt and the tokens sent on the prefill worker again.
    assert served(prefill) == 2
    survivor = next(d for d in decodes if d is not serving)
    assert served(survivor) == 1


def test_a_model_whose_prefill_workers_all_died_is_served_whole(client, start_worker, redis_client) -> None:
    """Not a 503: once no live prefill worker is left, the decode workers serve whole requests."""
    prefill = start_worker("pd-orphan", role="prefill")
    decode = start_worker("pd-orphan", role="decode")
    expected = reference(client, 5)
    assert client.completions.create(model="pd-orphan", prompt=PROMPT, max_tokens=5).choices[0].text == expected
    prefill.kill()
    wait_for(lambda: not worker_alive(redis_client, "pd-orphan", prefill.name), 5, "the heartbeat to lapse")
    got = client.completions.create(model="pd-orphan", prompt=PROMPT, max_tokens=5)
    assert got.choices[0].text == expected
    assert got.usage.prompt_tokens_details.cached_tokens == 0  # computed there: no KV arrived
    assert served(decode) == 2


def test_a_client_leaving_during_the_prefill_hop_gets_no_decode_hop(gateway, start_worker, redis_client) -> None:
    """Regression: a client gone during its prefill hop was still given a decode slot and a
    decode stream (a whole request notices a departure only at its first token)."""
    prefill = start_worker("pd-leave", role="prefill", sim_ttft_ms=2_000)
    decode = start_worker("pd-leave", role="decode")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway.url + "/v1/completions", timeout=httpx.Timeout(5, read=0.5),
                   json={"model": "pd-leave", "prompt": PROMPT, "max_tokens": 4})
    wait_for(lambda: streaming(prefill) == 0, 5, "the prefill hop to be cancelled")
    wait_for(lambda: int(redis_client.hget(keys.inflight("pd-leave"), prefill.name) or 0) == 0, 5,
             "the prefill slot to be released")
    assert served(decode) == 0


def charged(redis_client, model: str) -> int:
    """What the model's fair queuing has charged its tenants, summed (finish tags ``F:``)."""
    fair = redis_client.hgetall(keys.admission(model).fair)
    return sum(int(float(v)) for k, v in fair.items() if k.startswith(b"F:"))


def released(redis_client, model: str) -> bool:
    return all(int(v) == 0 for v in redis_client.hgetall(keys.inflight(model)).values())


def test_a_pd_requests_output_counts_toward_its_tenants_fair_share_once(client, start_worker, redis_client) -> None:
    """Regression: the decode hop, admitted boosted (charged nothing), never corrected the
    tenant's fair share with its usage: a P/D request counted its prompt and the prefill's
    one token, not its output. It now counts what an aggregated request counts: its
    prompt and its output tokens, once."""
    start_worker("pd-fair-whole")
    start_worker("pd-fair", role="prefill")
    start_worker("pd-fair", role="decode")
    for model in ("pd-fair-whole", "pd-fair"):
        got = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0)
        assert got.usage.completion_tokens == 20
        wait_for(lambda: released(redis_client, model), 5, f"{model}'s leases to be released")
        assert charged(redis_client, model) == got.usage.prompt_tokens + 20, model


def test_a_pd_request_reports_both_workers_and_the_prefill_hops_route(gateway, start_worker) -> None:
    """Regression: the decode hop's admission overwrote the prefill hop's routing facts (its
    prompt is not routed on: 0 matched blocks of 0), and the access line listed the two
    hops' workers as one list, as if the first had failed. Now the prefill hop's route
    stands and each hop's worker is named for its role."""
    prefill = start_worker("pd-route", role="prefill")
    decode = start_worker("pd-route", role="decode")
    prompt = " ".join(f"w{i}" for i in range(3 * BLOCK_TOKENS))
    fields: dict = {}
    for _ in range(2):  # the second is routed onto the blocks the first left on the prefill worker
        resp = httpx.post(gateway.url + "/v1/completions", json={"model": "pd-route", "prompt": prompt, "max_tokens": 3},
                          timeout=30)
        assert resp.status_code == 200, resp.text
        fields = access_line(gateway, resp.headers["x-request-id"])
    assert (fields["route_matched_blocks"], fields["route_prompt_blocks"]) == (3, 3)
    assert (fields["workers"], fields["prefill_workers"]) == (decode.name, prefill.name)
