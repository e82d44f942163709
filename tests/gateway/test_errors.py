"""Bad input gets OpenAI-shaped errors with the right status, never FastAPI's ``detail``."""

from __future__ import annotations

import httpx
import openai
import pytest

MESSAGES = [{"role": "user", "content": "hi"}]


def _post(url: str, path: str, **kwargs: object) -> httpx.Response:
    return httpx.post(url + path, timeout=30, **kwargs)  # type: ignore[arg-type]


def _assert_openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "detail" not in resp.text and "Traceback" not in resp.text
    return body["error"]


def test_invalid_json(stack) -> None:
    err = _assert_openai_error(
        _post(stack.url, "/v1/chat/completions", content=b"{not json",
              headers={"content-type": "application/json"}), 400)
    assert err["type"] == "invalid_request_error"


def test_body_not_an_object(stack) -> None:
    _assert_openai_error(_post(stack.url, "/v1/chat/completions", json=[1, 2]), 400)


def test_missing_messages(stack) -> None:
    err = _assert_openai_error(_post(stack.url, "/v1/chat/completions", json={"model": "sim"}), 400)
    assert err["param"] == "messages"


def test_wrong_type_field(stack) -> None:
    err = _assert_openai_error(
        _post(stack.url, "/v1/chat/completions",
              json={"model": "sim", "messages": MESSAGES, "temperature": "hot"}), 400)
    assert err["param"] == "temperature"


def test_unknown_route_and_method(stack) -> None:
    _assert_openai_error(httpx.get(stack.url + "/v1/nothing-here"), 404)
    _assert_openai_error(httpx.get(stack.url + "/v1/chat/completions"), 405)


def test_body_too_large(stack) -> None:
    big = b'{"model":"sim","messages":[{"role":"user","content":"' + b"x" * (10 * 1024 * 1024) + b'"}]}'
    err = _assert_openai_error(
        _post(stack.url, "/v1/chat/completions", content=big,
              headers={"content-type": "application/json"}), 413)
    assert err["code"] == "request_too_large"


def test_unknown_fields_are_ignored(stack) -> None:
    resp = _post(stack.url, "/v1/chat/completions",
                 json={"model": "sim", "messages": MESSAGES, "max_tokens": 2, "frobnicate": 1})
    assert resp.status_code == 200


@pytest.mark.parametrize(
    ("kwargs", "exc", "param"),
    [
        ({"model": "no-such-model"}, openai.NotFoundError, "model"),
        ({"max_tokens": 0}, openai.BadRequestError, "max_tokens"),
        ({"n": 17}, openai.BadRequestError, "n"),
        ({"top_p": 1.5}, openai.BadRequestError, "top_p"),
        ({"messages": []}, openai.BadRequestError, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, openai.BadRequestError, "messages.0.role"),
    ],
)
def test_sdk_raises_matching_exception(base_url: str, kwargs: dict, exc: type, param: str) -> None:
    args = {"model": "sim", "messages": MESSAGES, "max_tokens": 4, **kwargs}
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        with pytest.raises(exc) as info:
            client.chat.completions.create(**args)
    assert info.value.body["param"] == param  # type: ignore[attr-defined]


def test_sdk_body_too_large(base_url: str) -> None:
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(
                model="sim", messages=[{"role": "user", "content": "x" * (10 * 1024 * 1024)}]
            )
    assert info.value.status_code == 413


def test_every_response_has_a_request_id(stack) -> None:
    for resp in (httpx.get(stack.url + "/v1/models"), httpx.get(stack.url + "/health"),
                 httpx.get(stack.url + "/nope"),
                 httpx.post(stack.url + "/v1/chat/completions", json={"model": "sim"})):
        assert len(resp.headers["x-request-id"]) >= 8
    mine = httpx.get(stack.url + "/v1/models", headers={"x-request-id": "mine-123"})
    assert mine.headers["x-request-id"] == "mine-123"


@pytest.mark.parametrize(("path", "body", "param", "says"), [
    ("/v1/embeddings", {"model": "sim", "input": 5}, "input", "valid string"),
    ("/v1/embeddings", {"model": "sim", "input": [-1]}, "input.0", "greater than or equal to 0"),
    ("/v1/rerank", {"model": "sim", "query": "q", "documents": [5]}, "documents.0", "valid string"),
    ("/v1/score", {"model": "sim", "text_1": 5, "text_2": "b"}, "text_1", "valid string"),
])
def test_a_wrongly_typed_union_field_is_named_without_pydantics_branch_tags(stack, path, body, param, says) -> None:
    """Regression: a field typed as a union (``input``: a string, strings or token ids) was
    named by the union branch pydantic tried first (``param: "input.str"``), and for a
    negative token id the message was that branch's ("should be a valid string")."""
    err = _assert_openai_error(_post(stack.url, path, json=body), 400)
    assert err["param"] == param and err["message"].startswith(f"{param}: "), err
    assert says in err["message"], err
