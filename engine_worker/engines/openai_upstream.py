"""An OpenAI-compatible server that already runs (``vllm serve``, ``trtllm-serve``, SGLang,
TGI, ...) as a Sluice engine: the worker forwards each generation to it over HTTP.

    sluice worker --engine openai --upstream-url http://127.0.0.1:8001

What the server gives decides what Sluice can do with it:

- every server: streaming, cancellation (closing the stream aborts the request there),
  usage (``cached_tokens`` when it reports ``prompt_tokens_details``), health from
  ``GET /health``;
- a server that returns token ids (vLLM: ``return_token_ids``, detected through its
  ``/version``): the ids go to the gateway with every line, and a stream that breaks on
  another worker resumes here token-exactly: the prompt is tokenized by the server
  (``/tokenize``, its own chat template), and prompt ids + the ids already sent go to
  ``/v1/completions`` as a token prompt, so greedy decoding continues byte-identically;
- vLLM also gives ``priority`` (when started with ``--scheduling-policy priority``; a
  server that refuses it is asked again without it, and no more after that) and load
  from ``GET /metrics`` (running, waiting, KV-cache use, prefix-cache hits).

With ``--relay direct`` this worker only registers the server (capacity, health, load):
its record names the server (sluice/engine_server.py's relay URL) and gateways stream
from it themselves with the same request and response mapping (gateway/relay/direct.py).

A server without token ids streams text only: its lines carry no ids, and a stream that
was migrated to it is refused (``resume_unsupported``), since text cannot be continued
exactly through a chat template.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Literal

import httpx
import orjson

from engine_worker.engines.base import EngineStats
from engine_worker.protocol import Delta, GenerateRequest, KVEvent
from sluice.engine_server import EngineServer, relay_url, upstream_error
from sluice.errors import Unavailable
from sluice.http1 import Http1Pool

__all__ = ["OpenAIUpstreamEngine", "parse_metrics", "upstream_error"]

log = logging.getLogger("sluice.worker.openai")

TokenMode = Literal["auto", "on", "off"]

#: vLLM's gauges and counters that become EngineStats (summed over label sets).
_METRICS = {
    b"vllm:num_requests_running": "running",
    b"vllm:num_requests_waiting": "waiting",
    b"vllm:kv_cache_usage_perc": "kv_usage",
    b"vllm:prefix_cache_queries_total": "prefix_queries",
    b"vllm:prefix_cache_hits_total": "prefix_hits",
}


def parse_metrics(text: bytes) -> EngineStats | None:
    """EngineStats from a Prometheus exposition with vLLM's names; None when it has none."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(b"vllm:"):
            continue
        name, _, rest = line.partition(b"{")
        if not rest:
            name, _, rest = line.partition(b" ")
        field = _METRICS.get(name.strip())
        if field is None:
            continue
        try:
            found[field] = found.get(field, 0.0) + float(rest.rsplit(b" ", 1)[-1])
        except ValueError:
            continue
    if not found:
        return None
    return EngineStats(
        running=int(found.get("running", 0)),
        waiting=int(found.get("waiting", 0)),
        kv_usage=found.get("kv_usage", 0.0),
        prefix_queries=int(found.get("prefix_queries", 0)),
        prefix_hits=int(found.get("prefix_hits", 0)),
    )


class OpenAIUpstreamEngine:
    """One OpenAI-compatible server behind this worker; see the module docstring."""

    name = "openai"

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        capacity: int = 64,
        tokens: TokenMode = "auto",
        poll_s: float = 1.0,
        start_timeout_s: float = 600.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.capacity = capacity
        #: The upstream's own name for the model (what goes in each request's ``model``).
        self.model = model
        self._api_key = api_key
        self._tokens_mode = tokens
        #: Whether the server returns token ids and takes token prompts (vLLM).
        self.token_ids = tokens == "on"
        #: Requests and streams, once start() knows the model and whether it gives token ids.
        self.server: EngineServer | None = None
        self.healthy = False
        self._poll_s = poll_s
        self._start_timeout_s = start_timeout_s
        self._stats = EngineStats()
        self._http: httpx.AsyncClient | None = None
        #: Streams go through the lean client on plain HTTP: every token crosses it.
        self._streams = Http1Pool(connect_timeout_s=5.0)
        self._poller: asyncio.Task[None] | None = None
        self.aborted = 0

    def __repr__(self) -> str:
        return (f"OpenAIUpstreamEngine(url={self.url} model={self.model} token_ids={self.token_ids} "
                f"healthy={self.healthy} aborted={self.aborted})")

    @property
    def client(self) -> httpx.AsyncClient:
        assert self._http is not None, "start() first"
        return self._http

    async def start(self) -> None:
        headers = {"authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        # One client, a pool as large as the streams this worker may hold; no read timeout
        # (the gateway owns stall and deadline timeouts and closes the stream).
        self._http = httpx.AsyncClient(
            base_url=self.url, headers=headers, verify=False,
            timeout=httpx.Timeout(None, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=self.capacity + 8),
        )
        await self._wait_ready()
        if self._tokens_mode == "auto":
            self.token_ids = await self._is_vllm()
        log.info("upstream %s serves %r (token ids: %s)", self.url, self.model, self.token_ids)
        self.server = EngineServer(self.url, str(self.model), token_ids=self.token_ids, http=self.client,
                                   streams=self._streams, api_key=self._api_key)
        await self._poll_once()
        self._poller = asyncio.create_task(self._poll(), name="upstream-poll")

    async def _wait_ready(self) -> None:
        """Until the server answers /v1/models (it may still be loading its model)."""
        deadline = time.monotonic() + self._start_timeout_s
        while True:
            try:
                response = await self.client.get("/v1/models")
                if response.status_code == 200:
                    names = [m["id"] for m in orjson.loads(response.content).get("data", [])]
                    if self.model is None and names:
                        self.model = names[0]
                    if self.model is not None:
                        self.healthy = True
                        return
            except (httpx.HTTPError, orjson.JSONDecodeError, KeyError, TypeError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"upstream {self.url} did not list a model within {self._start_timeout_s:g}s")
            await asyncio.sleep(0.5)

    async def _is_vllm(self) -> bool:
        try:
            response = await self.client.get("/version")
            return response.status_code == 200 and "version" in orjson.loads(response.content)
        except (httpx.HTTPError, orjson.JSONDecodeError, TypeError):
            return False

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            await self._poll_once()

    async def _poll_once(self) -> None:
        """Health from /health; load from /metrics where the server speaks vLLM's names."""
        try:
            response = await self.client.get("/health")
            healthy = response.status_code == 200
        except httpx.HTTPError:
            healthy = False
        if healthy != self.healthy:
            log.warning("upstream %s is %s", self.url, "healthy again" if healthy else "unhealthy")
        self.healthy = healthy
        if not healthy:
            return
        try:
            response = await self.client.get("/metrics")
        except httpx.HTTPError:
            return
        if response.status_code == 200 and (stats := parse_metrics(response.content)) is not None:
            self._stats = stats

    async def shutdown(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        await self._streams.aclose()

    def relay_url(self) -> str:
        """What this worker registers under ``--relay direct``: the server itself, for gateways
        to call (see sluice/engine_server.py)."""
        return relay_url(self.url, str(self.model), self.token_ids)

    def stats(self) -> EngineStats:
        return self._stats

    def take_kv_events(self) -> list[KVEvent]:
        """An engine server behind HTTP publishes no KV events to us: the gateways' prefix
        index learns this worker's cache from routing and ``cached_tokens`` alone."""
        return []

    # -- requests ---------------------------------------------------------------------

    async def prompt_tokens(self, request: GenerateRequest) -> int:
        if not self.healthy or self.server is None:
            raise Unavailable("the upstream server is not healthy", retry_after_s=1)
        return await self.server.prompt_tokens(request)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Delta]:
        if not self.healthy or self.server is None:
            raise Unavailable("the upstream server is not healthy", retry_after_s=1)
        finished = False
        deltas = self.server.generate(request)
        try:
            async for delta in deltas:
                finished = delta.finish_reason is not None
                yield delta
        finally:
            await deltas.aclose()  # type: ignore[attr-defined]  # now, not at garbage collection: the server aborts the request
            if not finished:
                self.aborted += 1
