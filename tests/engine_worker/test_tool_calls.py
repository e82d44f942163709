"""Tool calls in the worker: forced calls from constrained JSON, and ``auto`` through a
vLLM tool-call parser fed token by token (the real default model's tokenizer, no engine)."""

from __future__ import annotations

import json

import pytest

from engine_worker.engines.sim_structured import MAX_CHARS, example, structured_pieces
from engine_worker.engines.tool_calls import (
    ForcedCalls,
    decoding_constraint,
    forced_schema,
)
from engine_worker.protocol import GenerateRequest
from gateway.surfaces.openai import ToolCallAssembler
from sluice.errors import InvalidRequest
from sluice.models import default_model_dir, is_prepared

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _request(**fields: object) -> GenerateRequest:
    return GenerateRequest(request_id="r", model="m", messages=[{"role": "user", "content": "hi"}], **fields)


def test_required_schema_is_an_array_of_named_calls() -> None:
    schema = forced_schema(_request(tools=[WEATHER, TIME], tool_mode="required", parallel_tool_calls=False))
    assert schema is not None and schema["maxItems"] == 1
    names = [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}


def test_a_forced_call_wins_over_response_format() -> None:
    request = _request(tools=[WEATHER], tool_mode={"name": "get_weather"}, structured={"json_object": True})
    assert decoding_constraint(request) == {"json": WEATHER["function"]["parameters"]}
    assert decoding_constraint(_request(tools=[WEATHER], tool_mode="none", structured={"json_object": True})) == {
        "json_object": True}


def test_required_calls_are_read_from_the_whole_array() -> None:
    calls = ForcedCalls("required")
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    assert calls.step(text[:10], [1], None) == ("", None, None)
    content, deltas, finish = calls.step(text[10:], [2], "stop")
    assert content == "" and finish == "tool_calls"
    assert [(d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas or []] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_a_required_call_cut_short_is_text_with_finish_length() -> None:
    calls = ForcedCalls("required")
    assert calls.step('[{"name": "get_wea', [1], "length") == ('[{"name": "get_wea', None, "length")


def test_sim_json_validates_against_its_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = forced_schema(_request(tools=[WEATHER, TIME], tool_mode="required"))
    pieces, whole = structured_pieces({"json": schema}, "seed")
    value = json.loads("".join(pieces))
    assert whole
    jsonschema.validate(value, schema)
    nested = {"type": "object", "properties": {"tags": {"type": "array", "items": {"$ref": "#/$defs/T"},
                                                        "minItems": 2}},
              "$defs": {"T": {"anyOf": [{"type": "integer", "minimum": 3}, {"type": "null"}]}}}
    jsonschema.validate(example(nested, "x"), nested)


@pytest.mark.skipif(not is_prepared(default_model_dir()), reason="run 'sluice model prepare' first")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit, imported by vLLM
@pytest.mark.timeout(300)
def test_auto_streams_content_and_calls_through_vllms_hermes_parser() -> None:
    from transformers import AutoTokenizer

    from engine_worker.engines.vllm_tools import AutoToolCalls

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    output = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    ids = tokenizer.encode(output)
    auto = AutoToolCalls("hermes", tokenizer, _request(tools=[WEATHER], tool_mode="auto"))
    content, assembled, finish = "", ToolCallAssembler(), None
    for position, token in enumerate(ids):
        last = position == len(ids) - 1
        text, deltas, finish = auto.step(tokenizer.decode([token]), [token], "stop" if last else None)
        content += text
        assembled.add(deltas or [])
    assert content.strip() == "Let me check."
    (call,) = assembled.calls()
    assert call["function"]["name"] == "get_weather" and call["id"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert finish == "tool_calls"


def test_auto_without_a_parser_is_a_400_that_says_so() -> None:
    from engine_worker.engines.vllm_tools import AutoToolCalls

    with pytest.raises(InvalidRequest, match="--tool-call-parser") as caught:
        AutoToolCalls(None, object(), _request(tools=[WEATHER], tool_mode="auto"))
    assert caught.value.param == "tool_choice"


class _Template:
    def __init__(self, source: str) -> None:
        self.chat_template = source


CONVERSATION = [
    {"role": "user", "content": [{"type": "text", "text": "Weather?"}], "name": "ann"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "4C"},
]


def test_messages_reach_a_tool_aware_template_intact() -> None:
    from engine_worker.engines.prompts import template_messages

    request = _request(tools=[WEATHER], tool_mode="auto").model_copy(update={"messages": CONVERSATION})
    messages = template_messages(_Template("{% for t in tools %}{{ m.tool_calls }}{% endfor %}"), request)
    assert messages[0] == {"role": "user", "content": "Weather?", "name": "ann"}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # parsed, as HF templates want
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "4C"}


def test_a_template_without_tools_gets_them_as_text() -> None:
    from engine_worker.engines.prompts import template_messages

    request = _request(tools=[WEATHER], tool_mode="required").model_copy(update={"messages": CONVERSATION})
    messages = template_messages(_Template("{{ m.content }}"), request)
    assert messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    assert "tool_calls" not in messages[2] and "Oslo" in messages[2]["content"]


def test_a_schema_asking_for_more_than_the_token_limit_lets_out_is_built_only_that_far() -> None:
    """Regression (review, 2026-12-07): ``minLength``/``minItems`` were built whatever the
    request's token limit: a 300-byte schema made a one-token request build 20 MB on the
    worker's loop (1.07 s, +345 MiB), nested ``minItems`` multiplied it."""
    huge = {"type": "object", "properties": {
        "text": {"type": "string", "minLength": 20_000_000},
        "grid": {"type": "array", "minItems": 2000, "items": {"type": "array", "minItems": 2000,
                                                              "items": {"type": "integer"}}}}}
    pieces, whole = structured_pieces({"json": huge}, "seed", max_chars=4 * 9)
    assert not whole and len("".join(pieces)) < 200, len("".join(pieces))
    pieces, whole = structured_pieces({"json": huge}, "seed")  # no limit: at most a simulated context
    assert not whole and len("".join(pieces)) < 2 * MAX_CHARS
    small = {"type": "object", "properties": {"tags": {"type": "array", "minItems": 3, "items": {"type": "string"}}}}
    assert structured_pieces({"json": small}, "seed", max_chars=4 * 40)[1]  # fits: whole, as before
