"""A prompt's size in tokens as a worker of its model counts it (Anthropic's ``count_tokens``).

The count is the engine's own (its tokenizer and chat template: what a generation's
usage calls ``prompt_tokens``), asked of a worker through ``POST /internal/prompt_tokens``,
or of a ``--relay direct`` engine server through its ``/tokenize``. The request is
admitted like a generation (a slot on a live worker of the model, the same queue,
priority and deadline, 404 for a model nobody serves) and the slot is given back at once:
tokenizing a long prompt is real work on the worker, so it waits its turn with the rest.
A worker that cannot be reached is excluded and another one asked.
"""

from __future__ import annotations

import httpx
import orjson

from engine_worker.protocol import GenerateRequest
from gateway.config import GatewaySettings
from gateway.context import RequestContext
from gateway.relay.direct import DirectRelay
from gateway.relay.upstream import Dispatcher
from gateway.surfaces.openai import ChatCompletionRequest, worker_payload
from sluice.engine_server import RELAY_SCHEME
from sluice.errors import Unavailable, UpstreamFailed, from_body
from sluice.http1 import Http1Pool

PATH = "/internal/prompt_tokens"


class PromptCounter:
    def __init__(self, settings: GatewaySettings, dispatcher: Dispatcher, http: httpx.AsyncClient,
                 workers: Http1Pool) -> None:
        self._settings = settings
        self._dispatcher = dispatcher
        self._http = http
        self._workers = workers
        self._direct = DirectRelay(http, workers)
        self._headers = {"content-type": "application/json"}
        if settings.internal_token:
            self._headers["authorization"] = f"Bearer {settings.internal_token}"

    async def count(self, req: ChatCompletionRequest, ctx: RequestContext) -> int:
        payload = worker_payload(req, ctx.internal_id, None)
        payload["priority"] = ctx.priority
        body = orjson.dumps(payload)
        excluded: list[str] = []
        reason = "no attempt made"
        for attempt in range(1, self._settings.max_attempts + 1):
            (lease,) = await self._dispatcher.admit(req.model, f"{ctx.internal_id}~{attempt}", ctx, exclude=excluded)
            try:
                return await self._ask(lease.url, body)
            except (httpx.TransportError, OSError, UpstreamFailed) as exc:
                reason = f"{type(exc).__name__} from worker {lease.worker_id}"
                excluded.append(lease.worker_id)
            finally:
                await self._dispatcher.release(lease)
        raise Unavailable(f"no worker could count the prompt ({reason})", retry_after_s=1)

    async def _ask(self, url: str, body: bytes) -> int:
        if url.startswith(RELAY_SCHEME):
            return await self._direct.server(url).prompt_tokens(GenerateRequest.parse(body))
        if url.startswith("http://"):
            response = await self._workers.post(url, PATH, body, self._headers)
            try:
                status, content = response.status_code, await response.aread()
            finally:
                await response.aclose()
        else:
            answer = await self._http.post(url + PATH, content=body, headers=self._headers)
            status, content = answer.status_code, answer.content
        if status == 404:  # a worker from before this endpoint: another may have it
            raise UpstreamFailed("the worker cannot count prompt tokens")
        if status != 200:
            raise from_body(status, content)  # a 4xx is the request's; a 5xx is retried elsewhere
        return int(orjson.loads(content)["prompt_tokens"])
