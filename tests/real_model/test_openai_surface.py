"""Structured outputs, tools, token prompts and the Responses API on the real default model
(SmolLM2-135M-Instruct, vLLM on CPU) with the official SDK. Greedy decoding under a
grammar, so the output is valid whatever a 135M model would have said."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from sluice.models import default_model_dir, is_prepared
from tests.openai_tools import WEATHER
from tests.real_model.conftest import MODEL

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(not is_prepared(default_model_dir()), reason="run 'sluice model prepare' first"),
    pytest.mark.timeout(600),
]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


class Country(BaseModel):
    name: str
    capital: str


def test_parse_with_a_pydantic_model(client) -> None:
    completion = client.chat.completions.parse(
        model=MODEL, messages=QUESTION, response_format=Country, temperature=0, max_tokens=60)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Country), completion.choices[0].message.content


def test_json_object(client) -> None:
    ask = [{"role": "user", "content": "Reply in JSON with the keys country and capital: the capital of France?"}]
    resp = client.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=120,
                                          response_format={"type": "json_object"})
    assert isinstance(json.loads(resp.choices[0].message.content or ""), dict)


def test_a_schema_xgrammar_refuses_still_works(client) -> None:
    # A pattern with a length: xgrammar cannot compile it; llguidance can.
    schema = {"type": "object", "additionalProperties": False, "required": ["code"],
              "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$", "minLength": 2, "maxLength": 3}}}
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Country code of France?"}], temperature=0,
        max_tokens=30, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema,
                                                                                "strict": True}})
    jsonschema.validate(json.loads(resp.choices[0].message.content or ""), schema)


def test_a_schema_the_grammar_cannot_take_is_a_400(client) -> None:
    broken = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "broken", "schema": broken}})
    assert caught.value.body["param"] == "response_format"


def _check_call(call) -> dict:
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    return arguments


def test_required_tool_call(client) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER],
                                          tool_choice="required", temperature=0, max_tokens=120,
                                          parallel_tool_calls=False)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls or []
    _check_call(call)


def test_required_tool_call_streamed(client) -> None:
    with client.chat.completions.stream(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER],
                                        tool_choice="required", temperature=0, max_tokens=120,
                                        parallel_tool_calls=False) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls or []
    _check_call(call)
    assert final.choices[0].finish_reason == "tool_calls"


def test_multi_turn_with_a_tool_result(client) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], temperature=0, max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = first.choices[0].message
    (call,) = message.tool_calls or []
    _check_call(call)
    messages = [*ASK_WEATHER, message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                            temperature=0, max_tokens=40)
    assert second.choices[0].message.content
    alone = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="none",
                                           temperature=0, max_tokens=1)
    # The call (with its arguments) and its result reached the prompt.
    assert second.usage.prompt_tokens >= alone.usage.prompt_tokens + len(call.function.arguments) // 8


def test_auto_tool_choice_goes_through_the_parser(client) -> None:
    # SmolLM2 does not write Hermes tool calls: the parser finds none, and the answer is text.
    resp = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER], temperature=0,
                                          max_tokens=30)
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.choices[0].message.content


def test_token_prompts_match_text_prompts(client) -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(default_model_dir()).encode("The capital of France is")
    text = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8)
    tokens = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=8)
    assert tokens.choices[0].text == text.choices[0].text
    both = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], temperature=0, max_tokens=4)
    assert len(both.choices) == 2
    echoed = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=8, echo=True)
    assert echoed.choices[0].text == "The capital of France is" + text.choices[0].text
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.completions.create(model=MODEL, prompt=[1, 10**7], max_tokens=2)


def test_logit_bias_is_honoured(client) -> None:
    args = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 30}
    plain = client.chat.completions.create(**args).choices[0].message.content or ""
    assert "Paris" in plain
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    banned = {str(tokenizer.encode(word)[0]): -100 for word in (" Paris", "Paris")}
    biased = client.chat.completions.create(**args, logit_bias=banned).choices[0].message.content or ""
    assert "Paris" not in biased


def test_responses_api(client) -> None:
    resp = client.responses.create(model=MODEL, input="What is the capital of France?", temperature=0,
                                   max_output_tokens=30)
    assert resp.status == "completed" and "Paris" in resp.output_text
    assert resp.usage.output_tokens > 0
    events = list(client.responses.create(model=MODEL, input="What is the capital of France?", temperature=0,
                                          max_output_tokens=30, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == resp.output_text == events[-1].response.output_text


def test_responses_api_function_call(client) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"],
            "strict": True}
    resp = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[tool],
                                   tool_choice="required", temperature=0, max_output_tokens=120, parallel_tool_calls=False)
    (call,) = [item for item in resp.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), tool["parameters"])
    with client.responses.stream(model=MODEL, input="What is the weather in Paris?", tools=[tool],
                                 tool_choice="required", temperature=0, max_output_tokens=120,
                                 parallel_tool_calls=False) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    (streamed,) = [item for item in final.output if item.type == "function_call"]
    assert streamed.arguments == call.arguments
    follow = client.responses.create(
        model=MODEL, temperature=0, max_output_tokens=30, tools=[tool],
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}],
        tool_choice="none")
    assert follow.output_text
