"""Open-loop streaming load: a plan of shots, fired on schedule, one outcome per shot.

A shot is one streaming ``/v1/completions`` request due at a fixed offset from the
plan's start, whatever happened to earlier ones (open loop: a slow server does not
slow the arrivals). The plan runs in child processes (spawned, so the sampler in the
parent keeps its share of the CPU and its sampling period), each with small
``httpx.AsyncClient`` pools per gateway; process ``k`` of ``n`` fires shots ``k::n``.
Times are ``time.monotonic()`` offsets, one clock for every process on the machine.

>>> shots = [Shot(at_s=i / 1000, gateway=i % 3, label="default") for i in range(10_000)]
>>> outcomes, cpu_s = await fire(urls, shots, processes=2)
"""

from __future__ import annotations

import asyncio
import multiprocessing
import resource
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import httpx
import orjson

from sluice.connection_bounds import descriptors
from sluice.processes import child_preexec

#: Seconds between launching the load processes and the plan's start.
LEAD_S = 2.0


@dataclass(frozen=True, slots=True)
class Shot:
    at_s: float
    gateway: int
    #: What the report groups by: a priority class or a tenant.
    label: str
    priority: int = 0
    max_tokens: int = 8
    api_key: str | None = None


@dataclass(slots=True)
class Outcome:
    label: str
    gateway: int
    #: When the request left (offset from the plan's start).
    sent_s: float
    #: HTTP status; 0 when no response came (connection refused, reset, timed out).
    status: int = 0
    retry_after: bool = False
    queue_ms: float | None = None
    head_s: float | None = None
    first_s: float | None = None
    end_s: float | None = None
    tokens: int = 0
    #: "" ok; "stream": an in-band error event; "truncated": no [DONE]; "transport:<exc>".
    error: str = ""

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.sent_s

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


async def _one(client: httpx.AsyncClient, shot: Shot, start: float) -> Outcome:
    out = Outcome(shot.label, shot.gateway, time.monotonic() - start)
    body = {"model": "sim", "prompt": "flood", "max_tokens": shot.max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "priority": shot.priority}
    headers = {"Authorization": f"Bearer {shot.api_key}"} if shot.api_key else {}
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
            out.status = resp.status_code
            out.head_s = time.monotonic() - start
            out.retry_after = "retry-after" in resp.headers
            if (queue_ms := resp.headers.get("x-sluice-queue-ms")) is not None:
                out.queue_ms = float(queue_ms)
            if resp.status_code != 200:
                await resp.aread()
                return out
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                data = orjson.loads(line[6:])
                if "error" in data:
                    out.error = "stream"
                elif data.get("choices") and out.first_s is None:
                    out.first_s = time.monotonic() - start
                if data.get("usage"):
                    out.tokens = int(data["usage"]["completion_tokens"])
            if not done and not out.error:
                out.error = "truncated"
    except httpx.HTTPError as exc:
        out.error = f"transport:{type(exc).__name__}"
    finally:
        out.end_s = time.monotonic() - start
    return out


class _Clients:
    """HTTP clients by gateway, each carrying at most ``GROUP`` of the plan's requests.

    httpcore scans its whole pool on every request and release (and, for each idle
    connection, the whole pool again): one pool of thousands of open streams made the
    load generator the bottleneck. Small pools without keep-alive keep each scan short;
    open-loop streams seldom find an idle connection to reuse anyway.
    """

    GROUP = 32

    def __init__(self, urls: list[str]) -> None:
        self._urls = urls
        self._clients: dict[tuple[int, int], httpx.AsyncClient] = {}
        self._sent = [0] * len(urls)

    def next_for(self, gateway: int) -> httpx.AsyncClient:
        group = self._sent[gateway] // self.GROUP
        self._sent[gateway] += 1
        client = self._clients.get((gateway, group))
        if client is None:
            # Plain HTTP: verify=False skips loading a CA bundle (tens of ms per client).
            client = self._clients[gateway, group] = httpx.AsyncClient(
                base_url=self._urls[gateway], verify=False, timeout=httpx.Timeout(600, connect=60, pool=60),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
            )
        return client

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()


async def _fire_here(urls: list[str], shots: list[Shot], start: float) -> list[Outcome]:
    clients = _Clients(urls)
    try:
        tasks = []
        for i, shot in enumerate(shots):
            delay = start + shot.at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            elif i % 64 == 0:
                await asyncio.sleep(0)  # behind schedule: still let started requests progress
            tasks.append(asyncio.create_task(_one(clients.next_for(shot.gateway), shot, start)))
        return list(await asyncio.gather(*tasks))
    finally:
        await clients.aclose()


def _fire_process(urls: list[str], shots: list[Shot], start: float) -> tuple[list[Outcome], float]:
    """Outcomes of ``shots``, and the CPU seconds this load process spent."""
    descriptors()  # as many as this process may have: thousands of streams
    try:
        import uvloop

        outcomes = uvloop.run(_fire_here(urls, shots, start))
    except ImportError:
        outcomes = asyncio.run(_fire_here(urls, shots, start))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return outcomes, usage.ru_utime + usage.ru_stime


async def fire(urls: list[str], shots: list[Shot], *, processes: int = 1, start: float | None = None,
               ) -> tuple[list[Outcome], float]:
    """Fire ``shots`` (sorted by ``at_s``) at ``urls`` from ``processes`` load processes.

    ``start`` is the plan's time zero (``time.monotonic()``), by default ``LEAD_S`` from now.
    Returns the outcomes by send time, and the CPU seconds the load processes spent.
    """
    start = time.monotonic() + LEAD_S if start is None else start
    loop = asyncio.get_running_loop()
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(processes, mp_context=context, initializer=child_preexec) as pool:
        parts = [loop.run_in_executor(pool, _fire_process, urls, shots[k::processes], start)
                 for k in range(processes)]
        results = await asyncio.gather(*parts)
    outcomes = sorted((o for part, _ in results for o in part), key=lambda o: o.sent_s)
    return outcomes, sum(cpu for _, cpu in results)
