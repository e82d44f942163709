"""schemathesis against the gateway's own OpenAPI schema: no 500, every error OpenAI-shaped
(Anthropic-shaped on the Messages API's routes).

The cases come from schemathesis' strategies, driven by hypothesis directly
(schemathesis' own pytest plugin does not load under this pytest).
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

EXAMPLES_PER_OPERATION = 80


def _load_schemathesis_now() -> None:
    """Import what schemathesis loads lazily, at collection, from a shallow stack.

    pytest rewrites schemathesis' modules on first import (it is a registered plugin). On a
    fresh virtualenv (nothing cached) that import, deep inside a running test's stack, made
    CPython 3.11 raise "SystemError: AST constructor recursion depth mismatch", a
    RecursionError in disguise.
    """
    spec = {"openapi": "3.0.0", "info": {"title": "warm-up", "version": "1"},
            "paths": {"/a": {"post": {"responses": {"200": {"description": "ok"}},
                                      "requestBody": {"content": {"application/json": {"schema": {
                                          "type": "object", "properties": {"x": {"type": "integer"}}}}}}}}}}
    for result in schemathesis.openapi.from_dict(spec).get_all_operations():
        result.ok().as_strategy()


_load_schemathesis_now()


def _check(response, path: str) -> None:
    assert response.status_code < 500 or response.status_code == 503, response.text[:300]
    if response.status_code >= 400:
        body = response.json()
        if path.startswith("/v1/messages"):  # the Anthropic Messages API's own shape
            assert set(body) == {"type", "error"} and body["type"] == "error", body
            assert set(body["error"]) == {"type", "message"}, body
        else:
            assert set(body) == {"error"}, body
            assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert "Traceback" not in response.text


# CPU-bound (hypothesis draws every case): 26 s alone, past the suite's 120 s beside make
# test's three other processes.
@pytest.mark.timeout(600)
def test_no_500_and_openai_shaped_errors(stack) -> None:
    schema = schemathesis.openapi.from_dict(httpx.get(stack.url + "/openapi.json").json())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 6
    calls = 0
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None,
                  suppress_health_check=list(HealthCheck), database=None)
        def run(case) -> None:
            nonlocal calls
            calls += 1
            _check(case.call(base_url=stack.url, timeout=30), operation.path)

        run()
    assert calls >= 200
    print(f"\nschemathesis: {calls} cases over {len(operations)} operations")
