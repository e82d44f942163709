"""Resumable streams: re-attach with Last-Event-ID and get the rest, with no duplicate."""

from __future__ import annotations

import uuid

import httpx
import orjson
import pytest


@pytest.fixture(scope="module")
def resumable(start_worker, start_gateway):
    start_worker("resume", sim_token_ms=15, sim_ttft_ms=0)
    return start_gateway()


def _events(lines) -> list[tuple[int | None, str]]:
    """(id, data) per SSE event from an iterator of lines."""
    out, ident = [], None
    for line in lines:
        if line.startswith("id: "):
            ident = int(line[4:])
        elif line.startswith("data: "):
            out.append((ident, line[6:]))
            ident = None
    return out


def _text(events) -> str:
    return "".join(
        orjson.loads(d)["choices"][0]["text"] for _, d in events if d.startswith("{") and '"choices":[{' in d
    )


BODY = {"model": "resume", "prompt": "resumable", "max_tokens": 60, "ignore_eos": True, "stream": True}


def test_reattach_after_disconnect_gets_the_rest(resumable) -> None:
    reference = httpx.post(resumable.url + "/v1/completions", timeout=30,
                           json={**BODY, "stream": False}).json()["choices"][0]["text"]
    key = uuid.uuid4().hex
    headers = {"Idempotency-Key": key}
    with httpx.stream("POST", resumable.url + "/v1/completions", json=BODY, headers=headers, timeout=30) as r:
        lines = r.iter_lines()
        first: list[str] = []
        for line in lines:
            first.append(line)
            if sum(1 for ln in first if ln.startswith("data: ")) == 10:
                break
    head = _events(first)
    last_id = head[-1][0]
    assert [i for i, _ in head] == list(range(1, 11))
    with httpx.stream("GET", f"{resumable.url}/v1/streams/{key}", timeout=30,
                      headers={"Last-Event-ID": str(last_id)}) as r:
        assert r.status_code == 200
        rest = _events(r.iter_lines())
    ids = [i for i, _ in rest if i is not None]
    assert ids == list(range(last_id + 1, last_id + 1 + len(ids)))  # no gap, no duplicate
    assert rest[-1][1] == "[DONE]"
    assert _text(head) + _text(rest) == reference


def test_same_post_with_same_key_reattaches_from_the_start(resumable) -> None:
    key = {"Idempotency-Key": uuid.uuid4().hex}
    with httpx.stream("POST", resumable.url + "/v1/completions", json=BODY, headers=key, timeout=30) as r:
        whole = _events(r.iter_lines())
    again = httpx.post(resumable.url + "/v1/completions", json=BODY, headers=key, timeout=30)
    replay = _events(again.text.splitlines())
    assert replay == whole
    assert len([i for i, _ in whole if i]) == 60  # one event per token, each with its id


def test_unknown_stream_is_404(resumable) -> None:
    resp = httpx.get(f"{resumable.url}/v1/streams/{uuid.uuid4().hex}")
    assert resp.status_code == 404
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_a_long_silence_does_not_cut_readers_off(start_worker, start_gateway) -> None:
    """Regression: the journal's liveness flag expired after 3 s without a new event,
    and readers were told the producer was gone while it was still generating."""
    start_worker("slow-resume", sim_token_ms=3500, sim_ttft_ms=0)
    gateway = start_gateway()
    body = {"model": "slow-resume", "prompt": "p", "max_tokens": 3, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=30,
                      headers={"Idempotency-Key": uuid.uuid4().hex}) as r:
        events = _events(r.iter_lines())
    assert events[-1][1] == "[DONE]"
    assert not any('"error"' in d for _, d in events), events
    assert len([i for i, _ in events if i]) == 3
