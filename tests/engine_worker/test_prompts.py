"""Prompt helpers shared by the real engines."""

from __future__ import annotations

import pytest

from engine_worker.engines.prompts import completion_budget, held_back_text
from engine_worker.protocol import GenerateRequest
from sluice.errors import InvalidRequest


class _Tokenizer:
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def test_held_back_text_is_what_the_client_has_not_seen() -> None:
    # The first worker sent ids 0..3 but only "ab" of their text (it held "cd" back,
    # e.g. as a possible stop string): the resuming worker must emit "cd" first.
    req = GenerateRequest(request_id="r", model="m", prompt="p", resume_token_ids=[0, 1, 2, 3],
                          resume_text_chars=2)
    assert held_back_text(_Tokenizer(), req) == "cd"
    assert held_back_text(_Tokenizer(), req.model_copy(update={"resume_text_chars": None})) == ""


def test_completion_budget() -> None:
    req = GenerateRequest(request_id="r", model="m", prompt="p", max_tokens=10)
    assert completion_budget(req, 90, 100) == 10
    assert completion_budget(req.model_copy(update={"max_tokens": None}), 90, 100) == 10
    with pytest.raises(InvalidRequest):
        completion_budget(req, 95, 100)
    with pytest.raises(InvalidRequest):
        completion_budget(req, 100, 100)
