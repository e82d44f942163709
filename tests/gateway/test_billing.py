"""Each attempt is billed what it served its client, each generation once (gateway/record.py)."""

from __future__ import annotations

import re
import uuid

import openai
import pytest

from gateway.relay.rendering import DeliveredJSON
from tests.conftest import wait_for

_ACCESS = re.compile(r"access request_id=(\S+) .*?status=(\S+) .*?prompt_tokens=(\d+) completion_tokens=(\d+)")
MESSAGES = [{"role": "user", "content": "a long answer, billed once"}]


@pytest.fixture(scope="module")
def gateway(start_worker, start_gateway):
    start_worker("billing", sim_token_ms=30, sim_ttft_ms=0)
    return start_gateway()


def _lines(gateway, request_id: str) -> list[tuple[str, int, int]]:
    """(status, prompt tokens, completion tokens) of each access-log line of ``request_id``."""
    return [(m.group(2), int(m.group(3)), int(m.group(4)))
            for m in _ACCESS.finditer(gateway.log_path.read_text(errors="replace")) if m.group(1) == request_id]


def test_a_failed_non_streaming_attempt_bills_none_of_the_tokens_its_client_never_got(gateway) -> None:
    """Regression (nemesis seed 7: 20 requests billed more than they were served): a
    non-streaming attempt answered with an error (here its deadline; in the nemesis 502/503
    after a worker died) billed the tokens generated before it failed, though its client got
    none of them; the SDK's retry was billed its own answer on top."""
    request_id = f"billed-{uuid.uuid4().hex[:8]}"
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
        with pytest.raises(openai.APIStatusError) as failed:
            client.chat.completions.create(
                model="billing", messages=MESSAGES, max_tokens=100, extra_body={"ignore_eos": True},
                extra_headers={"x-request-id": request_id, "X-Sluice-Timeout-Ms": "1000"})
        assert failed.value.status_code == 504
        wait_for(lambda: len(_lines(gateway, request_id)) == 1, 10, "the failed attempt's access line")
        retried = client.chat.completions.create(
            model="billing", messages=MESSAGES, max_tokens=100, extra_body={"ignore_eos": True},
            extra_headers={"x-request-id": request_id})
    assert retried.usage is not None and retried.usage.completion_tokens == 100
    wait_for(lambda: len(_lines(gateway, request_id)) == 2, 10, "the retry's access line")
    failed_line, served_line = _lines(gateway, request_id)
    assert failed_line[0] != "ok" and failed_line[1:] == (0, 0), failed_line
    assert served_line == ("ok", retried.usage.prompt_tokens, 100)


async def test_a_json_answer_is_billed_once_its_body_was_handed_to_the_connection() -> None:
    """Regression (the nemesis, Cluster, 045af44: four requests billed twice): a non-streaming
    answer was billed when its body was built, before it was sent; a gateway killed in
    between left a bill for an answer its client never got, and the client's retry was
    billed again. Now the bill follows the send, and a send that fails still closes it."""
    events: list[str] = []

    async def delivered() -> None:
        events.append("billed")

    async def receive() -> dict[str, str]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, object]) -> None:
        events.append(str(message["type"]))

    await DeliveredJSON(b"{}", {}, delivered)({"type": "http", "method": "POST"}, receive, send)
    assert events == ["http.response.start", "http.response.body", "billed"]

    events.clear()

    async def broken(message: dict[str, object]) -> None:
        raise OSError("the connection broke")

    with pytest.raises(OSError):
        await DeliveredJSON(b"{}", {}, delivered)({"type": "http", "method": "POST"}, receive, broken)
    assert events == ["billed"]
