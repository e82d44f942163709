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

A server without token ids streams text only: its lines carry no ids, and a stream that
was migrated to it is refused (``resume_unsupported``), since text cannot be continued
exactly through a chat template.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

import httpx
import orjson

from engine_worker.engines.base import EngineStats
from engine_worker.protocol import Delta, GenerateRequest, KVEvent, Usage
from sluice.errors import (
    Conflict,
    InvalidRequest,
    ModelNotFound,
    SluiceError,
    Unavailable,
    UpstreamFailed,
)
from sluice.http1 import Http1Pool, Http1Response

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


def upstream_error(status: int, body: bytes) -> SluiceError:
    """The server's refusal in Sluice's error tree: its 4xx are the client's (not retried on
    other workers), its 5xx and 429 are this worker's (the gateway tries another)."""
    try:
        err = orjson.loads(body)
        err = err.get("error", err) if isinstance(err, dict) else {}
        message = str(err.get("message") or err.get("detail") or "")[:500] if isinstance(err, dict) else ""
    except orjson.JSONDecodeError:
        message = ""
    message = message or f"upstream server answered {status}"
    if status == 404:
        return ModelNotFound(f"upstream server: {message}")
    if status in (400, 422):
        code = "context_length_exceeded" if "context length" in message.lower() else None
        return InvalidRequest(f"upstream server: {message}", code=code)
    if status == 429 or status >= 500:
        return Unavailable(f"upstream server answered {status}: {message}", retry_after_s=1)
    return UpstreamFailed(f"upstream server answered {status}: {message}")


def _chat_logprobs(logprobs: Any) -> list[list[Any]] | None:
    if not isinstance(logprobs, dict) or not logprobs.get("content"):
        return None
    return [
        [e.get("token", ""), e.get("logprob", 0.0),
         [[t.get("token", ""), t.get("logprob", 0.0)] for t in e.get("top_logprobs") or ()]]
        for e in logprobs["content"]
    ]


def _text_logprobs(logprobs: Any) -> list[list[Any]] | None:
    if not isinstance(logprobs, dict) or not logprobs.get("tokens"):
        return None
    tops = logprobs.get("top_logprobs") or [None] * len(logprobs["tokens"])
    return [
        [token, lp if lp is not None else 0.0, sorted(([t, v] for t, v in (top or {}).items()), key=lambda x: -x[1])]
        for token, lp, top in zip(logprobs["tokens"], logprobs.get("token_logprobs") or (), tops, strict=False)
    ]


async def _drain(raw: AsyncIterator[bytes]) -> None:
    """Read what is left of a finished body (its terminating chunk), briefly, so that the
    connection goes back to the pool instead of being closed."""
    with contextlib.suppress(TimeoutError, httpx.HTTPError):
        async with asyncio.timeout(0.05):
            async for _ in raw:
                pass


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
        #: Whether ``priority`` is passed on; cleared when the server refuses it.
        self.priority = True
        self.healthy = False
        self._poll_s = poll_s
        self._start_timeout_s = start_timeout_s
        self._stats = EngineStats()
        self._http: httpx.AsyncClient | None = None
        #: Streams go through the lean client on plain HTTP: every token crosses it.
        self._streams = Http1Pool(connect_timeout_s=5.0) if self.url.startswith("http://") else None
        self._headers = {"content-type": "application/json",
                         **({"authorization": f"Bearer {api_key}"} if api_key else {})}
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
        if self._streams is not None:
            await self._streams.aclose()

    def stats(self) -> EngineStats:
        return self._stats

    def take_kv_events(self) -> list[KVEvent]:
        """An engine server behind HTTP publishes no KV events to us: the gateways' prefix
        index learns this worker's cache from routing and ``cached_tokens`` alone."""
        return []

    # -- requests ---------------------------------------------------------------------

    def _sampling(self, request: GenerateRequest, chat: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                                "max_tokens": request.max_tokens}
        for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty"):
            value = getattr(request, name)
            if value is not None:
                body[name] = value
        if request.stop:
            body["stop"] = request.stop
        if request.logprobs is not None:
            if chat:
                body["logprobs"] = True
                body["top_logprobs"] = request.logprobs
            else:
                body["logprobs"] = request.logprobs
        # Extensions most servers share (vLLM, SGLang, trtllm-serve); sent only when used.
        if request.top_k is not None:
            body["top_k"] = request.top_k
        if request.repetition_penalty is not None:
            body["repetition_penalty"] = request.repetition_penalty
        if request.ignore_eos:
            body["ignore_eos"] = True
        if request.min_tokens:
            body["min_tokens"] = request.min_tokens
        if self.token_ids:
            body["return_token_ids"] = True
        if self.priority and request.priority:
            body["priority"] = request.priority
        return body

    async def _post_json(self, path: str, body: dict[str, Any]) -> Any:
        try:
            response = await self.client.post(path, content=orjson.dumps(body),
                                               headers={"content-type": "application/json"})
        except httpx.HTTPError as exc:
            raise Unavailable(f"upstream server unreachable: {type(exc).__name__}", retry_after_s=1) from None
        if response.status_code != 200:
            raise upstream_error(response.status_code, response.content)
        return orjson.loads(response.content)

    async def _resume_body(self, request: GenerateRequest) -> tuple[str, dict[str, Any], str]:
        """A migrated stream: the server's own prompt ids + the ids already sent, as a token
        prompt, and the text the previous worker held back."""
        if not self.token_ids:
            raise Conflict("this worker's upstream server does not return token ids, so a stream cannot "
                           "continue on it exactly", code="resume_unsupported")
        if request.messages is not None:
            tokenized = await self._post_json("/tokenize", {"model": self.model, "messages": request.messages,
                                                            "add_generation_prompt": True})
        else:
            tokenized = await self._post_json("/tokenize", {"model": self.model, "prompt": request.prompt or ""})
        body = self._sampling(request, chat=False)
        body["prompt"] = [int(i) for i in tokenized["tokens"]] + list(request.resume_token_ids)
        held = ""
        if request.resume_token_ids and request.resume_text_chars is not None:
            text = await self._post_json("/detokenize", {"model": self.model, "tokens": request.resume_token_ids})
            held = str(text.get("prompt", ""))[request.resume_text_chars:]
        return "/v1/completions", body, held

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Delta]:
        if not self.healthy:
            raise Unavailable("the upstream server is not healthy", retry_after_s=1)
        held = ""
        if request.resume_token_ids or request.resume_text_chars:
            path, body, held = await self._resume_body(request)
        elif request.messages is not None:
            path, body = "/v1/chat/completions", {**self._sampling(request, chat=True), "messages": request.messages}
        else:
            path, body = "/v1/completions", {**self._sampling(request, chat=False), "prompt": request.prompt or ""}
        finished = False
        try:
            async for delta in self._stream(path, body, chat=path.endswith("chat/completions")):
                if held:
                    delta.text, held = held + delta.text, ""
                finished = delta.finish_reason is not None
                yield delta
                if finished:
                    return
            raise UpstreamFailed("the upstream server ended the stream before it finished", code="worker_lost")
        finally:
            if not finished:
                self.aborted += 1

    async def _send(self, path: str, body: dict[str, Any]) -> Http1Response | httpx.Response:
        if self._streams is not None:
            return await self._streams.post(self.url, path, orjson.dumps(body), self._headers)
        request = self.client.build_request("POST", path, content=orjson.dumps(body), headers=self._headers)
        return await self.client.send(request, stream=True)

    async def _open(self, path: str, body: dict[str, Any]) -> Http1Response | httpx.Response:
        """Send the request; a server that refuses ``priority`` is asked once more without it."""
        while True:
            try:
                response = await self._send(path, body)
            except httpx.HTTPError as exc:
                raise Unavailable(f"upstream server unreachable: {type(exc).__name__}", retry_after_s=1) from None
            if response.status_code == 200:
                return response
            detail = await response.aread()
            await response.aclose()
            if response.status_code == 400 and "priority" in body and b"priority" in detail:
                log.warning("upstream %s refuses 'priority' (start vLLM with --scheduling-policy priority); "
                            "no longer passed on", self.url)
                self.priority = False
                body = {k: v for k, v in body.items() if k != "priority"}
                continue
            raise upstream_error(response.status_code, detail)

    async def _stream(self, path: str, body: dict[str, Any], *, chat: bool) -> AsyncIterator[Delta]:
        """Server-sent chunks as deltas; the finishing delta waits for the usage chunk."""
        response = await self._open(path, body)
        finish: Delta | None = None
        try:
            buffer = b""
            chunks = response.aiter_raw()
            async for raw in chunks:
                buffer += raw
                *events, buffer = buffer.split(b"\n")
                for event in events:
                    if not event.startswith(b"data:"):
                        continue
                    data = event[5:].strip()
                    if data == b"[DONE]":
                        await _drain(chunks)  # the body's end: the connection can be reused
                        if finish is not None:
                            yield finish
                        return
                    chunk = orjson.loads(data)
                    if "error" in chunk:
                        err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk["error"]}
                        raise UpstreamFailed(f"upstream server: {str(err.get('message'))[:500]}")
                    usage = chunk.get("usage")
                    if usage and finish is not None:
                        details = usage.get("prompt_tokens_details") or {}
                        finish.usage = Usage(int(usage.get("prompt_tokens", 0)),
                                             int(usage.get("completion_tokens", 0)),
                                             int(details.get("cached_tokens") or 0))
                    for choice in chunk.get("choices") or ():
                        delta = self._delta(choice, chat)
                        if delta.finish_reason is not None:
                            finish = delta
                        elif delta.text or delta.token_ids:
                            yield delta
            if finish is not None:
                yield finish
        except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
            raise UpstreamFailed(f"the upstream stream broke: {type(exc).__name__}", code="worker_lost") from None
        finally:
            await response.aclose()

    def _delta(self, choice: dict[str, Any], chat: bool) -> Delta:
        if chat:
            text = (choice.get("delta") or {}).get("content") or ""
            logprobs = _chat_logprobs(choice.get("logprobs"))
        else:
            text = choice.get("text") or ""
            logprobs = _text_logprobs(choice.get("logprobs"))
        ids = choice.get("token_ids") or []
        return Delta(ids, text, choice.get("finish_reason"), None, logprobs)
