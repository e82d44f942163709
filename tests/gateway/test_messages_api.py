"""The Anthropic Messages API with the official ``anthropic`` SDK against a real gateway
and sim workers: text and tools, streamed and not, stop sequences, token counting,
errors in Anthropic's shape (the gateway's own admission errors included), both ways of
sending the key, and a resumable stream."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import anthropic
import httpx
import pytest

from sluice.embedded_redis import EmbeddedRedis
from tests.conftest import ROOT, streaming

MODEL = "msim"
SLOW = "mslow"
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _create_key(redis_url: str, *flags: str) -> str:
    result = subprocess.run([sys.executable, "-m", "sluice", "keys", "create", "--name", "messages", *flags,
                             "--redis-url", redis_url], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.fixture(scope="module")
def messages_redis():
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture(scope="module")
def stack(messages_redis, start_worker, start_gateway):
    start_worker(MODEL, redis_at=messages_redis, sim_token_ms=0, sim_ttft_ms=0)
    start_worker(SLOW, redis_at=messages_redis, sim_token_ms=100, sim_ttft_ms=0)
    # The keys first: a gateway that starts with keys enforces them at once.
    key, limited = _create_key(messages_redis), _create_key(messages_redis, "--rpm", "1")
    gateway = start_gateway(redis_at=messages_redis)
    return gateway.url, key, limited


@pytest.fixture
def client(stack) -> anthropic.Anthropic:
    url, key, _ = stack
    with anthropic.Anthropic(base_url=url, api_key=key, max_retries=0) as c:
        yield c


def _events(url: str, key: str, body: dict[str, object], headers: dict[str, str] | None = None) -> list[str]:
    """Raw SSE lines of a streamed message (names and data, no blank lines)."""
    with httpx.stream("POST", f"{url}/v1/messages", json={**body, "stream": True},
                      headers={"x-api-key": key, **(headers or {})}, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        return [line for line in resp.iter_lines() if line]


def test_a_message_has_anthropic_shape_and_usage(client) -> None:
    message = client.messages.create(model=MODEL, max_tokens=5, system="Be brief.", messages=ASK,
                                     metadata={"user_id": "u-1"},
                                     # This SDK no longer names the sampling fields; the API still takes them.
                                     extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 40})
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL and message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert [block.type for block in message.content] == ["text"] and message.content[0].text.strip()
    assert message.usage.output_tokens == 5
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens > 0


def test_a_stream_follows_anthropic_event_sequence(stack, client) -> None:
    url, key, _ = stack
    body = {"model": MODEL, "max_tokens": 6, "messages": ASK}
    names = [line.removeprefix("event: ") for line in _events(url, key, body) if line.startswith("event: ")]
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    with client.messages.stream(**body) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].text == text == client.messages.create(**body).content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens > 0, "message_delta carries input usage"


def test_no_done_marker_reaches_an_anthropic_stream(stack) -> None:
    url, key, _ = stack
    lines = _events(url, key, {"model": MODEL, "max_tokens": 3, "messages": ASK})
    assert lines[-2:] == ["event: message_stop", 'data: {"type":"message_stop"}']
    assert not any("[DONE]" in line for line in lines)


def test_tool_use_round_trip(client) -> None:
    forced = client.messages.create(model=MODEL, max_tokens=200, messages=ASK, tools=[WEATHER],
                                    tool_choice={"type": "tool", "name": "get_weather"})
    assert forced.stop_reason == "tool_use"
    (call,) = [block for block in forced.content if block.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input, dict) and "city" in call.input
    with client.messages.stream(model=MODEL, max_tokens=200, messages=ASK, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in streamed.content if b.type == "tool_use"] == \
        [("tool_use", call.name, call.input)]
    answer = client.messages.create(model=MODEL, max_tokens=8, tools=[WEATHER], messages=[
        *ASK,
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, call.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"},
                                     {"type": "text", "text": "Thanks!"}]},
    ])
    assert answer.content[0].type == "text" and answer.content[0].text


def test_streamed_tool_use_events(stack) -> None:
    url, key, _ = stack
    lines = _events(url, key, {"model": MODEL, "max_tokens": 200, "messages": ASK, "tools": [WEATHER],
                               "tool_choice": {"type": "any"}})
    assert any('"type":"tool_use"' in line and "content_block_start" in line for line in lines)
    assert any('"input_json_delta"' in line for line in lines)
    assert any('"stop_reason":"tool_use"' in line for line in lines)


def test_stop_sequences_end_with_stop_sequence(client) -> None:
    body = {"model": MODEL, "max_tokens": 12, "messages": ASK}
    words = client.messages.create(**body).content[0].text.split()
    stop = words[5]
    stopped = client.messages.create(**body, stop_sequences=[stop])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stop not in stopped.content[0].text and stopped.content[0].text.split() == words[:5]
    with client.messages.stream(**body, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert client.messages.create(**body, stop_sequences=["never-generated"]).stop_reason == "max_tokens"


def test_output_config_format_is_structured_output(client) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    message = client.messages.create(model=MODEL, max_tokens=200, messages=ASK,
                                     output_config={"format": {"type": "json_schema", "schema": schema}})
    answer = json.loads(message.content[0].text)
    assert set(answer) == {"city", "sunny"} and isinstance(answer["sunny"], bool)


def test_count_tokens_is_the_prompt_the_worker_counts(client) -> None:
    body = {"model": MODEL, "messages": ASK, "system": "Be brief.", "tools": [WEATHER]}
    counted = client.messages.count_tokens(**body)
    used = client.messages.create(**body, max_tokens=1).usage
    assert counted.input_tokens == used.input_tokens + used.cache_read_input_tokens > 0
    longer = client.messages.count_tokens(**{**body, "messages": [{"role": "user", "content": "one two three " * 10}]})
    assert longer.input_tokens > counted.input_tokens


def test_both_auth_headers_are_accepted_and_a_bad_key_is_401(stack) -> None:
    url, key, _ = stack
    with anthropic.Anthropic(base_url=url, auth_token=key, max_retries=0) as bearer:  # Authorization: Bearer
        assert bearer.messages.create(model=MODEL, max_tokens=2, messages=ASK).content
    r = httpx.post(f"{url}/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": ASK},
                   headers={"x-api-key": key, "anthropic-version": "2023-06-01"}, timeout=30)
    assert r.status_code == 200 and r.json()["type"] == "message"
    with anthropic.Anthropic(base_url=url, api_key="sk-sluice-wrong", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError) as err:
            wrong.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    assert err.value.status_code == 401
    assert err.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                         "message": err.value.body["error"]["message"]}}
    missing = httpx.post(f"{url}/v1/messages/count_tokens", json={"model": MODEL, "messages": ASK}, timeout=30)
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(("body", "status", "kind", "says"), [
    ({"model": MODEL, "messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     400, "invalid_request_error", "image content blocks are not supported"),
    ({"model": "no-such-model", "max_tokens": 5, "messages": ASK}, 404, "not_found_error", "no-such-model"),
    ({"model": MODEL, "max_tokens": 5, "messages": [*ASK, {"role": "assistant", "content": "Well,"}]},
     400, "invalid_request_error", "prefill"),
    ({"model": MODEL, "max_tokens": 5, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 1024}},
     400, "invalid_request_error", "thinking"),
    ({"model": MODEL, "max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305",
                                                                   "name": "web_search"}]},
     400, "invalid_request_error", "server tools"),
    ({"model": MODEL, "max_tokens": 5, "messages": ASK, "temperature": 1.5}, 400, "invalid_request_error",
     "temperature"),
    ({"model": MODEL, "max_tokens": 5, "messages": ASK, "output_config": {"effort": "high"}}, 400,
     "invalid_request_error", "effort levels are not supported"),
])
def test_bad_input_is_an_anthropic_error(stack, body, status, kind, says) -> None:
    url, key, _ = stack
    r = httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": key}, timeout=30)
    assert r.status_code == status, r.text
    assert r.json() == {"type": "error", "error": {"type": kind, "message": r.json()["error"]["message"]}}
    assert says in r.json()["error"]["message"]


def test_the_sdk_raises_its_own_errors(client) -> None:
    with pytest.raises(anthropic.BadRequestError, match="image content blocks are not supported"):
        client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=5, messages=ASK)


def test_route_errors_are_anthropic_shaped(stack) -> None:
    url, key, _ = stack
    r = httpx.get(f"{url}/v1/messages", headers={"x-api-key": key}, timeout=30)
    assert r.status_code == 405 and r.json()["type"] == "error"
    r = httpx.post(f"{url}/v1/messages", content=b"{not json", headers={"x-api-key": key}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_rate_limit_is_429_with_retry_after(stack) -> None:
    url, _, limited = stack
    with anthropic.Anthropic(base_url=url, api_key=limited, max_retries=0) as c:
        c.messages.create(model=MODEL, max_tokens=2, messages=ASK)
        with pytest.raises(anthropic.RateLimitError) as err:
            c.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    assert err.value.body["error"]["type"] == "rate_limit_error"
    assert int(err.value.response.headers["retry-after"]) >= 1


def test_a_deadline_mid_stream_is_an_in_band_error_event(stack) -> None:
    url, key, _ = stack
    body = {"model": SLOW, "max_tokens": 100, "messages": ASK}
    lines = _events(url, key, body, {"x-sluice-timeout-ms": "600"})
    assert lines[0] == "event: message_start" and "event: error" in lines
    error = lines[lines.index("event: error") + 1]
    assert error.startswith('data: {"type":"error","error":{"type":"timeout_error"')
    assert not any("[DONE]" in line for line in lines)
    with anthropic.Anthropic(base_url=url, api_key=key, max_retries=0,
                             default_headers={"x-sluice-timeout-ms": "600"}) as c:
        with pytest.raises(anthropic.APIStatusError, match="timeout_error"):
            with c.messages.stream(**body) as stream:
                for _ in stream.text_stream:
                    pass


def test_a_deadline_before_the_first_token_is_504_timeout_error(stack) -> None:
    url, key, _ = stack
    r = httpx.post(f"{url}/v1/messages", json={"model": SLOW, "max_tokens": 5, "messages": ASK},
                   headers={"x-api-key": key, "x-sluice-timeout-ms": "1"}, timeout=30)
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"


def test_a_resumable_stream_reattaches_with_its_idempotency_key(stack) -> None:
    url, key, _ = stack
    idem = {"Idempotency-Key": "messages-" + uuid.uuid4().hex}
    body = {"model": MODEL, "max_tokens": 6, "messages": ASK}
    first = _events(url, key, body, idem)
    assert first[0].startswith("id: ") and first[1] == "event: message_start"
    assert first[-2:] == ["event: message_stop", 'data: {"type":"message_stop"}']
    # The same request again, from after event 3: the rest of the one generation.
    again = _events(url, key, body, {**idem, "Last-Event-ID": "3"})
    cut = next(i for i, line in enumerate(first) if line.startswith("id: 4."))
    assert again == first[cut:]
    assert not any("[DONE]" in line for line in first + again)


def test_a_stream_migrates_when_its_worker_dies(stack, client, messages_redis, start_worker) -> None:
    """Migration is the chat path's: the worker dies mid-stream, the other one continues it,
    and the client's text is the uninterrupted generation's, with no error event."""
    model = "mmig"
    # 100 ms a token: at 40 a loaded CI run's client read its third piece after the whole
    # 1.2 s stream had ended, and no worker was serving it any more.
    workers = [start_worker(model, redis_at=messages_redis, sim_token_ms=100, sim_ttft_ms=0) for _ in range(2)]
    body = {"model": model, "max_tokens": 30, "messages": [{"role": "user", "content": "Tell me about locks."}]}
    reference = client.messages.create(**body)
    assert reference.usage.output_tokens == 30, "a natural end before 30 tokens would test nothing"
    pieces: list[str] = []
    killed = []
    with client.messages.stream(**body) as stream:
        for piece in stream.text_stream:
            pieces.append(piece)
            if len(pieces) == 3:
                (serving,) = [w for w in workers if streaming(w) == 1]
                serving.kill()
                killed.append(serving)
        final = stream.get_final_message()
    assert killed and "".join(pieces) == reference.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 30)


async def test_journal_errors_and_done_are_rewritten_for_anthropic_clients() -> None:
    """A resumable stream's journal ends readers with OpenAI-shaped errors and ``[DONE]``
    (gateway/streams/journal.py); a Messages client gets ``event: error`` and no [DONE]."""
    from gateway.streams.event_ids import frame
    from gateway.streams.journal import DONE, history_lost, producer_gone
    from gateway.surfaces.messages import anthropic_frames

    async def journal():
        yield frame(1, b'event: ping\ndata: {"type":"ping"}\n\n')
        yield history_lost(1, 5)
        yield producer_gone()
        yield DONE

    out = [f async for f in anthropic_frames(journal())]
    assert out[0] == b'id: 1\nevent: ping\ndata: {"type":"ping"}\n\n'
    assert out[1].startswith(b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"events 2..4')
    assert out[2].startswith(b'event: error\ndata: {"type":"error","error":{"type":"api_error"')
    assert len(out) == 3


def test_tool_results_keep_their_place_in_the_conversation() -> None:
    from gateway.surfaces.messages import MessagesRequest

    req = MessagesRequest.model_validate({"model": MODEL, "max_tokens": 5, "system": [
        {"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}], "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "text", "text": "Here:"},
                                     {"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "Sunny"}]},
                                     {"type": "text", "text": "Thanks"}]}]})
    chat = req.to_chat()
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief.\nUse tools."), ("user", "Weather?"), ("assistant", None), ("user", "Here:"),
        ("tool", "Sunny"), ("user", "Thanks")]
    call = chat.messages[2].tool_calls[0]
    assert (call.id, call.function.name, call.function.arguments) == ("t1", "get_weather", '{"city":"Paris"}')
    assert chat.messages[4].tool_call_id == "t1"


@pytest.mark.parametrize(("block", "says"), [
    ({"type": "tool_result", "tool_use_id": ["toolu_1"], "content": "Sunny"}, "tool_use_id"),
    ({"type": "tool_result", "content": "Sunny"}, "tool_use_id"),
])
def test_a_tool_result_without_a_string_tool_use_id_is_refused(stack, block, says) -> None:
    """Regression: a tool_result's ``tool_use_id`` went through ``str()``: a list became the
    call id "['toolu_1']" and a missing one "", and the request was generated."""
    url, key, _ = stack
    body = {"model": MODEL, "max_tokens": 2, "messages": [
        *ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                 "input": {"city": "Paris"}}]},
        {"role": "user", "content": [block]}]}
    r = httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": key}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and says in r.json()["error"]["message"]


def test_a_tool_use_without_a_string_id_is_refused(stack) -> None:
    """Regression: an assistant tool_use block with no ``id`` became a tool call with id ""."""
    url, key, _ = stack
    body = {"model": MODEL, "max_tokens": 2, "messages": [
        *ASK, {"role": "assistant", "content": [{"type": "tool_use", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}]}]}
    r = httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": key}, timeout=30)
    assert r.status_code == 400, r.text
    assert "messages.1.content.0" in r.json()["error"]["message"] and "id" in r.json()["error"]["message"]


@pytest.mark.parametrize(("body", "message"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice: type 'tool' needs the tool's name"),
    ({"messages": [{"role": "user", "content": [1]}]},
     "messages.0.content.0: Input should be a valid dictionary"),
    ({"system": 5}, "system: Input should be a valid string"),
])
def test_validation_messages_name_the_field_once(stack, body, message) -> None:
    """Regression: a nested validator's message named its field again ("tool_choice:
    tool_choice: ..."), and a union's error named pydantic's branch ("messages.0.content.str")."""
    url, key, _ = stack
    r = httpx.post(f"{url}/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": ASK, **body},
                   headers={"x-api-key": key}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == message


@pytest.mark.parametrize(("field", "value"), [("max_tokens", True), ("max_tokens", "5"), ("stream", "yes"),
                                              ("temperature", "0.5"), ("top_k", 5.0)])
def test_a_wrongly_typed_field_is_refused_not_coerced(stack, field, value) -> None:
    """Regression: pydantic's lax mode took ``max_tokens: true`` as 1 and ``stream: "yes"``
    as a stream, where Anthropic's API refuses a value of the wrong JSON type."""
    url, key, _ = stack
    r = httpx.post(f"{url}/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": ASK, field: value},
                   headers={"x-api-key": key}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(f"{field}: ")
