"""A streaming chat client that keeps what the bench measures: TTFT, every chunk's time,
the text, and the usage (``cached_tokens``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson

from loadtest.gpu.workloads import Session


class Recorder:
    def __init__(self, http: httpx.AsyncClient, url: str, model: str) -> None:
        self.http, self.url, self.model = http, url, model
        self.records: list[dict[str, Any]] = []
        #: Content chunks received so far, over every request.
        self.received = 0
        self.t0 = time.perf_counter()
        self.wall0 = time.time()  # t0 on the wall clock
        #: Set: each request sends ``x-request-id: {rid_prefix}{n}`` and its record keeps it
        #: (loadtest/gpu/diagnose.py joins it with the gateway's access line).
        self.rid_prefix: str | None = None
        self._sent = 0
        #: The event loop's lateness (s), sampled by closed_loop: the load generator's own delay.
        self.lags: list[float] = []

    def _rid(self) -> str | None:
        if self.rid_prefix is None:
            return None
        self._sent += 1
        return f"{self.rid_prefix}{self._sent}"

    async def send(self, body: dict[str, Any], path: str = "/v1/chat/completions",
                   keep_times: bool = False, http: httpx.AsyncClient | None = None, **tags: Any) -> dict[str, Any]:
        body = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                "temperature": 0, **body}
        rid = self._rid()
        started = time.perf_counter()
        rec: dict[str, Any] = {**tags, "t_start": round(started - self.t0, 4), "ttft": None, "error": None,
                               "chunks": 0, "text": ""}
        if rid is not None:
            rec["rid"] = rid
        times: list[float] = []
        parts: list[str] = []
        try:
            async with (http or self.http).stream("POST", self.url + path, json=body,
                                        headers={"x-request-id": rid} if rid else None) as response:
                if response.status_code != 200:
                    await response.aread()
                    rec["error"] = f"HTTP {response.status_code}: {response.text[:200]}"
                else:
                    async for line in response.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = orjson.loads(line[6:])
                        if "error" in chunk:
                            rec["error"] = "in-band: " + str(chunk["error"])[:200]
                        choices = chunk.get("choices")
                        if choices:
                            piece = choices[0].get("delta", {}).get("content") if "delta" in choices[0] \
                                else choices[0].get("text")
                            if piece:
                                now = time.perf_counter()
                                rec["chunks"] += 1
                                self.received += 1
                                parts.append(piece)
                                times.append(now)
                                if rec["ttft"] is None:
                                    rec["ttft"] = now - started
                        if usage := chunk.get("usage"):
                            rec["prompt"] = usage["prompt_tokens"]
                            rec["completion"] = usage["completion_tokens"]
                            rec["cached"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
        except httpx.HTTPError as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"[:200]
        rec["latency"] = time.perf_counter() - started
        rec["t_end"] = round(time.perf_counter() - self.t0, 4)
        rec["text"] = "".join(parts)
        if keep_times:
            rec["times"] = [round(t - self.t0, 4) for t in times]
            rec["pieces"] = parts
        if rec["error"] is None and ("prompt" not in rec or rec["ttft"] is None):
            rec["error"] = "no usage or no content"
        self.records.append(rec)
        return rec


class DirectRecorder(Recorder):
    """The same records, straight from the workers (no gateway): each request goes to the
    next of ``urls`` in turn, as the worker's NDJSON (``POST /internal/generate``)."""

    def __init__(self, http: httpx.AsyncClient, urls: list[str], model: str) -> None:
        super().__init__(http, urls[0], model)
        self.urls = urls
        self._next = 0

    async def send(self, body: dict[str, Any], path: str = "", keep_times: bool = False,
                   http: httpx.AsyncClient | None = None, **tags: Any) -> dict[str, Any]:
        url = self.urls[self._next % len(self.urls)]
        self._next += 1
        rid = self._rid() or f"d{self._next}"
        payload = {"request_id": rid, "model": self.model, "temperature": 0, **body}
        started = time.perf_counter()
        rec: dict[str, Any] = {**tags, "t_start": round(started - self.t0, 4), "ttft": None, "error": None,
                               "chunks": 0, "text": "", "rid": rid, "worker_url": url}
        parts: list[str] = []
        try:
            async with (http or self.http).stream("POST", url + "/internal/generate", json=payload) as response:
                if response.status_code != 200:
                    await response.aread()
                    rec["error"] = f"HTTP {response.status_code}: {response.text[:200]}"
                else:
                    buffer = b""
                    async for raw in response.aiter_raw():
                        buffer += raw
                        *lines, buffer = buffer.split(b"\n")
                        for line in lines:
                            if not line:
                                continue
                            d = orjson.loads(line)
                            if "error" in d:
                                rec["error"] = "in-band: " + str(d["error"])[:200]
                            if d.get("text") or d.get("ids"):
                                rec["chunks"] += 1
                                self.received += 1
                                parts.append(d.get("text") or "")
                                if rec["ttft"] is None:
                                    rec["ttft"] = time.perf_counter() - started
                            if usage := d.get("usage"):
                                rec["prompt"] = usage["prompt_tokens"]
                                rec["completion"] = usage["completion_tokens"]
                                rec["cached"] = usage.get("cached_tokens", 0) or 0
        except httpx.HTTPError as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"[:200]
        rec["latency"] = time.perf_counter() - started
        rec["t_end"] = round(time.perf_counter() - self.t0, 4)
        rec["text"] = "".join(parts)
        if rec["error"] is None and ("prompt" not in rec or rec["ttft"] is None):
            rec["error"] = "no usage or no content"
        self.records.append(rec)
        return rec


async def _watch_lag(recorder: Recorder, stop_at: float, period_s: float = 0.02) -> None:
    loop = asyncio.get_running_loop()
    while time.perf_counter() < stop_at:
        before = loop.time()
        await asyncio.sleep(period_s)
        recorder.lags.append(loop.time() - before - period_s)


async def closed_loop(recorder: Recorder, sessions: Iterator[Session], users: int, max_tokens: int,
                      seconds: float, max_requests: int, users_per_client: int = 8) -> None:
    """``users`` users, each taking the next session and sending its turns one after another
    (a turn's answer joins the session's history before the next turn), until ``seconds``
    have passed or ``max_requests`` were sent: no request starts after that.

    Every ``users_per_client`` users share an HTTP client of their own (0: all share the
    recorder's). One httpx client for 64 streams saturated the load generator: httpcore
    1.0's pool goes over every connection, and for each idle one over every connection
    again, at each request's start and end, so its cost per request grows with the square
    of the connections; on the H200 (2026-12-03) the generator's process ran at one full
    core and requests waited seconds in it before reaching the gateway (README)."""
    stop_at = time.perf_counter() + seconds
    sent = 0
    groups = -(-users // users_per_client) if users_per_client > 0 else 0
    clients = [httpx.AsyncClient(timeout=recorder.http.timeout, limits=httpx.Limits(
        max_connections=2 * users_per_client, max_keepalive_connections=2 * users_per_client))
        for _ in range(groups)]

    async def user(i: int) -> None:
        nonlocal sent
        http = clients[i // users_per_client] if clients else None
        while time.perf_counter() < stop_at and sent < max_requests:
            session = next(sessions)
            while not session.done and time.perf_counter() < stop_at and sent < max_requests:
                sent += 1
                rec = await recorder.send({"messages": session.messages(), "max_tokens": max_tokens,
                                           "ignore_eos": True}, http=http, turn=session.turn,
                                          multi=len(session.questions) > 1)
                if rec["error"] is not None:
                    break
                session.answered(rec["text"])

    try:
        await asyncio.gather(_watch_lag(recorder, stop_at), *(user(i) for i in range(users)))
    finally:
        for client in clients:
            await client.aclose()
