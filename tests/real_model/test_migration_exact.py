"""Migration is exact at every break, on the real model (vLLM on CPU, float32).

A greedy answer with emoji, CJK text and a stop string is generated once without a
break. Then, for every token position k, a second generation resumes it as a migration
would (``resume_token_ids`` = the first k ids, ``resume_text_chars`` = the characters
the client had after k lines): the client's text + the resumed text must be the
uninterrupted text, byte for byte. Breaks land inside multi-byte characters, inside the
held-back part of a stop string, and across the stop string itself.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import httpx
import orjson
import pytest

from sluice.models import default_model_dir, is_prepared
from tests.real_model.conftest import MODEL

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(not is_prepared(default_model_dir()), reason="run 'sluice model prepare' first"),
]

EMOJI_CJK = {"prompt": "😀 你好 🚢 世界 😀 你好 🚢 世界 😀 你好 🚢 世界 😀 你好", "max_tokens": 40}
WITH_STOP = {
    "messages": [{"role": "user", "content": "Translate to Chinese and add an emoji: Hello world, the boat is in the lock."}],
    "max_tokens": 60, "stop": ['"🌈"', "never appears"],
}


@pytest.fixture
def worker(vllm_worker):
    return vllm_worker


def generate(worker, body: dict[str, Any]) -> list[dict[str, Any]]:
    payload = {"request_id": "exact", "model": MODEL, "temperature": 0, **body}
    response = httpx.post(worker.url + "/internal/generate", json=payload, timeout=120)
    assert response.status_code == 200, response.text
    return [orjson.loads(line) for line in response.text.splitlines()]


def text_of(lines: list[dict[str, Any]]) -> str:
    assert not any("error" in line for line in lines), lines
    return "".join(line.get("text", "") for line in lines)


def resume_everywhere(worker, body: dict[str, Any], logprobs: int | None = None) -> tuple[str, str, int]:
    """Resume ``body``'s answer after every line; returns (reference, finish, breaks checked)."""
    lines = generate(worker, {**body, "logprobs": logprobs})
    reference, finish = text_of(lines), lines[-1]["finish_reason"]
    ids = [i for line in lines for i in line["ids"]]
    reference_lp = [entry for line in lines for entry in line.get("lp", [])]

    def check(k: int) -> None:
        sent = [i for line in lines[:k] for i in line["ids"]]
        chars = sum(len(line["text"]) for line in lines[:k])
        resumed = generate(worker, {
            **body, "logprobs": logprobs, "resume_token_ids": sent, "resume_text_chars": chars,
            "max_tokens": body["max_tokens"] - len(sent),
        })
        got = reference[:chars] + text_of(resumed)
        assert got == reference, f"break after line {k} ({len(sent)} ids, {chars} chars): {got!r}"
        assert resumed[-1]["finish_reason"] == finish, f"break after line {k}"
        assert sent + [i for line in resumed for i in line["ids"]] == ids, f"break after line {k}"
        if logprobs is not None:
            entries = [entry for line in resumed for entry in line.get("lp", [])]
            expected = reference_lp[len(sent):]
            assert [e[0] for e in entries] == [e[0] for e in expected], f"break after line {k}"
            assert all(abs(a[1] - b[1]) < 1e-3 for a, b in zip(entries, expected, strict=True))

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(check, range(1, len(lines))))
    return reference, finish, len(lines) - 1


@pytest.mark.timeout(600)
def test_every_break_inside_emoji_and_cjk_resumes_byte_identical(worker) -> None:
    reference, finish, breaks = resume_everywhere(worker, EMOJI_CJK)
    assert "😀" in reference and "你好" in reference and finish == "length"
    assert breaks >= 30


@pytest.mark.timeout(600)
def test_every_break_around_a_stop_string_resumes_byte_identical(worker) -> None:
    """Regression: a stop string spanning the break was never seen by the new engine."""
    reference, finish, breaks = resume_everywhere(worker, WITH_STOP)
    uncut = text_of(generate(worker, {**WITH_STOP, "stop": []}))
    assert finish == "stop" and '"🌈"' in uncut and uncut.startswith(reference)
    assert reference == uncut[:uncut.index('"🌈"')]
    assert breaks >= 20


@pytest.mark.timeout(600)
def test_logprobs_continue_exactly_across_every_break(worker) -> None:
    resume_everywhere(worker, {**EMOJI_CJK, "max_tokens": 16}, logprobs=2)
