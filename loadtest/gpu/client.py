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

    async def send(self, body: dict[str, Any], path: str = "/v1/chat/completions",
                   keep_times: bool = False, **tags: Any) -> dict[str, Any]:
        body = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                "temperature": 0, **body}
        started = time.perf_counter()
        rec: dict[str, Any] = {**tags, "t_start": round(started - self.t0, 4), "ttft": None, "error": None,
                               "chunks": 0, "text": ""}
        times: list[float] = []
        parts: list[str] = []
        try:
            async with self.http.stream("POST", self.url + path, json=body) as response:
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
        if rec["error"] is None and ("prompt" not in rec or rec["ttft"] is None):
            rec["error"] = "no usage or no content"
        self.records.append(rec)
        return rec


async def closed_loop(recorder: Recorder, sessions: Iterator[Session], users: int, max_tokens: int,
                      seconds: float, max_requests: int) -> None:
    """``users`` users, each taking the next session and sending its turns one after another
    (a turn's answer joins the session's history before the next turn), until ``seconds``
    have passed or ``max_requests`` were sent: no request starts after that."""
    stop_at = time.perf_counter() + seconds
    sent = 0

    async def user() -> None:
        nonlocal sent
        while time.perf_counter() < stop_at and sent < max_requests:
            session = next(sessions)
            while not session.done and time.perf_counter() < stop_at and sent < max_requests:
                sent += 1
                rec = await recorder.send({"messages": session.messages(), "max_tokens": max_tokens,
                                           "ignore_eos": True}, turn=session.turn, multi=len(session.questions) > 1)
                if rec["error"] is not None:
                    break
                session.answered(rec["text"])

    await asyncio.gather(*(user() for _ in range(users)))
