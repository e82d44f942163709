"""The Anthropic Messages API on the real default model (SmolLM2-135M-Instruct, vLLM on
CPU) with the official ``anthropic`` SDK: a greedy answer, its stop sequence as vLLM names
it, the prompt counted by the worker's tokenizer, and a forced tool call streamed."""

from __future__ import annotations

import anthropic
import pytest

from sluice.models import default_model_dir, is_prepared
from tests.real_model.conftest import MODEL

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(not is_prepared(default_model_dir()), reason="run 'sluice model prepare' first"),
    pytest.mark.timeout(600),
]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture
def claude(vllm_gateway):
    with anthropic.Anthropic(base_url=vllm_gateway.url, api_key="x", max_retries=0, timeout=300) as sdk:
        yield sdk


def test_a_greedy_answer_its_stop_sequence_and_its_count(claude) -> None:
    greedy = {"temperature": 0}  # this SDK no longer names sampling fields; the API takes them
    message = claude.messages.create(model=MODEL, max_tokens=40, messages=QUESTION, extra_body=greedy)
    text = message.content[0].text
    assert "Paris" in text and message.stop_reason in ("end_turn", "max_tokens")
    counted = claude.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens
    assert counted == message.usage.input_tokens + message.usage.cache_read_input_tokens > 5
    stopped = claude.messages.create(model=MODEL, max_tokens=40, messages=QUESTION, stop_sequences=["Paris"],
                                     extra_body=greedy)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "Paris")
    assert stopped.content[0].text == text[:text.index("Paris")]


def test_a_forced_tool_call_streams_as_tool_use(claude) -> None:
    with claude.messages.stream(model=MODEL, max_tokens=60, messages=[
            {"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER],
            tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    (call,) = [block for block in final.content if block.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input.get("city"), str)
