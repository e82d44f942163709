"""``--engine openai``: a worker fronting an OpenAI-compatible server, here the peers
benchmark's mock (loadtest/peers/mock_openai.py) in its vLLM-like and generic modes,
through a real gateway with the real ``openai`` SDK."""

from __future__ import annotations

import sys

import httpx
import openai
import pytest

from engine_worker.engines.openai_upstream import parse_metrics, upstream_error
from loadtest.peers.mock_openai import chat_template, detokenize, embedding, next_token, score, tokenize
from sluice import keys
from tests.conftest import ROOT, Proc, start_on_a_free_port, wait_for, worker_alive

MOCK = ROOT / "loadtest" / "peers" / "mock_openai.py"


@pytest.fixture(scope="module")
def start_mock(procs, tmp_path_factory):
    logs = tmp_path_factory.mktemp("mock-logs")

    def start(*flags: str) -> Proc:
        def launch(port: int) -> Proc:
            proc = Proc(f"mock-{port}", [sys.executable, str(MOCK), "--port", str(port), *flags],
                        logs / f"mock-{port}.log", {"PYTHONUNBUFFERED": "1"})
            proc.url = f"http://127.0.0.1:{port}"
            return proc

        return start_on_a_free_port(procs, launch, 30)

    return start


@pytest.fixture(scope="module")
def mocks(start_mock):
    """Two vLLM-like servers (migration needs a second one) and one generic server."""
    return {"vllm": [start_mock("--vllm"), start_mock("--vllm")], "generic": start_mock()}


@pytest.fixture(scope="module")
def gateway(mocks, start_worker, start_gateway):
    for mock in mocks["vllm"]:
        start_worker("mockv", engine="openai", upstream_url=mock.url, upstream_poll_ms=100)
    start_worker("mockg", engine="openai", upstream_url=mocks["generic"].url, upstream_poll_ms=100)
    # A migration with no worker left to take it waits 2 s, not 15, before its in-band error.
    return start_gateway(env={"SLUICE_GATEWAY_MIGRATION_WAIT_S": "2"})


@pytest.fixture(scope="module")
def relay() -> dict[str, str]:
    """Extra flags for workers a test starts itself: here the worker relays the streams."""
    return {}


@pytest.fixture
def client(gateway):
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=30) as c:
        yield c


def reference(prompt_ids: list[int], count: int, seed: int = 0) -> str:
    """The mock's greedy continuation of ``prompt_ids``: ``count`` tokens, end-of-sequence ignored."""
    ids = list(prompt_ids)
    for _ in range(count):
        ids.append(next_token(seed, ids)[0])
    return detokenize(ids[len(prompt_ids):])


def received(mock: Proc) -> list[dict]:
    return httpx.get(mock.url + "/mock/requests").json()


def test_chat_stream_through_the_gateway_matches_the_server(client) -> None:
    messages = [{"role": "user", "content": "tell me about sluice gates"}]
    stream = client.chat.completions.create(model="mockv", messages=messages, max_tokens=20, stream=True,
                                            extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference(tokenize(chat_template(messages)), 20)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 20
    assert usage.prompt_tokens == len(tokenize(chat_template(messages)))


def test_text_completion_and_generic_server(client) -> None:
    for model in ("mockv", "mockg"):
        resp = client.completions.create(model=model, prompt="the canal lock", max_tokens=7,
                                         extra_body={"ignore_eos": True})
        assert resp.choices[0].text == reference(tokenize("the canal lock"), 7)
        assert resp.choices[0].finish_reason == "length"
        assert resp.usage.completion_tokens == 7


def test_priority_and_token_ids_are_passed_on(client, mocks) -> None:
    client.completions.create(model="mockv", prompt="priority probe alpha", max_tokens=2,
                              extra_body={"priority": -3})
    bodies = [b for m in mocks["vllm"] for b in received(m) if b.get("prompt") == "priority probe alpha"]
    assert len(bodies) == 1
    assert bodies[0]["priority"] == -3 and bodies[0]["return_token_ids"] is True


def test_a_short_answer_taken_whole_is_asked_of_the_server_whole(client, mocks) -> None:
    """A non-streaming request for a few tokens is one JSON answer from the server (one body
    for it to make, not a chunk per token and one for usage); a stream, a longer answer and
    an answer with logprobs are streamed from it, as before."""
    probes = {"whole probe short": {"max_tokens": 5}, "whole probe long": {"max_tokens": 17},
              "whole probe logprobs": {"max_tokens": 5, "logprobs": 1}}
    for prompt, more in probes.items():
        answer = client.completions.create(model="mockv", prompt=prompt, extra_body={"ignore_eos": True}, **more)
        assert answer.choices[0].text == reference(tokenize(prompt), more["max_tokens"])
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(tokenize(prompt)),
                                                                                more["max_tokens"])
    stream = client.completions.create(model="mockv", prompt="whole probe stream", max_tokens=5, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == reference(tokenize("whole probe stream"), 5)
    asked = {b["prompt"]: b for m in mocks["vllm"] for b in received(m) if str(b.get("prompt")).startswith("whole")}
    assert (asked["whole probe short"]["stream"], asked["whole probe short"].get("stream_options")) == (False, None)
    assert asked["whole probe short"]["return_token_ids"] is True  # the answer's ids, for the bill and the record
    assert [asked[p]["stream"] for p in ("whole probe long", "whole probe logprobs", "whole probe stream")] == [True] * 3


def test_a_server_that_refuses_priority_is_asked_without_it(client, mocks) -> None:
    resp = client.completions.create(model="mockg", prompt="priority probe beta", max_tokens=2,
                                     extra_body={"priority": 5})
    assert resp.choices[0].text
    bodies = [b for b in received(mocks["generic"]) if b.get("prompt") == "priority probe beta"]
    assert [b.get("priority") for b in bodies] == [5, None]
    assert "return_token_ids" not in bodies[0]


def test_upstream_refusals_are_openai_errors(client) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="mockv", prompt="word " * 5000, max_tokens=2)
    assert caught.value.code == "context_length_exceeded"
    assert "maximum context length" in caught.value.message


def test_a_server_dying_mid_stream_migrates_token_exactly(client, mocks) -> None:
    """The first server breaks its stream after 3 tokens; the other continues from
    the server-tokenized prompt + the 3 tokens as a token prompt, with no gap or repeat."""
    messages = [{"role": "user", "content": "MOCK_FAIL_MIDWAY then go on"}]
    stream = client.chat.completions.create(model="mockv", messages=messages, max_tokens=12, stream=True,
                                            extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == reference(tokenize(chat_template(messages)), 12)
    resumed = [b for m in mocks["vllm"] for b in received(m) if isinstance(b.get("prompt"), list)]
    assert resumed and resumed[-1]["max_tokens"] == 9


def test_migration_onto_a_server_without_token_ids_is_refused(client) -> None:
    """Only one generic server and it breaks mid-stream: the stream ends with one in-band error."""
    stream = client.completions.create(model="mockg", prompt="MOCK_FAIL_MIDWAY generic", max_tokens=12,
                                       stream=True, extra_body={"ignore_eos": True})
    with pytest.raises(openai.APIError):
        list(stream)


def test_client_disconnect_cancels_the_upstream_stream(gateway, mocks) -> None:
    def streams_at_mocks() -> int:
        return sum(parse_metrics(httpx.get(m.url + "/metrics").content).running for m in mocks["vllm"])

    body = {"model": "mockv", "prompt": "long one", "stream": True, "max_tokens": 2000, "ignore_eos": True}
    with httpx.Client(base_url=gateway.url, timeout=30) as http, http.stream("POST", "/v1/completions",
                                                                               json=body) as resp:
        lines = resp.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        assert streams_at_mocks() == 1
    wait_for(lambda: streams_at_mocks() == 0, 10, "the upstream stream to be closed")


def test_an_unhealthy_server_takes_its_worker_out_of_routing(gateway, mocks, redis_client) -> None:
    generic = mocks["generic"]
    worker_id = next(w.decode() for w in redis_client.hkeys(keys.workers("mockg")))
    httpx.post(generic.url + "/health", json={"ok": False})
    try:
        wait_for(lambda: not worker_alive(redis_client, "mockg", worker_id), 10, "the heartbeat to stop")
    finally:
        httpx.post(generic.url + "/health", json={"ok": True})
    wait_for(lambda: worker_alive(redis_client, "mockg", worker_id), 10, "the heartbeat to resume")
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
        assert client.completions.create(model="mockg", prompt="back again", max_tokens=2).choices[0].text


@pytest.mark.parametrize("shape", ["finish", "every"])
def test_usage_in_the_finishing_chunk_is_not_dropped(start_mock, start_worker, client, relay, shape) -> None:
    """Regression: a server that sends ``usage`` beside ``finish_reason`` (``finish``), or
    running totals in every chunk (``every``), had it dropped: prompt tokens 0 and, from a
    server without token ids, completion tokens 0, so the key's TPM was settled low. Its
    siblings: usage in a chunk with content, and n=2 (one server request per choice)."""
    mock = start_mock(f"--usage={shape}")  # generic: completion tokens come from usage alone
    model = f"usage-{shape}"
    start_worker(model, engine="openai", upstream_url=mock.url, upstream_poll_ms=100, **relay)
    messages = [{"role": "user", "content": "count what I cost"}]
    prompt = len(tokenize(chat_template(messages)))
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=9, stream=True,
                                            extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True})
    usage = list(stream)[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (prompt, 9)
    resp = client.chat.completions.create(model=model, messages=messages, max_tokens=9, n=2,
                                          extra_body={"ignore_eos": True})
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (prompt, 18)


def test_a_prefill_decode_pair_passes_kv_transfer_params_through(start_mock, start_worker, client, relay) -> None:
    """Regression: an ``openai`` worker dropped ``kv_transfer_params`` both ways: its server
    was never asked to keep a prefill's KV for a remote decode, nor gave back where it was
    (vLLM returns them in a whole answer, not in a stream), so the decode server got none
    and computed the prompt itself. The prefill server now gets ``do_remote_decode`` in a
    whole request, and the decode server what it returned."""
    prefill, decode = start_mock("--vllm"), start_mock("--vllm")
    for mock, role in ((prefill, "prefill"), (decode, "decode")):
        start_worker("mock-pd", engine="openai", upstream_url=mock.url, upstream_poll_ms=100, role=role, **relay)
    prompt = "the prefill server hands its cache over"
    resp = client.completions.create(model="mock-pd", prompt=prompt, max_tokens=7, extra_body={"ignore_eos": True})
    assert resp.choices[0].text == reference(tokenize(prompt), 7)
    assert resp.usage.prompt_tokens_details.cached_tokens == len(tokenize(prompt))  # the KV arrived
    (asked,) = received(prefill)
    assert (asked["kv_transfer_params"]["do_remote_decode"], asked["stream"], asked["max_tokens"]) == (True, False, 1)
    (decoded,) = received(decode)
    assert decoded["kv_transfer_params"]["do_remote_prefill"] is True
    assert decoded["kv_transfer_params"]["remote_port"] == int(prefill.url.rsplit(":", 1)[1])


def test_vllm_metrics_become_engine_stats() -> None:
    text = (b'# HELP x\nvllm:num_requests_running{model_name="m",engine="0"} 3.0\n'
            b'vllm:num_requests_running{model_name="m",engine="1"} 2.0\n'
            b'vllm:num_requests_waiting{model_name="m"} 4.0\nvllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
            b'vllm:prefix_cache_queries_total{model_name="m"} 100.0\nvllm:prefix_cache_hits_total 40.0\n')
    stats = parse_metrics(text)
    assert stats is not None
    assert (stats.running, stats.waiting, stats.kv_usage, stats.prefix_queries, stats.prefix_hits) == (5, 4, 0.25, 100, 40)
    assert parse_metrics(b"# nothing of vLLM's\nfoo 1\n") is None


def test_error_mapping() -> None:
    assert upstream_error(400, b'{"error": {"message": "bad"}}').status == 400
    assert upstream_error(404, b'{"detail": "no such model"}').status == 404
    assert upstream_error(503, b"garbage").status == 503
    assert upstream_error(429, b"{}").status == 503  # another worker may have room


def test_count_tokens_is_the_servers_own_count(gateway) -> None:
    """Anthropic's count_tokens: a vLLM-like server's own /tokenize (its chat template);
    a server without one is a clear 400, not a retry on every worker."""
    messages = [{"role": "user", "content": "how many tokens is this"}]
    r = httpx.post(gateway.url + "/v1/messages/count_tokens", json={"model": "mockv", "messages": messages},
                   timeout=30)
    assert r.status_code == 200, r.text
    assert r.json() == {"input_tokens": len(tokenize(chat_template(messages)))}
    r = httpx.post(gateway.url + "/v1/messages/count_tokens", json={"model": "mockg", "messages": messages},
                   timeout=30)
    assert r.status_code == 400 and "cannot count tokens" in r.json()["error"]["message"], r.text


def test_embeddings_scores_and_tokens_pass_through(mocks, start_worker, gateway) -> None:
    """``--task embed`` in front of a server with a pooling model: embeddings, scores (the
    server's own, not a cosine) and tokens are the server's; a server without a route is a
    400 naming it."""
    start_worker("mocke", engine="openai", task="embed", upstream_url=mocks["vllm"][0].url, upstream_poll_ms=100)
    start_worker("mockge", engine="openai", task="embed", upstream_url=mocks["generic"].url, upstream_poll_ms=100)
    texts = ["alpha beta gamma", "beta gamma delta"]
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=30) as sdk:
        got = sdk.embeddings.create(model="mocke", input=texts, encoding_format="float")
        assert [d.embedding for d in got.data] == [embedding(t) for t in texts]
        assert got.usage.prompt_tokens == 6
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.embeddings.create(model="mocke", input="x", dimensions=4)
        assert "Matryoshka" in refused.value.message
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        ranked = http.post("/v1/rerank", json={"model": "mocke", "query": texts[0], "documents": [texts[1], texts[0]]})
        assert [(r["index"], r["relevance_score"]) for r in ranked.json()["results"]] == [
            (1, 1.0), (0, score(texts[0], texts[1]))]
        tokens = http.post("/tokenize", json={"model": "mocke", "prompt": texts[0]}).json()
        assert tokens["tokens"] == tokenize(texts[0]) and tokens["max_model_len"] == 4096
        generic = http.post("/v1/score", json={"model": "mockge", "text_1": "a", "text_2": "b"})
        assert generic.status_code == 400 and "/score" in generic.json()["error"]["message"]


def test_every_field_a_server_can_honour_reaches_it(client, mocks) -> None:
    """min_p, logit_bias and response_format reach the server as OpenAI (and vLLM) name
    them; they were dropped on the way, and the answer ignored them silently."""
    schema = {"type": "object", "properties": {"w": {"type": "string"}}}
    client.chat.completions.create(
        model="mockv", messages=[{"role": "user", "content": "fields probe"}], max_tokens=3,
        logit_bias={"17": -5}, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        extra_body={"min_p": 0.1})
    (body,) = [b for m in mocks["vllm"] for b in received(m) if "fields probe" in str(b.get("messages"))]
    assert (body["min_p"], body["logit_bias"]) == (0.1, {"17": -5})
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}


def test_token_prompts_and_echo_reach_the_server(client, mocks) -> None:
    """A token-id prompt is sent as one (it was sent as ""), and ``echo`` puts the prompt
    before the completion (it was dropped): as text, or a token prompt detokenized by the server."""
    ids = tokenize("token prompt probe")
    answer = client.completions.create(model="mockv", prompt=ids, max_tokens=4, extra_body={"ignore_eos": True})
    assert answer.choices[0].text == reference(ids, 4)
    assert [b["prompt"] for m in mocks["vllm"] for b in received(m) if b.get("prompt") == ids] == [ids]
    echoed = client.completions.create(model="mockv", prompt="echo probe", max_tokens=4, echo=True,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == "echo probe" + reference(tokenize("echo probe"), 4)
    stream = client.completions.create(model="mockv", prompt=ids, max_tokens=4, echo=True, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == detokenize(ids) + reference(ids, 4)


def test_tool_calls_of_the_server_reach_the_client(client, mocks) -> None:
    """``tools`` and ``tool_choice`` reach the server (they were dropped: the model answered
    in text), and its calls come back as calls, whole and streamed."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "call a tool"}]
    expected = '{"words": "' + reference(tokenize(chat_template(messages)), 5).strip() + '"}'
    whole = client.chat.completions.create(model="mockv", messages=messages, max_tokens=5, tools=tools,
                                           tool_choice={"type": "function", "function": {"name": "lookup"}},
                                           extra_body={"ignore_eos": True})
    (call,) = whole.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("lookup", expected)
    assert whole.choices[0].finish_reason == "tool_calls"
    stream = client.chat.completions.create(model="mockv", messages=messages, max_tokens=5, tools=tools,
                                            tool_choice="required", stream=True, extra_body={"ignore_eos": True})
    pieces = [d for c in stream if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert pieces[0].function.name == "lookup" and pieces[0].id
    assert "".join(p.function.arguments or "" for p in pieces) == expected
    bodies = [b for m in mocks["vllm"] for b in received(m) if b.get("messages") == messages]
    assert [b["tool_choice"] for b in bodies] == [{"type": "function", "function": {"name": "lookup"}}, "required"]
    assert all(b["tools"] == tools for b in bodies)
