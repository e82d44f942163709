"""Prompt helpers shared by the real engines."""

from __future__ import annotations

import pytest

from engine_worker.engines.prompts import completion_budget
from engine_worker.protocol import GenerateRequest
from sluice.errors import InvalidRequest


def test_completion_budget() -> None:
    req = GenerateRequest(request_id="r", model="m", prompt="p", max_tokens=10)
    assert completion_budget(req, 90, 100) == 10
    assert completion_budget(req.model_copy(update={"max_tokens": None}), 90, 100) == 10
    with pytest.raises(InvalidRequest):
        completion_budget(req, 95, 100)
    with pytest.raises(InvalidRequest):
        completion_budget(req, 100, 100)


def test_a_chat_template_that_refuses_the_messages_is_a_400() -> None:
    """Regression: a template's raise_exception became a worker 500, retried on every
    worker and answered 503; it is the client's error."""
    from sluice.models import default_model_dir, is_prepared

    if not is_prepared(default_model_dir()):
        pytest.skip("run 'sluice model prepare' first")
    from transformers import AutoTokenizer

    from engine_worker.engines.prompts import prompt_token_ids

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    tokenizer.chat_template = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    ok = GenerateRequest(request_id="r", model="m", messages=[{"role": "user", "content": "hi"}])
    assert prompt_token_ids(tokenizer, ok)
    bad = GenerateRequest(request_id="r", model="m", messages=[{"role": "user", "content": "a"},
                                                                {"role": "user", "content": "b"}])
    with pytest.raises(InvalidRequest, match="roles must alternate") as caught:
        prompt_token_ids(tokenizer, bad)
    assert caught.value.status == 400 and caught.value.param == "messages"
