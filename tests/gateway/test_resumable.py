"""Resumable streams: re-attach with Last-Event-ID and get the rest, with no duplicate."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import httpx
import orjson
import psutil
import pytest
import redis


@pytest.fixture(scope="module")
def resumable(start_worker, start_gateway):
    start_worker("resume", sim_token_ms=15, sim_ttft_ms=0)
    return start_gateway()


def _events(
    lines, enough: Callable[[list[tuple[int | None, str]]], bool] | None = None,
    out: list[tuple[int | None, str]] | None = None,
) -> list[tuple[int | None, str]]:
    """(id, data) per SSE event from an iterator of lines, appended to ``out`` as they
    arrive; stops early once ``enough(out)``."""
    out = [] if out is None else out
    ident = None
    for line in lines:
        if line.startswith("id: "):
            ident = int(line[4:].partition(".")[0])
        elif line.startswith("data: "):
            out.append((ident, line[6:]))
            ident = None
            if enough is not None and enough(out):
                break
    return out


async def _aevents(response: httpx.Response, seen: Callable[[int], None]) -> list[tuple[int | None, str]]:
    """``_events`` of a streamed response; ``seen(n)`` is called at its n-th event."""
    out: list[tuple[int | None, str]] = []
    ident = None
    async for line in response.aiter_lines():
        if line.startswith("id: "):
            ident = int(line[4:].partition(".")[0])
        elif line.startswith("data: "):
            out.append((ident, line[6:]))
            ident = None
            seen(len(out))
    return out


def _redis_connections(client: redis.Redis, proc) -> int:
    """The connections Redis lists from ``proc``, told apart by the process's own ports."""
    port = client.connection_pool.connection_kwargs["port"]
    ours = {c.laddr.port for c in psutil.Process(proc.pid).net_connections(kind="tcp")
            if c.raddr and c.raddr.port == port}
    return sum(1 for c in client.client_list() if int(c["addr"].rsplit(":", 1)[1]) in ours)


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


@pytest.mark.parametrize("how", ["POST", "GET"])
def test_a_client_that_attached_to_a_running_stream_ends_at_its_own_deadline(start_worker, start_gateway,
                                                                           how: str) -> None:
    """Regression (the nemesis, Cluster: nem-3832 followed a stream that did not go on for 33 s
    past its deadline, keep-alives only): a re-sent POST, or a GET re-attach carrying
    ``X-Sluice-Timeout-Ms``, that attaches to its key's stream follows it until its own
    deadline, then gets the in-band timeout and ``[DONE]``; the stream goes on for its first
    client."""
    start_worker("slow-attach", sim_token_ms=1500, sim_ttft_ms=0)
    gateway = start_gateway()
    # 8 tokens: the stream goes on ~10 s after its first event, past any follower's deadline
    # (CI once took ~3 s to attach the follower, and 4 tokens ended within its 2 s).
    body = {"model": "slow-attach", "prompt": "p", "max_tokens": 8, "ignore_eos": True, "stream": True}
    key = {"Idempotency-Key": uuid.uuid4().hex}
    first: list[tuple[int | None, str]] = []
    with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=30, headers=key) as r:
        lines = r.iter_lines()
        _events(lines, lambda got: len(got) >= 1, first)
        started = time.monotonic()
        deadline = {"X-Sluice-Timeout-Ms": "2000"}
        if how == "POST":
            again = httpx.post(gateway.url + "/v1/completions", json=body, timeout=30, headers={**key, **deadline})
        else:
            again = httpx.get(f"{gateway.url}/v1/streams/{key['Idempotency-Key']}", timeout=30,
                              headers={"Last-Event-ID": str(first[0][0]), **deadline})
        took = time.monotonic() - started
        rest = _events(lines, None, first)
    followed = _events(again.text.splitlines())
    assert took < 2.0 + 4.5, took  # the deadline and a loaded machine's slack (as test_redis_outage's)
    assert followed[-1][1] == "[DONE]" and '"timeout"' in followed[-2][1], followed
    assert rest[-1][1] == "[DONE]" and len([i for i, _ in rest if i]) == 8  # the stream went on


@pytest.mark.timeout(300)  # a 64 s stream, and 150 readers arriving a few at a time
async def test_reattached_readers_do_not_hold_a_redis_connection_each(
    start_worker, start_gateway, redis_client
) -> None:
    """Regression: every re-attached reader parked a Redis connection in XREAD BLOCK, so a
    few hundred readers of one stream exhausted the gateway's connection pool.

    Readers arrive a few at a time: an arriving request runs a few commands of its own
    (its key's record, the journal's existence), and a burst of 150 at once would open
    as many connections as the pool allows for that moment. Once attached, a reader
    must cost no connection.
    """
    start_worker("resume-many", sim_token_ms=80, sim_ttft_ms=0)
    gateway = start_gateway()
    key = uuid.uuid4().hex
    # 64 s: all 150 readers were attached ~1.1 s after the first event here with a real-model
    # run beside, after more than 16 s with the suite's four processes at once (make test), and
    # after more than the 32 s the stream lasted before in two CI runs of 2026-12-05 (each
    # reader is sent the whole journal so far, so arriving costs more the later it is).
    tokens = 800
    body = {**BODY, "model": "resume-many", "max_tokens": tokens}
    readers = 150  # more than the pool's 64 connections
    produced: asyncio.Queue[bool] = asyncio.Queue()  # True per event the first client gets, then False
    arriving = asyncio.Semaphore(8)
    attached = asyncio.Event()
    waiting = readers

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60, limits=limits) as client:

        async def first() -> list[tuple[int | None, str]]:
            async with client.stream("POST", "/v1/completions", json=body,
                                     headers={"Idempotency-Key": key}) as r:
                events = await _aevents(r, lambda n: produced.put_nowait(True))
            produced.put_nowait(False)
            return events

        def reader_seen(n: int) -> None:
            nonlocal waiting
            if n == 1:
                arriving.release()
                waiting -= 1
                if waiting == 0:
                    attached.set()

        async def reattach() -> list[tuple[int | None, str]]:
            await arriving.acquire()
            async with client.stream("GET", f"/v1/streams/{key}") as r:
                assert r.status_code == 200
                return await _aevents(r, reader_seen)

        whole_task = asyncio.create_task(first())
        assert await produced.get()
        tasks = [asyncio.create_task(reattach()) for _ in range(readers)]
        try:
            await asyncio.wait_for(attached.wait(), 120)
        except TimeoutError:
            held = await asyncio.to_thread(_redis_connections, redis_client, gateway)
            pytest.fail(f"{waiting} readers never got an event; the gateway holds {held} Redis connections")
        while not produced.empty():  # events from before every reader was attached
            assert produced.get_nowait(), "the stream ended before the readers were all attached"
        samples = []
        while await produced.get():  # while the stream is live, with every reader on it
            samples.append(await asyncio.to_thread(_redis_connections, redis_client, gateway))
        whole = await whole_task
        streams = await asyncio.gather(*tasks)
    assert len(samples) >= 10, "the stream ended before the readers were all attached"
    assert max(samples) <= 16, samples
    assert [i for i, _ in whole if i is not None] == list(range(1, tokens + 1))
    assert whole[-1][1] == "[DONE]"
    assert all(stream == whole for stream in streams)


async def test_resumable_requests_at_once_share_the_gateways_redis_connections(
    start_worker, start_gateway, redis_client
) -> None:
    """A resumable request claims its key, writes its journal and settles both: five round
    trips through redis-py's pool each, and a request waiting for one at once opened a
    connection of its own (22 in 15 s of 16 one-token streams, loadtest/peers/profile_gateway.py
    --resumable), up to the pool's bound, which every Redis user of the process shares. They
    run on one connection of their own now (gateway/streams/idempotency.py ``runner``)."""
    start_worker("resume-burst", sim_token_ms=5, sim_ttft_ms=0)
    gateway = start_gateway()
    body = {**BODY, "model": "resume-burst", "max_tokens": 3}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60,
                                 limits=httpx.Limits(max_connections=200)) as client:

        async def one() -> str:
            async with client.stream("POST", "/v1/completions", json=body,
                                     headers={"Idempotency-Key": uuid.uuid4().hex}) as r:
                assert r.status_code == 200
                events = await _aevents(r, lambda n: None)
            assert [i for i, _ in events if i is not None] == [1, 2, 3] and events[-1][1] == "[DONE]"
            return _text(events)

        await one()  # warm: its channels open
        held = await asyncio.to_thread(_redis_connections, redis_client, gateway)
        for _ in range(3):
            assert len(await asyncio.gather(*(one() for _ in range(48)))) == 48
        more = await asyncio.to_thread(_redis_connections, redis_client, gateway) - held
    assert more < 8, f"{more} more Redis connections held after 144 resumable requests, 48 at a time"


def test_first_reader_gets_each_event_as_it_is_produced(start_worker, resumable) -> None:
    """Regression: the first client of a resumable stream read the batched journal too,
    so it got its events in bursts ~200 ms apart (168 ms gaps at 5 ms per token)."""
    start_worker("resume-fast", sim_token_ms=5, sim_ttft_ms=0)
    body = {**BODY, "model": "resume-fast", "max_tokens": 200}
    httpx.post(resumable.url + "/v1/completions", json={**body, "stream": False}, timeout=30)  # warm up

    def long_gaps(headers: dict[str, str]) -> int:
        """Gaps of 100 ms or more between events, from the first token on (the bug made about
        five, one per journal flush; a busy machine makes the odd one)."""
        stamps = []
        with httpx.stream("POST", resumable.url + "/v1/completions", json=body, headers=headers,
                          timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    stamps.append(time.monotonic())
        assert len(stamps) == 201  # 200 tokens and [DONE]
        return sum(b - a >= 0.1 for a, b in zip(stamps[1:], stamps[2:], strict=False))

    plain = long_gaps({})
    # The bug's bursts come with every stream; a loaded machine's stalls come now and then
    # (CI, 2026-12-05: 2 long gaps against plain's 0, once): the best of three streams.
    tries = []
    for _ in range(3):
        tries.append(long_gaps({"Idempotency-Key": uuid.uuid4().hex}))
        if tries[-1] <= plain + 1:
            break
    assert min(tries) <= plain + 1, (tries, plain)
