"""Prompt helpers shared by the real engines."""

from __future__ import annotations

from typing import Any

import pytest

from engine_worker.engines.prompts import PromptIds, completion_budget, prompt_token_ids, tokenizer_digest
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


def default_tokenizer() -> Any:
    from sluice.models import default_model_dir, is_prepared

    if not is_prepared(default_model_dir()):
        pytest.skip("run 'sluice model prepare' first")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir()))


def test_a_chat_template_that_refuses_the_messages_is_a_400() -> None:
    """Regression: a template's raise_exception became a worker 500, retried on every
    worker and answered 503; it is the client's error."""
    tokenizer = default_tokenizer()
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


def test_a_worker_takes_a_gateways_prompt_ids_only_from_a_tokenizer_with_its_digest() -> None:
    tokenizer = default_tokenizer()
    prompts = PromptIds(tokenizer)
    assert prompts.digest == tokenizer_digest(default_tokenizer())  # the same folder, loaded again
    messages = [{"role": "user", "content": "Which gate opens first?"}]
    own = prompt_token_ids(tokenizer, GenerateRequest(request_id="r", model="m", messages=messages))
    sent = own + own  # not this prompt's ids: shows whose ids the worker took

    def ids(digest: str, token_ids: list[int] = sent) -> list[int]:
        return prompts(GenerateRequest(request_id="r", model="m", messages=messages,
                                       gateway_prompt_ids=token_ids, gateway_tokenizer=digest))

    assert ids(prompts.digest) == sent and prompts.taken == 1
    assert ids("0" * 16) == own and prompts.taken == 1  # another tokenizer's ids: tokenized here
    with pytest.raises(InvalidRequest, match="outside this model's vocabulary"):
        ids(prompts.digest, [len(tokenizer)])
    # A chat template is part of what makes the ids: another one is another digest.
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert tokenizer_digest(tokenizer) != prompts.digest
