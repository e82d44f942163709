"""The worker's HTTP surface: ``POST /internal/generate``, ``POST /internal/prompt_tokens``,
``POST /internal/pool``, ``GET /health``, ``GET /metrics``."""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

import orjson
from fastapi import FastAPI, Request
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from engine_worker.metrics import WorkerMetrics
from engine_worker.pooling import TASK_OF, PoolRequest, encode_line
from engine_worker.protocol import GenerateRequest
from sluice.errors import (
    AuthenticationFailed,
    ModelNotFound,
    RouteNotFound,
    SluiceError,
    Unavailable,
    error_response,
)
from sluice.lean_routes import Front, LeanRoutes
from sluice.telemetry import extract, inject

tracer = trace.get_tracer("sluice.worker")

if TYPE_CHECKING:
    from engine_worker.worker import Worker


def create_app(worker: Worker, metrics: WorkerMetrics) -> Front:
    """The worker's ASGI app: ``/internal/generate`` and ``/internal/pool`` lean
    (sluice/lean_routes.py), the rest FastAPI's."""
    app = FastAPI(title="Sluice engine worker", docs_url=None, redoc_url=None)
    lean = LeanRoutes()

    @app.exception_handler(SluiceError)
    async def _sluice_error(request: Request, exc: SluiceError) -> Response:
        return error_response(exc)

    token = worker.settings.internal_token

    def check_caller(request: Request) -> None:
        """Only gateways holding the shared secret may generate or read metrics."""
        if token is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise AuthenticationFailed("this worker answers gateways only (internal token missing or wrong)")

    def check_request(request: Request, task: str) -> None:
        """A gateway's request this worker takes: not draining, a task it serves (a 404
        otherwise: the gateway tries another worker). The model is checked by each route: a
        generate may name a LoRA adapter of it."""
        check_caller(request)
        if worker.draining:
            raise Unavailable("worker is draining", retry_after_s=1)
        if not worker.serves(task):
            raise RouteNotFound(f"this worker does not serve task {task!r} (its tasks: {', '.join(worker.tasks)})")

    @app.post("/internal/generate", response_model=None)
    async def generate(request: Request) -> Response:
        check_request(request, "generate")
        body = GenerateRequest.parse(await request.body())
        if body.model != worker.model:  # a LoRA adapter of the model, or a mistake (404)
            await worker.adapters.ensure(body.model, worker.redis)
            body.adapter = body.model
        span = tracer.start_span("worker.generate", context=extract(request.headers), kind=SpanKind.SERVER,
                                 attributes={"sluice.worker_id": worker.settings.worker_id,
                                             "gen_ai.request.model": body.model,
                                             "sluice.resumed_tokens": len(body.resume_token_ids)})
        body.trace_headers = inject(trace.set_span_in_context(span)) or None
        return worker.open_stream(body, span)

    lean.add("/internal/generate", generate)  # every stream: served from the scope

    @app.post("/internal/prompt_tokens")
    async def prompt_tokens(request: Request) -> Response:
        """The size of a generate request's prompt as the engine counts it (its chat template,
        its tools); nothing generated."""
        check_request(request, "generate")
        body = GenerateRequest.parse(await request.body())
        if body.model != worker.model:  # counted with the base model's tokenizer and template
            raise ModelNotFound(f"this worker serves {worker.model!r}")
        count = await worker.engine.prompt_tokens(body)
        return Response(orjson.dumps({"prompt_tokens": count}), media_type="application/json")

    @app.post("/internal/pool")
    async def pool(request: Request) -> Response:
        """Embed, score, tokenize or detokenize: one NDJSON line (engine_worker/pooling.py)."""
        check_caller(request)
        body = PoolRequest.parse(await request.body())
        check_request(request, TASK_OF[body.op])
        if body.model != worker.model:  # adapters generate only: no pooling with one
            raise ModelNotFound(f"this worker serves {worker.model!r}")
        with tracer.start_as_current_span("worker.pool", context=extract(request.headers), kind=SpanKind.SERVER,
                                          attributes={"sluice.worker_id": worker.settings.worker_id,
                                                      "gen_ai.request.model": body.model,
                                                      "gen_ai.operation.name": body.op}):
            line = await worker.pool(body)
        return Response(encode_line(line), media_type="application/x-ndjson")

    lean.add("/internal/pool", pool)  # embeddings and scores are short requests too

    @app.delete("/internal/adapters/{name}")
    async def unload_adapter(name: str, request: Request) -> Response:
        """Unload a LoRA adapter (vLLM's remove_lora): routing stops preferring this worker
        for it, and its room under --max-loras is free for another."""
        check_caller(request)
        unloaded = await worker.adapters.unload(name)
        return Response(orjson.dumps({"name": name, "unloaded": unloaded}), status_code=200 if unloaded else 404,
                        media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        status = 503 if worker.draining else 200
        body = {"status": "draining" if worker.draining else "ok", "worker": worker.describe()}
        return Response(orjson.dumps(body), status_code=status, media_type="application/json")

    @app.get("/metrics")
    async def scrape(request: Request) -> Response:
        check_caller(request)
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    return Front(app, lean)
