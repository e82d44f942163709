"""A resumable stream outlives its gateway: when the gateway producing it dies, another
one continues it from the journal, and the client re-attached there gets exactly the
rest of the uninterrupted stream."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest

from gateway.idempotency import scoped
from sluice import keys
from tests.gateway.test_resumable import _events


def _choice_texts(events: list[tuple[int | None, str]], kind: str) -> dict[int, str]:
    texts: dict[int, str] = {}
    for _, data in events:
        if data.startswith("{") and '"choices":[{' in data:
            choice = orjson.loads(data)["choices"][0]
            piece = choice["delta"].get("content") or "" if kind == "chat" else choice["text"]
            texts[choice["index"]] = texts.get(choice["index"], "") + piece
    return texts


@pytest.fixture(scope="module")
def two_gateways(start_worker, start_gateway):
    start_worker("takeover", sim_token_ms=20, sim_ttft_ms=0)
    start_worker("takeover", sim_token_ms=20, sim_ttft_ms=0)
    return start_gateway(), start_gateway()


@pytest.mark.parametrize("n", [1, 2])
def test_a_stream_whose_gateway_was_killed_is_continued_by_another(two_gateways, start_gateway, n: int) -> None:
    first, other = two_gateways
    dying = start_gateway()  # its own, so the module's gateways survive the test
    body = {"model": "takeover", "messages": [{"role": "user", "content": f"tell a long story {n}"}],
            "max_tokens": 150, "n": n, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    reference = _events(httpx.post(first.url + "/v1/chat/completions", json=body, timeout=60).iter_lines())
    key = uuid.uuid4().hex

    seen: list[tuple[int | None, str]] = []
    with httpx.stream("POST", dying.url + "/v1/chat/completions", json=body,
                      headers={"Idempotency-Key": key}, timeout=60) as r:
        lines = r.iter_lines()
        for line in lines:
            seen += _events([line]) if line.startswith("data: ") else []
            if line.startswith("id: "):
                seen.append((int(line[4:]), ""))
            if len([e for e in seen if e[1]]) >= 40:
                break
        dying.kill()  # SIGKILL mid-stream: no clean-up, its journal just stops
    seen = _pair(seen)
    last = max(i for i, _ in seen if i is not None)
    started = time.monotonic()
    with httpx.stream("GET", other.url + f"/v1/streams/{key}", headers={"Last-Event-ID": str(last)},
                      timeout=60) as r:
        assert r.status_code == 200
        rest = _events(r.iter_lines())
    took_s = time.monotonic() - started
    whole = seen + rest
    ids = [i for i, _ in whole if i is not None]
    assert ids == list(range(1, len(ids) + 1)), "an event was repeated or skipped"
    assert whole[-1][1] == "[DONE]"
    assert not any('"error"' in d for _, d in whole), [d for _, d in whole if '"error"' in d]
    assert _choice_texts(whole, "chat") == _choice_texts(reference, "chat")
    assert orjson.loads(whole[-2][1])["usage"] == orjson.loads(reference[-2][1])["usage"]
    assert orjson.loads(whole[-2][1])["usage"]["completion_tokens"] == 150 * n
    assert took_s < 30
    # Finished: the key now replays the whole stream from any gateway.
    with httpx.stream("GET", first.url + f"/v1/streams/{key}", timeout=60) as r:
        assert _events(r.iter_lines()) == whole


def _pair(seen: list[tuple[int | None, str]]) -> list[tuple[int | None, str]]:
    """Join the ``id:`` lines read one by one with the data line that follows each."""
    out: list[tuple[int | None, str]] = []
    pending = None
    for ident, data in seen:
        if not data:
            pending = ident
        else:
            out.append((pending, data))
            pending = None
    return out


def _start_and_kill(gateway, body: dict[str, object], key: str, events: int = 40) -> list[tuple[int | None, str]]:
    """Stream ``body`` from ``gateway`` until ``events`` events, then SIGKILL the gateway."""
    seen: list[tuple[int | None, str]] = []
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body,
                      headers={"Idempotency-Key": key}, timeout=60) as r:
        for line in r.iter_lines():
            seen += _events([line]) if line.startswith("data: ") else []
            if line.startswith("id: "):
                seen.append((int(line[4:]), ""))
            if len([e for e in seen if e[1]]) >= events:
                break
        gateway.kill()
    return _pair(seen)


def test_a_take_over_refuses_a_journal_missing_its_first_events(two_gateways, start_gateway,
                                                                redis_client) -> None:
    """Regression: a take-over continued from whatever the journal still held; after a trim
    it resumed from a truncated token history (3,988 wrong tokens against 2,500 allowed)."""
    _, other = two_gateways
    body = {"model": "takeover", "messages": [{"role": "user", "content": "a history"}],
            "max_tokens": 150, "ignore_eos": True, "stream": True}
    key = uuid.uuid4().hex
    seen = _start_and_kill(start_gateway(), body, key)
    journal = keys.journal(scoped("-", key))
    redis_client.xtrim(journal, minid="0-21", approximate=False)  # events 1..20 lost (as a trim or a failover loses them)
    last = max(i for i, _ in seen if i is not None)
    with httpx.stream("GET", other.url + f"/v1/streams/{key}", headers={"Last-Event-ID": str(last)},
                      timeout=60) as r:
        rest = _events(r.iter_lines())
    assert [d for _, d in rest][-1] == "[DONE]"
    errors = [orjson.loads(d)["error"] for _, d in rest if d.startswith('{"error"')]
    assert [e["code"] for e in errors] == ["stream_history_lost"], rest
    assert all(i is None for i, _ in rest), "events were produced from a partial history"
    assert redis_client.exists(keys.journal_live(scoped("-", key))) == 0  # the refusing gateway let go


def test_two_gateways_racing_to_take_over_one_stream_produce_it_once(two_gateways, start_gateway,
                                                                     redis_client) -> None:
    """Readers on two gateways find the producer gone at the same moment: one of the two
    takes the stream over; both readers get the same, whole rest of it."""
    first, other = two_gateways
    body = {"model": "takeover", "messages": [{"role": "user", "content": "a race"}],
            "max_tokens": 150, "ignore_eos": True, "stream": True}
    reference = _events(httpx.post(first.url + "/v1/chat/completions", json=body, timeout=60).iter_lines())
    key = uuid.uuid4().hex
    seen = _start_and_kill(start_gateway(), body, key)
    last = max(i for i, _ in seen if i is not None)
    ready = threading.Barrier(2)

    def reattach(gateway) -> list[tuple[int | None, str]]:
        ready.wait()
        with httpx.stream("GET", gateway.url + f"/v1/streams/{key}", headers={"Last-Event-ID": str(last)},
                          timeout=60) as r:
            return _events(r.iter_lines())

    with ThreadPoolExecutor(2) as pool:
        rests = list(pool.map(reattach, [first, other]))
    assert rests[0] == rests[1]
    whole = seen + rests[0]
    assert [i for i, _ in whole if i is not None] == list(range(1, len(whole)))
    assert not any('"error"' in d for _, d in whole)
    assert _choice_texts(whole, "chat") == _choice_texts(reference, "chat")
    entries = redis_client.xrange(keys.journal(scoped("-", key)))
    assert [int(e[0].split(b"-")[1]) for e in entries] == list(range(1, len(whole) + 1))
    assert sum(e[1][b"d"] == b"data: [DONE]\n\n" for e in entries) == 1
