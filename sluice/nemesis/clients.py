"""The nemesis's clients: each runs one request as an SDK user would, and records what it saw.

- plain stream: one POST; before any chunk arrived, a connection failure, 429 or 503 is
  retried on the other port (what a load balancer and the SDK do); once chunks flowed,
  whatever happens is the outcome.
- resumable stream (``Idempotency-Key``): a stream that breaks, stalls (no byte, not even
  a keep-alive ping, for ``RESUMABLE_READ_S``), ends with a retryable in-band error, or is
  left on purpose, is re-attached on another port with ``GET /v1/streams/{key}`` and
  ``Last-Event-ID``, or (``repost`` clients) with the SDK's retry: the same POST with the
  same key and ``Last-Event-ID``; a 404 on a GET is answered with that retry too (so is a
  503 to a GET holding no event: the stream may be one Redis lost, and holding nothing, the
  request is simply sent again), and so, once, is ``stream_history_lost`` (on a GET, or
  in-band on a POST whose stream could not be taken over) when the ``Last-Event-ID`` says
  what the client holds (as the error tells it: the POST runs the stream again, checked
  against that).
- non-streaming: one POST (half of them with an ``Idempotency-Key``), retried on the other
  port after a connection failure, 429, 502 or 503.

Some read slowly (``slow_s`` per event), some leave after a few events (a resumable one
comes back ``away_s`` later), and the ``client_cut`` fault cuts live streams at random.
A probe sends requests with a bogus key and with none: they must never be served.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from sluice.nemesis.history import Attempt, Chunk, ErrorSeen, History
from sluice.nemesis.workload import RequestSpec

#: Past its deadline plus this, a request without an outcome has hung (the checker adds the
#: time the nemesis held a gateway of its last attempt's port stopped: checker.hang_allowance_s).
GRACE_S = 20.0
#: The most of that stopped time a client waits for: past deadline + GRACE_S + this, it gives up.
STOPPED_MAX_S = 30.0
RESUMABLE_READ_S = 4.0
PLAIN_READ_S = 30.0
#: Longest wait for response headers: past the gateway's own longest waits (a queue timeout of
#: 10 s plus a stalled gateway's 7 s; a re-attach waits up to queue + TTFT timeouts, 25 s), and
#: past the deadline a request carries by :data:`HEADERS_PAST_DEADLINE_S`: the gateway answers
#: by its deadline + 1 s, counted from when its handler starts, which a loaded machine delays
#: (the nemesis, Cluster: a re-sent POST's handler began 4.4 s after its send; its 504 came 1.3 s
#: after this client had stopped waiting, and the checker called it a stall).
HEADERS_S = 35.0
HEADERS_PAST_DEADLINE_S = 8.0
MAX_ATTEMPTS = 16
#: In-band errors after which a resumable client re-attaches (the stream may go on elsewhere).
REATTACH_CODES = frozenset({"service_unavailable", "upstream_error"})
BOGUS_KEY = "sk-sluice-deadbeef-" + "x" * 43


class _Cut:
    __slots__ = ("set",)

    def __init__(self) -> None:
        self.set = False


class Cutter:
    """The ``client_cut`` fault's handle on the streams being read right now."""

    def __init__(self) -> None:
        self._live: dict[int, _Cut] = {}

    def register(self, index: int) -> _Cut:
        flag = self._live[index] = _Cut()
        return flag

    def unregister(self, index: int) -> None:
        self._live.pop(index, None)

    def cut(self, count: int, salt: int) -> list[int]:
        """Cut ``count`` live streams (fewer if fewer are live); returns their request indexes."""
        chosen = random.Random(salt).sample(sorted(self._live), min(count, len(self._live)))
        for index in chosen:
            self._live[index].set = True
        return chosen


@dataclass(slots=True)
class Probe:
    at_s: float
    status: int
    with_key: bool


class Clients:
    def __init__(self, ports: list[int], api_keys: list[str], cutter: Cutter, t0: float, tag: str) -> None:
        self.ports = ports
        self.urls = [f"http://127.0.0.1:{port}" for port in ports]
        self.api_keys = api_keys
        self.cutter = cutter
        self.t0 = t0
        self.tag = tag
        self.probes: list[Probe] = []
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=3.0, read=None, write=10.0, pool=None),
            limits=httpx.Limits(max_connections=2000, max_keepalive_connections=200),
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    def now_s(self) -> float:
        return time.monotonic() - self.t0

    async def run(self, spec: RequestSpec) -> History:
        await asyncio.sleep(max(0.0, spec.at_s - self.now_s()))
        hist = History(spec.index, started_s=self.now_s())
        try:
            async with asyncio.timeout(spec.deadline_s + GRACE_S + STOPPED_MAX_S):
                if spec.path == "nonstream":
                    await self._nonstream(spec, hist)
                elif spec.path == "plain":
                    await self._plain(spec, hist)
                else:
                    await self._resumable(spec, hist)
        except TimeoutError:
            hist.hung = True
        finally:
            self.cutter.unregister(spec.index)
        hist.ended_s = self.now_s()
        for attempt in hist.attempts:
            attempt.ended_s = attempt.ended_s or hist.ended_s
        return hist

    def _headers(self, spec: RequestSpec, hist: History) -> dict[str, str]:
        left_ms = (spec.deadline_s - (self.now_s() - hist.started_s)) * 1000
        return {"Authorization": f"Bearer {self.api_keys[spec.tenant]}", "x-request-id": spec.request_id,
                "X-Sluice-Timeout-Ms": str(max(1000, int(left_ms)))}

    def _past_deadline(self, spec: RequestSpec, hist: History) -> bool:
        return self.now_s() - hist.started_s > spec.deadline_s

    # --- plain ------------------------------------------------------------------------

    async def _plain(self, spec: RequestSpec, hist: History) -> None:
        port = spec.port_index
        for _ in range(3):
            att = await self._stream(spec, hist, "post", port, "POST", "/v1/chat/completions", spec.body(),
                                     self._headers(spec, hist), PLAIN_READ_S)
            if att.chunks or (att.errors and att.status == 200) or att.left or self._past_deadline(spec, hist):
                return
            if att.status not in (0, 429, 503):
                return
            port = (port + 1) % len(self.urls)
            await asyncio.sleep(min(att.retry_after_s or 0.3, 2.0))

    # --- resumable --------------------------------------------------------------------

    async def _resumable(self, spec: RequestSpec, hist: History) -> None:
        key = f"{self.tag}-{spec.index}"
        port, how, last, last_id = spec.port_index, "post", 0, ""
        regenerating = False
        for _ in range(MAX_ATTEMPTS):
            if how == "get":  # with the request's deadline, as its POSTs (gateway/app.py, reattach)
                headers = {**self._headers(spec, hist), "Last-Event-ID": last_id or "0"}
                att = await self._stream(spec, hist, how, port, "GET", f"/v1/streams/{key}", None, headers,
                                         RESUMABLE_READ_S, last)
            else:
                headers = {**self._headers(spec, hist), "Idempotency-Key": key}
                if last:
                    headers["Last-Event-ID"] = last_id
                att = await self._stream(spec, hist, how, port, "POST", "/v1/chat/completions", spec.body(),
                                         headers, RESUMABLE_READ_S, last)
            if att.event_ids:
                last, last_id = att.event_ids[-1], att.last_id
            # Lost but for this client, whose ids say what it holds: the in-band error (a stream
            # ended, [DONE] after it) or the 502 says to re-send the POST, which runs it again.
            # (A done stream with the in-band error returned here before, and the POST never went.)
            lost_but_held = not regenerating and last_id.count(".") == 4 and bool(att.errors) \
                and att.errors[-1].code == "stream_history_lost"
            if att.done and not lost_but_held and not (att.errors and att.errors[-1].code in REATTACH_CODES):
                return
            if self._past_deadline(spec, hist):
                return
            port = (port + 1) % len(self.urls)
            reattach = "repost" if spec.repost else "get"
            if att.left == "planned":
                await asyncio.sleep(spec.away_s)
                how = reattach
            elif how == "get" and (att.status == 404 or (att.status == 503 and not last)):
                # Nothing to attach to, or nothing held of a stream Redis may have lost (the
                # 503 says to send the request again with its body): the SDK retries it.
                await asyncio.sleep(min(att.retry_after_s or 0.0, 2.0))
                how = "repost"
            elif lost_but_held:
                how, regenerating = "repost", True
            elif att.status in (429, 503) or (att.status == 0 and not att.chunks and how != "get"):
                await asyncio.sleep(min(att.retry_after_s or 0.3, 2.0))
                how = "get" if how == "get" else "repost"
            elif att.status not in (0, 200):
                return  # a final answer (401, 409, 502, 504...)
            elif att.errors and att.errors[-1].code not in REATTACH_CODES:
                return
            else:
                how = reattach  # broke, stalled, cut, or a retryable in-band error: go on elsewhere
                await asyncio.sleep(0.1)

    # --- non-streaming ----------------------------------------------------------------

    async def _nonstream(self, spec: RequestSpec, hist: History) -> None:
        port = spec.port_index
        key = f"{self.tag}-{spec.index}" if spec.index % 2 == 0 else None
        for attempt in range(4):
            headers = self._headers(spec, hist)
            if key is not None:
                headers["Idempotency-Key"] = key
            att = Attempt("post" if attempt == 0 else "repost", self.ports[port], self.now_s())
            hist.attempts.append(att)
            try:
                resp = await self.http.post(self.urls[port] + "/v1/chat/completions", json=spec.body(),
                                            headers=headers, timeout=httpx.Timeout(spec.deadline_s + 5, connect=3))
            except httpx.TransportError as exc:
                att.broke = type(exc).__name__
            else:
                self._answer(att, resp)
            att.ended_s = self.now_s()
            if att.status == 200 or att.status not in (0, 429, 502, 503) or self._past_deadline(spec, hist):
                return
            port = (port + 1) % len(self.urls)
            await asyncio.sleep(min(att.retry_after_s or 0.3, 2.0))

    def _answer(self, att: Attempt, resp: httpx.Response) -> None:
        att.status = resp.status_code
        att.first_byte_s = self.now_s()
        att.retry_after_s = _retry_after(resp)
        try:
            body: Any = orjson.loads(resp.content)
        except orjson.JSONDecodeError:
            body = resp.text
        if resp.status_code != 200:
            att.errors.append(ErrorSeen.from_body(resp.status_code, body, False))
            return
        for choice in body.get("choices", []):
            att.chunks.append(Chunk(None, body.get("id"), choice["index"], choice["message"].get("content") or "",
                                    choice.get("finish_reason")))
        att.usage = body.get("usage")
        att.done = True

    # --- one streaming attempt --------------------------------------------------------

    async def _stream(self, spec: RequestSpec, hist: History, how: str, port: int, method: str, path: str,
                      body: dict[str, object] | None, headers: dict[str, str], read_s: float,
                      last: int = 0) -> Attempt:
        att = Attempt(how, self.ports[port], self.now_s(), last_event_id=last)
        hist.attempts.append(att)
        cut = self.cutter.register(spec.index)
        seen = sum(len(a.event_ids) or len(a.chunks) for a in hist.attempts)
        planned_leave = spec.leave_after is not None and not any(a.left == "planned" for a in hist.attempts)
        try:
            wait_s = max(HEADERS_S, int(headers.get("X-Sluice-Timeout-Ms", 0)) / 1000 + HEADERS_PAST_DEADLINE_S)
            async with asyncio.timeout(wait_s) as headers_timeout:
                async with self.http.stream(method, self.urls[port] + path, json=body, headers=headers) as resp:
                    headers_timeout.reschedule(None)
                    att.status = resp.status_code
                    att.first_byte_s = self.now_s()
                    if resp.status_code != 200:
                        await resp.aread()
                        self._answer(att, resp)
                        return att
                    seen = await self._read(spec, att, resp, cut, read_s, seen, planned_leave)
        except TimeoutError:
            att.stalled = True
        except httpx.TransportError as exc:
            att.broke = type(exc).__name__
        finally:
            att.ended_s = self.now_s()
            self.cutter.unregister(spec.index)
        return att

    async def _read(self, spec: RequestSpec, att: Attempt, resp: httpx.Response, cut: _Cut, read_s: float,
                    seen: int, planned_leave: bool) -> int:
        lines = resp.aiter_lines()
        event_id: int | None = None
        raw_id = ""
        while True:
            try:
                line = await asyncio.wait_for(anext(lines), read_s)
            except StopAsyncIteration:
                return seen
            except TimeoutError:
                att.stalled = True
                return seen
            if cut.set:
                att.left = "cut"
                return seen
            if line.startswith("id: "):
                raw_id = line[4:]
                event_id = int(raw_id.partition(".")[0])  # N.tag (gateway/streams/event_ids.py)
                continue
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                att.done = True
                return seen
            obj = orjson.loads(line[6:])
            if event_id is not None:
                att.event_ids.append(event_id)
                att.last_id = raw_id
            if "error" in obj:
                att.errors.append(ErrorSeen.from_body(200, obj, True))
            else:
                for choice in obj.get("choices") or ():
                    att.chunks.append(Chunk(event_id, obj.get("id"), choice["index"],
                                            (choice.get("delta") or {}).get("content") or "",
                                            choice.get("finish_reason")))
                if obj.get("usage"):
                    att.usage = obj["usage"]
            event_id = None
            seen += 1
            if spec.slow_s:
                await asyncio.sleep(spec.slow_s)
            if planned_leave and spec.leave_after is not None and seen >= spec.leave_after:
                att.left = "planned"
                return seen

    # --- probes -----------------------------------------------------------------------

    async def probe(self, every_s: float, until_s: float) -> None:
        """Requests with a bogus key and with none, every ``every_s``: never to be served."""
        body = {"model": "sim", "messages": [{"role": "user", "content": "probe"}], "max_tokens": 2}
        i = 0
        while self.now_s() < until_s:
            with_key = i % 2 == 0
            headers = {"Authorization": f"Bearer {BOGUS_KEY}"} if with_key else {}
            try:
                resp = await self.http.post(self.urls[i % len(self.urls)] + "/v1/chat/completions", json=body,
                                            headers=headers, timeout=10)
                status = resp.status_code
            except httpx.TransportError:
                status = 0
            self.probes.append(Probe(self.now_s(), status, with_key))
            i += 1
            await asyncio.sleep(every_s)


def _retry_after(resp: httpx.Response) -> float | None:
    try:
        return float(resp.headers["retry-after"])
    except (KeyError, ValueError):
        return None
