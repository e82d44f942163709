"""A resumable stream outlives its gateway: when the gateway producing it dies, another
one continues it from the journal, and the client re-attached there gets exactly the
rest of the uninterrupted stream."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest

from gateway.streams.idempotency import scoped
from sluice import keys
from tests.conftest import wait_for
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
    start_worker(REFERENCE, sim_token_ms=0, sim_ttft_ms=0)
    return start_gateway(), start_gateway()


#: A fast worker for the uninterrupted references: the simulator's text depends only on
#: (prompt, seed, position), so it writes what the slow "takeover" workers would, at once.
REFERENCE = "takeover-reference"


def _reference(gateway, path: str, body: dict[str, object]) -> list[tuple[int | None, str]]:
    """``body``'s whole stream, uninterrupted."""
    return _events(httpx.post(gateway.url + path, json={**body, "model": REFERENCE}, timeout=60).iter_lines())


@pytest.mark.parametrize("n", [1, 2])
def test_a_stream_whose_gateway_was_killed_is_continued_by_another(two_gateways, start_gateway, n: int) -> None:
    first, other = two_gateways
    dying = start_gateway()  # its own, so the module's gateways survive the test
    body = {"model": "takeover", "messages": [{"role": "user", "content": f"tell a long story {n}"}],
            "max_tokens": 150, "n": n, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    reference = _reference(first, "/v1/chat/completions", body)
    key = uuid.uuid4().hex

    with httpx.stream("POST", dying.url + "/v1/chat/completions", json=body,
                      headers={"Idempotency-Key": key}, timeout=60) as r:
        lines = r.iter_lines()  # keep a reference: a dropped iterator closes the stream
        seen = _events(lines, lambda events: len(events) >= 40)
        dying.kill()  # SIGKILL mid-stream: no clean-up, its journal just stops
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


Events = list[tuple[int | None, str]]


def _start_and_kill(gateway, body: dict[str, object], key: str, events: int = 40) -> Events:
    """Stream ``body`` from ``gateway`` until ``events`` events, then SIGKILL the gateway."""
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body,
                      headers={"Idempotency-Key": key}, timeout=60) as r:
        lines = r.iter_lines()  # keep a reference: a dropped iterator closes the stream
        seen = _events(lines, lambda out: len(out) >= events)
        gateway.kill()
    return seen


def _seed_with_lengths(prompt: str, first_at_least: int, second_at_most: int) -> int:
    """A seed whose choice 0 runs long and choice 1 ends early (the simulator's natural lengths)."""
    from engine_worker.engines.sim import SimSequence

    return next(seed for seed in range(10_000)
                if SimSequence(prompt, seed).natural_length >= first_at_least
                and SimSequence(prompt, seed + 1).natural_length <= second_at_most)


def test_n_choices_take_over_counts_the_prompt_once(two_gateways, start_gateway) -> None:
    """Regression: a take-over added the prompt tokens of every choice that had finished
    before it, and the choices it continued added theirs again: ``usage.prompt_tokens``
    was 14 for a prompt of 7 with ``n=2``."""
    first, other = two_gateways
    dying = start_gateway()
    prompt = "count the prompt once please"
    body = {"model": "takeover", "prompt": prompt, "n": 2, "max_tokens": 400, "stream": True,
            "seed": _seed_with_lengths(prompt, 180, 50), "stream_options": {"include_usage": True}}
    reference = _reference(first, "/v1/completions", body)
    key = uuid.uuid4().hex

    def after_a_finish(events: Events) -> int:
        """Events since the first that finished a choice (-1: none finished yet)."""
        finished = [i for i, (_, data) in enumerate(events) if '"finish_reason":"' in data]
        return len(events) - finished[0] - 1 if finished else -1

    with httpx.stream("POST", dying.url + "/v1/completions", json=body, headers={"Idempotency-Key": key},
                      timeout=60) as r:
        lines = r.iter_lines()  # keep a reference: a dropped iterator closes the stream
        seen = _events(lines, lambda events: after_a_finish(events) >= 3)
        dying.kill()
    assert after_a_finish(seen) == 3 and '"index":1' in next(d for _, d in seen if '"finish_reason":"' in d), \
        "choice 1 should have finished before choice 0"
    last = max(i for i, _ in seen if i is not None)
    with httpx.stream("GET", other.url + f"/v1/streams/{key}", headers={"Last-Event-ID": str(last)},
                      timeout=60) as r:
        rest = _events(r.iter_lines())
    whole = seen + rest
    assert whole[-1][1] == "[DONE]"
    assert _choice_texts(whole, "text") == _choice_texts(reference, "text")
    usage, expected = orjson.loads(whole[-2][1])["usage"], orjson.loads(reference[-2][1])["usage"]
    assert usage["prompt_tokens"] == expected["prompt_tokens"] == len(prompt.split())
    assert usage == expected


def _chunk_ids(events: list[tuple[int | None, str]]) -> set[str]:
    return {orjson.loads(d)["id"] for _, d in events if d.startswith("{") and '"id"' in d}


def stall_while_taken_over(stalled, other, body: dict[str, object],
                           key: str) -> tuple[Events, Events, threading.Thread, str]:
    """Stream ``body`` from ``stalled`` for 20 events, then SIGSTOP it until a reader
    re-attached on ``other`` got 5 events of its take-over, then SIGCONT it. Returns the
    events seen, the reader's (still filling), the reader's thread, and the request id.

    "Of its take-over": the reader's first events may be ones the producer journaled before it
    stopped (a client lags its producer; on a loaded machine by more than 5 events): waking
    the producer then let it go on with no take-over at all, and a test waiting for the
    take-over's part timed out (CI, 2026-12-06 and 2026-12-07). So it waits for the take-over
    itself, in ``other``'s log."""
    with httpx.stream("POST", stalled.url + "/v1/chat/completions", json=body,
                      headers={"Idempotency-Key": key}, timeout=60) as r:
        request_id = r.headers["x-request-id"]
        lines = r.iter_lines()  # keep a reference: a dropped iterator closes the stream
        seen = _events(lines, lambda events: len(events) >= 20)
        os.kill(stalled.pid, signal.SIGSTOP)
    last = max(i for i, _ in seen if i is not None)
    rest: Events = []

    def follow() -> None:
        with httpx.stream("GET", other.url + f"/v1/streams/{key}", headers={"Last-Event-ID": str(last)},
                          timeout=60) as r:
            _events(r.iter_lines(), out=rest)

    reader = threading.Thread(target=follow)
    try:
        reader.start()
        taking_over = f"request {request_id}: taking over its resumable stream"
        wait_for(lambda: len(rest) >= 5 and taking_over in other.log_path.read_text(errors="replace"), 30,
                 "the other gateway to take the stream over")
    finally:
        os.kill(stalled.pid, signal.SIGCONT)
    return seen, rest, reader, request_id


def test_a_gateway_that_lost_its_stream_to_a_take_over_leaves_the_key_alone(two_gateways, start_gateway) -> None:
    """Regression: a gateway stalled past ``:live``'s TTL (SIGSTOP here; a GC pause or a
    Redis blip in life) lost its stream to a take-over, woke, and forgot the
    Idempotency-Key while the other gateway still produced the stream: the client's retry
    started a second generation, spliced into the journal the re-attached reader follows."""
    first, other = two_gateways
    stalled = start_gateway()
    body = {"model": "takeover", "messages": [{"role": "user", "content": "stall, then wake"}],
            "max_tokens": 400, "ignore_eos": True, "stream": True}
    key = uuid.uuid4().hex
    seen, rest, reader, _ = stall_while_taken_over(stalled, other, body, key)
    wait_for(lambda: "taken over by another gateway" in stalled.log_path.read_text(), 10,
             "the stalled gateway to find its stream taken over")
    wait_for(lambda: "sluice.access" in stalled.log_path.read_text(), 10, "the stalled gateway to end its part")
    retry = _events(httpx.post(first.url + "/v1/chat/completions", json=body, headers={"Idempotency-Key": key},
                               timeout=60).iter_lines())
    reader.join(60)
    assert _chunk_ids(seen + rest + retry) == _chunk_ids(seen), "a second generation started"
    assert retry == seen + rest
    assert retry[-1][1] == "[DONE]" and not any('"error"' in d for _, d in retry)


def test_a_take_over_refuses_a_journal_missing_its_first_events(two_gateways, start_gateway,
                                                                redis_client) -> None:
    """Regression: a take-over continued from whatever the journal still held; after a trim
    it resumed from a truncated token history (3,988 wrong tokens against 2,500 allowed).
    (A stream that can be generated again is, checked against its last event: below; one
    with logprobs cannot.)"""
    _, other = two_gateways
    body = {"model": "takeover", "messages": [{"role": "user", "content": "a history"}],
            "max_tokens": 150, "ignore_eos": True, "stream": True, "logprobs": True}
    key = uuid.uuid4().hex
    seen = _start_and_kill(start_gateway(), body, key)
    journal = keys.journal(scoped("-", key))
    redis_client.xtrim(journal, minid="0-21", approximate=False)  # events 1..20 lost (a trim, a failover)
    # What the dead gateway journaled past what its client read (a loaded machine's client
    # lags its producer) is the stream's own history: the reader gets it, then the refusal.
    journaled = int(redis_client.xrevrange(journal, count=1)[0][0].split(b"-")[1])
    last = max(i for i, _ in seen if i is not None)
    with httpx.stream("GET", other.url + f"/v1/streams/{key}", headers={"Last-Event-ID": str(last)},
                      timeout=60) as r:
        rest = _events(r.iter_lines())
    assert [d for _, d in rest][-1] == "[DONE]"
    errors = [orjson.loads(d)["error"] for _, d in rest if d.startswith('{"error"')]
    assert [e["code"] for e in errors] == ["stream_history_lost"], rest
    delivered = [i for i, _ in rest if i is not None]
    assert all(i <= journaled for i in delivered), "events were produced from a partial history"
    assert delivered == list(range(last + 1, journaled + 1)), "the journaled rest was not delivered whole"
    assert redis_client.exists(keys.journal_live(scoped("-", key))) == 0  # the refusing gateway let go
    assert redis_client.exists(keys.idempotency(scoped("-", key))) == 0  # forgotten: a retry runs again


def test_a_take_over_of_a_journal_missing_its_first_events_generates_the_stream_again(
        two_gateways, start_gateway, redis_client) -> None:
    """A journal that starts past event 1 (a stream generated again journals only what its
    client did not hold; here a trim) is not continued from what it holds: the stream is
    generated again, checked against the account its last event carries, and the reader
    gets exactly the rest."""
    _, other = two_gateways
    body = {"model": "takeover", "messages": [{"role": "user", "content": "a history again"}],
            "max_tokens": 150, "ignore_eos": True, "stream": True}
    key = uuid.uuid4().hex
    seen = _start_and_kill(start_gateway(), body, key)
    redis_client.xtrim(keys.journal(scoped("-", key)), minid="0-21", approximate=False)  # events 1..20 lost
    last = max(i for i, _ in seen if i is not None)
    with httpx.stream("GET", other.url + f"/v1/streams/{key}", headers={"Last-Event-ID": str(last)},
                      timeout=60) as r:
        rest = _events(r.iter_lines())
    whole = seen + rest
    ids = [i for i, _ in whole if i is not None]
    assert ids == list(range(1, len(ids) + 1)), "an event was repeated or skipped"
    assert whole[-1][1] == "[DONE]" and not any('"error"' in d for _, d in whole), rest[-3:]
    plain = {k: v for k, v in body.items() if k != "stream"}
    reference = httpx.post(other.url + "/v1/chat/completions", json=plain, timeout=60).json()
    text = "".join(c["delta"].get("content") or "" for _, d in whole if d.startswith("{")
                   for c in orjson.loads(d).get("choices", ()))
    assert text == reference["choices"][0]["message"]["content"]


def test_a_take_over_of_a_stream_whose_plan_redis_lost_says_its_history_is_lost(two_gateways, start_gateway,
                                                                                redis_client) -> None:
    """Regression (nemesis): a stream whose gateway died (or stopped producing) after Redis
    lost its plan ended its readers with "the stream's producer is gone; the rest is lost",
    which tells a client nothing about why: it is ``stream_history_lost``, as for any
    journal Redis lost part of."""
    _, other = two_gateways
    body = {"model": "takeover", "messages": [{"role": "user", "content": "a plan"}],
            "max_tokens": 150, "ignore_eos": True, "stream": True}
    key = uuid.uuid4().hex
    seen = _start_and_kill(start_gateway(), body, key)
    redis_client.delete(keys.journal_plan(scoped("-", key)))  # Redis lost the plan
    last = max(i for i, _ in seen if i is not None)
    with httpx.stream("GET", other.url + f"/v1/streams/{key}", headers={"Last-Event-ID": str(last)},
                      timeout=60) as r:
        rest = _events(r.iter_lines())
    errors = [orjson.loads(d)["error"] for _, d in rest if d.startswith('{"error"')]
    assert [e["code"] for e in errors] == ["stream_history_lost"], rest
    assert [d for _, d in rest][-1] == "[DONE]"
    assert redis_client.exists(keys.idempotency(scoped("-", key))) == 0  # forgotten: a retry runs again


def test_two_gateways_racing_to_take_over_one_stream_produce_it_once(two_gateways, start_gateway,
                                                                     redis_client) -> None:
    """Readers on two gateways find the producer gone at the same moment: one of the two
    takes the stream over; both readers get the same, whole rest of it."""
    first, other = two_gateways
    body = {"model": "takeover", "messages": [{"role": "user", "content": "a race"}],
            "max_tokens": 150, "ignore_eos": True, "stream": True}
    reference = _reference(first, "/v1/chat/completions", body)
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
