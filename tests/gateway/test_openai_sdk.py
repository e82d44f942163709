"""The official openai SDK against the gateway, sync and async."""

from __future__ import annotations

import openai
import pytest

MESSAGES = [{"role": "user", "content": "Tell me about sluices."}]


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as c:
        yield c


async def test_async_chat_non_streaming(base_url: str) -> None:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        resp = await client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=8)
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None
    assert resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8


async def test_async_chat_streaming_with_usage(base_url: str) -> None:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="sim", messages=MESSAGES, max_tokens=6, stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    content_chunks = [c for c in chunks if c.choices]
    assert content_chunks[0].choices[0].delta.role == "assistant"
    assert content_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 6
    assert len({c.id for c in chunks}) == 1


def test_sync_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=12, seed=7)
    stream = client.chat.completions.create(
        model="sim", messages=MESSAGES, max_tokens=12, seed=7, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == full.choices[0].message.content


def test_sync_completions(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="sim", prompt="Once upon a time", max_tokens=5)
    assert resp.object == "text_completion"
    assert resp.choices[0].text and resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 5


def test_sync_completions_prompt_list(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="sim", prompt=["one", "two", "three"], max_tokens=3)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert resp.usage is not None and resp.usage.completion_tokens == 9


async def test_async_completions_streaming(base_url: str) -> None:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        stream = await client.completions.create(
            model="sim", prompt="Once", max_tokens=4, stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) == 4
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_stop_sequence(client: openai.OpenAI) -> None:
    full = client.completions.create(model="sim", prompt="stop test", max_tokens=10)
    words = full.choices[0].text.split()
    k = next(i for i in range(1, len(words)) if words[i] not in words[:i])
    cut = client.completions.create(model="sim", prompt="stop test", max_tokens=10, stop=[" " + words[k]])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == " " + " ".join(words[:k])


def test_models(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert "sim" in ids
    assert client.models.retrieve("sim").id == "sim"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_n_choices(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=4, n=3, seed=1)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert len({c.message.content for c in resp.choices}) == 3  # seed + i per choice
    assert resp.usage is not None and resp.usage.completion_tokens == 12
    stream = client.completions.create(model="sim", prompt=["a", "b"], max_tokens=2, n=2, stream=True)
    finished = {c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1, 2, 3}


def test_chat_logprobs(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="sim", messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=2
    )
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert len(content) == 4
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    stream = client.chat.completions.create(
        model="sim", messages=MESSAGES, max_tokens=4, logprobs=True, stream=True
    )
    streamed = [t for c in stream if c.choices for t in c.choices[0].logprobs.content]  # type: ignore[union-attr]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_completion_logprobs(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="sim", prompt="lp", max_tokens=3, logprobs=1)
    lp = resp.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == 3 and len(lp.top_logprobs) == 3
    assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]


def test_top_logprobs_without_logprobs_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="sim", messages=MESSAGES, top_logprobs=2)
