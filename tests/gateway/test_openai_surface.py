"""The rest of OpenAI's surface with the official SDK on the simulator: tools, structured
outputs, token prompts, echo, and a 400 naming every field that is not honoured."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.openai_tools import WEATHER

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as c:
        yield c


class City(BaseModel):
    name: str
    population: int
    capital: bool


def test_parse_returns_a_valid_pydantic_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(model="sim", messages=MESSAGES, response_format=City)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City)
    assert completion.choices[0].finish_reason == "stop"


def test_json_object_is_json(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model="sim", messages=MESSAGES, response_format={"type": "json_object"})
    assert isinstance(json.loads(resp.choices[0].message.content or ""), dict)


def test_required_tool_call(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model="sim", messages=MESSAGES, tools=[WEATHER], tool_choice="required")
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert set(json.loads(call.function.arguments)) == {"city", "unit"}


def test_required_tool_call_streamed_equals_assembled(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(model="sim", messages=MESSAGES, tools=[WEATHER],
                                        tool_choice="required") as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert json.loads(call.function.arguments)["unit"] in ("celsius", "fahrenheit")


def test_named_tool_call_streams_its_arguments(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="sim", messages=MESSAGES, tools=[WEATHER, TIME], stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    deltas = [c.choices[0].delta for c in stream if c.choices]
    pieces = [d.tool_calls[0].function.arguments for d in deltas if d.tool_calls]
    assert len(pieces) > 1, "the arguments arrive in several deltas"
    assert deltas[0].role == "assistant"
    assert json.loads("".join(pieces))["city"]


def test_multi_turn_with_a_tool_result(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model="sim", messages=MESSAGES, tools=[WEATHER], tool_choice="required")
    call = (first.choices[0].message.tool_calls or [])[0]
    messages = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}]
    second = client.chat.completions.create(model="sim", messages=messages, tools=[WEATHER], tool_choice="none",
                                            max_tokens=8)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls


def test_token_prompts(client: openai.OpenAI) -> None:
    one = client.completions.create(model="sim", prompt=[1, 2, 3], max_tokens=4)
    assert one.choices[0].text and one.usage is not None
    two = client.completions.create(model="sim", prompt=[[1, 2, 3], [4, 5]], max_tokens=4)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text == one.choices[0].text


def test_echo_sends_the_prompt_first(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="sim", prompt="Once upon a time", max_tokens=3, echo=True)
    assert resp.choices[0].text.startswith("Once upon a time ")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="sim", prompt="Once upon a time", max_tokens=3, echo=True, stream=True))
    assert streamed == resp.choices[0].text


REFUSED = [
    ("completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("completions", {"prompt": "x", "echo": True, "logprobs": 2}, "echo"),
    ("completions", {"prompt": [1, 5000]}, "prompt"),
    ("completions", {"prompt": [[1], []]}, "prompt"),
    ("completions", {"prompt": [1, -2]}, "prompt.list[int].1"),
    ("chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("chat/completions", {"function_call": "auto"}, "function_call"),
    ("chat/completions", {"audio": {"voice": "x"}}, "audio"),
    ("chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat/completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("chat/completions", {"logit_bias": {"1": 300}}, "logit_bias"),
    ("chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("chat/completions", {"parallel_tool_calls": False}, "parallel_tool_calls"),
    ("chat/completions", {"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ("chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages.0.content"),
]


@pytest.mark.parametrize(("route", "fields", "param"), REFUSED, ids=[p for _, _, p in REFUSED])
def test_a_field_that_is_not_honoured_is_a_400_naming_it(base_url: str, route: str, fields: dict[str, object],
                                                          param: str) -> None:
    body: dict[str, object] = {"model": "sim", "max_tokens": 4}
    if route == "chat/completions":
        body["messages"] = MESSAGES
    body.update(fields)
    resp = httpx.post(f"{base_url}/{route}", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param.split(".")[0]), error
    assert param.split(".")[0] in error["message"], error


def test_honoured_sampling_fields_are_accepted(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=3, logit_bias={"5": -100},
                                          extra_body={"min_p": 0.1})
    assert resp.choices[0].finish_reason == "length"
    resp = client.completions.create(model="sim", prompt="x", max_tokens=2, n=2, best_of=2)
    assert len(resp.choices) == 2


def test_responses_text(client: openai.OpenAI) -> None:
    resp = client.responses.create(model="sim", input="Tell me about sluices.", instructions="Be brief.",
                                   max_output_tokens=6)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text and resp.usage.output_tokens == 6
    events = list(client.responses.create(model="sim", input="Tell me about sluices.", instructions="Be brief.",
                                          max_output_tokens=6, stream=True))
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == resp.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_function_call_streamed_and_not(client: openai.OpenAI) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    resp = client.responses.create(model="sim", input="Weather in Paris?", tools=[tool], tool_choice="required")
    (call,) = resp.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city", "unit"}
    with client.responses.stream(model="sim", input="Weather in Paris?", tools=[tool],
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    (streamed,) = final.output
    assert set(json.loads(streamed.arguments)) == {"city", "unit"}
    follow = client.responses.create(model="sim", max_output_tokens=4, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "21C"}])
    assert follow.output_text


def test_responses_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    resp = client.responses.parse(model="sim", input="A city, please.", text_format=City)
    assert isinstance(resp.output_parsed, City)


@pytest.mark.parametrize(("fields", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
])
def test_responses_refusals_name_the_field(base_url: str, fields: dict[str, object], param: str) -> None:
    body = {"model": "sim", "input": "hi", **fields}
    resp = httpx.post(f"{base_url}/responses", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"].startswith(param)


def test_responses_take_the_chat_path(base_url: str) -> None:
    """Priority, request id and queue headers, as on chat completions."""
    resp = httpx.post(f"{base_url}/responses", json={"model": "sim", "input": "hi", "max_output_tokens": 2},
                      headers={"x-sluice-priority": "5", "x-request-id": "responses-path-1"}, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-sluice-priority"] == "5"
    assert resp.headers["x-request-id"] == "responses-path-1"
    assert "x-sluice-queue-ms" in resp.headers
    assert resp.json()["object"] == "response"


def test_a_required_call_streams_no_empty_chunks(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="sim", messages=MESSAGES, tools=[WEATHER], tool_choice="required",
                                            stream=True)
    chunks = [c for c in stream if c.choices]
    assert len(chunks) == 2, "the role, then the whole call with its finish reason"
    assert chunks[-1].choices[0].delta.tool_calls and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_resumable_responses_stream_reattaches(base_url: str) -> None:
    """Idempotency-Key on /v1/responses: journaled typed events, re-attachable after any id."""
    body = {"model": "sim", "input": "Tell me about sluices.", "max_output_tokens": 6, "stream": True}
    headers = {"Idempotency-Key": "responses-resume-1"}
    with httpx.stream("POST", f"{base_url}/responses", json=body, headers=headers, timeout=30) as resp:
        first = [line for line in resp.iter_lines() if line.startswith("event: ")]
    assert first[0] == "event: response.created" and first[-1] == "event: response.incomplete"
    again = httpx.get(f"{base_url}/streams/responses-resume-1", headers={"Last-Event-ID": "2"}, timeout=30)
    replayed = [line for line in again.text.splitlines() if line.startswith("event: ")]
    assert replayed == first[2:]
