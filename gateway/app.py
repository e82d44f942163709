"""The gateway's HTTP surface. Routes only parse, pick JSON vs stream, and delegate.

>>> app = create_app(GatewaySettings(redis_url="redis://127.0.0.1:6379/0"))
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import task_dump
from gateway.admission.adapters import AdapterDirectory
from gateway.admission.affinity import session_header, session_of
from gateway.admission.caps import check_caps, generations, queue_cost, token_estimate
from gateway.admission.prompt_tokens import PromptTokenizer
from gateway.admission.queue import Admission, as_sluice_error
from gateway.admission.routing import IndexCorrections
from gateway.admission.tenancy import Tenancy
from gateway.config import GatewaySettings
from gateway.context import RequestContext, headers_of, resolve_deadline, resolve_priority
from sluice.lean_routes import Front, LeanRoutes
from gateway.loss_watch import LossWatch, warn_if_evicting
from gateway.metrics import GatewayMetrics
from gateway.record import RequestRecord
from gateway.relay.counting import PromptCounter
from gateway.relay.disagg import Disaggregation, FleetRoles
from gateway.relay.pooling import PoolingServing
from gateway.relay.serving import Serving
from gateway.relay.sse import SSEResponse
from gateway.relay.upstream import Dispatcher
from gateway.streams.idempotency import Idempotency, fingerprint, scoped
from gateway.streams import event_ids
from gateway.streams.journal_quota import journal_events
from gateway.streams.journal_readers import JournalReaders
from gateway.streams.regenerate import Held
from gateway.surfaces import messages
from gateway.surfaces.body import parse_body, validation_error
from gateway.surfaces.messages import CountTokensRequest, MessageShape, MessagesRequest
from gateway.surfaces.openai import ChatCompletionRequest, CompletionRequest
from gateway.surfaces.pooling import (
    DetokenizeRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
)
from gateway.surfaces.responses import ResponseShape, ResponsesRequest
from gateway.surfaces.shape import Shape
from sluice import connection_bounds, keys, redis_faults, ticks
from sluice.aftercare import to_the_end
from sluice.apikeys import ApiKey
from sluice.errors import (
    AuthenticationFailed,
    DeadlineExceeded,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    RouteNotFound,
    SluiceError,
    Unavailable,
    error_response,
)
from sluice.http1 import Http1Pool
from sluice.ids import random_hex
from sluice.prefix_index import PrefixIndex
from sluice.redis_pool import create_pool, redact_url
from sluice.settings import is_loopback
from sluice.stalls import Stalls
from sluice.telemetry import extract

log = logging.getLogger("sluice.gateway")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
#: The longest one part of the gateway may take to close at shutdown.
CLOSE_STEP_S = 5.0


@dataclass
class Services:
    redis: Redis
    http: httpx.AsyncClient
    workers: Http1Pool
    admission: Admission
    serving: Serving
    pooling: PoolingServing
    tenancy: Tenancy
    metrics: GatewayMetrics
    readers: JournalReaders
    adapters: AdapterDirectory
    counter: PromptCounter
    watch: LossWatch
    stalls: Stalls

    async def aclose(self) -> None:
        """Close every part, each given at most ``CLOSE_STEP_S``: a gateway always exits. (One
        whose port was taken at start, shut down at once, hung in this close about one run in
        five, tests/test_taken_ports.py: a cancellation redis-py swallowed, see
        gateway/admission/queue.py's stop_tasks; the log names a part that does not end.)"""
        self.stalls.close()
        steps = (("admission", self.admission.close), ("tenancy", self.tenancy.close),
                 ("serving", self.serving.close), ("journal readers", self.readers.close),
                 ("loss watch", self.watch.close),
                 ("HTTP client", self.http.aclose), ("worker pool", self.workers.aclose),
                 ("Redis pool", self.redis.aclose))
        for name, close in steps:
            step = asyncio.ensure_future(close())
            done, _ = await asyncio.wait({step}, timeout=CLOSE_STEP_S)
            if not done:
                step.cancel()
                log.error("shutdown: closing the %s did not end within %g s; going on without it", name, CLOSE_STEP_S)
            elif not step.cancelled() and step.exception() is not None:
                log.warning("shutdown: closing the %s failed: %r", name, step.exception())


async def open_services(settings: GatewaySettings) -> Services:
    # First, while nothing else runs on the loop: loading a tokenizer (transformers' import
    # and the folder's files) blocks it for seconds, and on a GPU host starting 4 gateway
    # processes beside vLLM, the loss watch's first Redis check timed out behind it.
    tokenizer = PromptTokenizer(settings.tokenizer) if settings.tokenizer else None
    redis = await create_pool(settings.redis_url, max_connections=settings.redis_max_connections,
                              client_name=f"sluice-gateway-{os.getpid()}")
    http = httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=settings.connect_timeout_s),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=512),
    )
    workers = Http1Pool(settings.connect_timeout_s)
    watch = LossWatch(redis)  # one per process: the keepers write back what Redis lost
    await warn_if_evicting(redis)
    tenancy = Tenancy(redis, settings, watch)
    await tenancy.check_startup()
    await tenancy.start()
    admission = Admission(redis, settings, watch.since_loss_s)
    await admission.start()
    watch.listen(admission.after_look)  # a loss the epoch does not show: leases and waiters again
    readers = JournalReaders(redis)  # one reader loop for every re-attached stream of this process
    metrics = GatewayMetrics()
    connection_bounds.count_shed(lambda reason: metrics.connections_shed.labels(reason).inc())
    adapters = AdapterDirectory(redis)
    dispatcher = Dispatcher(settings, admission, http, workers, IndexCorrections(PrefixIndex(redis)), adapters,
                            Disaggregation(FleetRoles(redis), settings.stall_timeout_s), tokenizer)
    idempotency = Idempotency(redis, settings.idempotency_ttl_s, watch.unsure_s, watch)
    idempotency.producers.start()  # this process's beat: its streams' clients need not wait for it when it dies
    serving = Serving(settings, dispatcher, idempotency, redis, tenancy, readers, metrics, watch)
    readers.adopt = serving.take_over  # a re-attached reader whose producer died: continue it here
    readers.producing = serving.produces  # ... never one whose producer runs here
    metrics.stalls.start()
    pooling = PoolingServing(settings, dispatcher, tenancy, serving.answers)  # one bound on answers a process
    return Services(redis=redis, http=http, workers=workers, admission=admission, serving=serving,
                    pooling=pooling, tenancy=tenancy, metrics=metrics, readers=readers, adapters=adapters,
                    watch=watch, counter=PromptCounter(settings, dispatcher, http, workers), stalls=metrics.stalls)


def create_app(settings: GatewaySettings) -> Front:
    """The gateway's ASGI app: its completion routes lean (sluice/lean_routes.py), the rest FastAPI's."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Services]]:
        services = await open_services(settings)
        task_dump.install()
        log.info("gateway ready on %s:%d (redis %s)", settings.host, settings.port, redact_url(settings.redis_url))
        try:
            yield {"services": services}  # every request sees it as request.state.services
        finally:
            await services.aclose()

    # /docs and /openapi.json are routes of ours: behind the API key once keys exist.
    app = FastAPI(title="Sluice", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    lean = LeanRoutes()  # the completion paths skip FastAPI's per-request layers (:class:`Front`)
    app.add_middleware(RequestIdMiddleware)
    _install_error_handlers(app)

    async def charge(s: Services, ctx: RequestContext, key: ApiKey | None, model: str, estimate: int,
                     weight: int) -> None:
        """Charge the model name's own budget (if it has one) and the key's limits; the
        answer's headers carry the key's and the effective priority."""
        limit = settings.name_limits.get(model)
        if limit is not None:  # the name's own budget first: headers below are the key's
            ctx.name_charge = await s.tenancy.admit(limit.as_key(model), estimate, ctx.internal_id, weight)
        if key is not None:
            try:
                ctx.charge = await s.tenancy.admit(key, estimate, ctx.internal_id, weight)
            except SluiceError:
                for taken in ctx.take_charges():
                    await s.tenancy.settle(taken, 0)  # not served: the name's budget gets it back
                raise
            ctx.headers.update(ctx.charge.headers)
        ctx.headers["x-sluice-priority"] = str(ctx.priority)

    async def admitted(
        request: Request,
        model: type[ChatCompletionRequest | CompletionRequest | ResponsesRequest | MessagesRequest | CountTokensRequest],
        record: RequestRecord,
    ) -> tuple[ChatCompletionRequest | CompletionRequest, RequestContext, Shape | None]:
        """Authenticate, parse, cap, clamp priority, charge the key's limits. A Responses
        or Messages request goes on as the chat completion it is generated as, with its shape."""
        s = svc(request)
        key = await s.tenancy.authenticate(_credential(request))
        parsed, body = await parse_body(request, model, settings.max_body_bytes)
        shape: Shape | None = None
        if isinstance(parsed, ResponsesRequest | MessagesRequest | CountTokensRequest):
            refused = parsed.refusal()
            if refused is not None:
                raise InvalidRequest(f"{refused[0]}: {refused[1]}", param=refused[0])
            shape = ResponseShape(parsed) if isinstance(parsed, ResponsesRequest) else MessageShape(parsed)
            try:
                parsed = parsed.to_chat()
            except ValidationError as exc:
                raise validation_error(exc.errors()) from None
        req = parsed
        chars = check_caps(req, settings)
        ctx = _context(request, req, body, settings, key, record, queue_cost(req, chars, settings.fair_output_tokens))
        ctx.session = session_of(req.prompt_cache_key, session_header(headers_of(request)), req.user)
        if ctx.idempotency_key is not None and req.stream:
            journal_events(req, settings, typed=shape is not None)  # 400 before any work when it cannot fit
        await charge(s, ctx, key, req.model, token_estimate(req, chars), generations(req))
        record.describe(req.model, req.n, ctx.priority, key.prefix if key else None)
        return req, ctx, shape

    def begin(request: Request, route: str) -> RequestRecord:
        return RequestRecord.begin(_request_id(request), svc(request).metrics, extract(headers_of(request)), route)

    def completion_route(
        path: str, model: type[ChatCompletionRequest | CompletionRequest | ResponsesRequest | MessagesRequest],
        name: str, frames: Callable[[AsyncIterator[bytes]], AsyncIterator[bytes]] | None = None,
    ) -> None:
        """``frames``: the surface's own framing of a stream's events (Messages: Anthropic's)."""

        async def route(request: Request) -> Response:
            record = begin(request, name)
            # Until the response exists nothing has reached the client: every wait before it
            # (authentication, the charge, an Idempotency-Key's claim, the queue, a JSON
            # answer's generation) ends by the request's deadline, each by its own rule, and
            # this bounds them all together. Unbounded, a request sent with 1 s left stayed
            # silent for 18 s while a Cluster node was away, each Redis command taking its
            # own 12 s (the nemesis, Cluster: nem-1968 and five more past their deadline).
            bound = ticks.timeout(_answer_within_s(request, settings))
            try:
                async with bound:
                    req, ctx, shape = await admitted(request, model, record)
                    response = await svc(request).serving.serve(req, ctx, shape)
            except BaseException as exc:
                late = isinstance(exc, TimeoutError) and bound.expired()
                error = DeadlineExceeded("the request's deadline passed before it could be answered") if late else exc
                record.served_nothing()  # an error answers it: none of its tokens reached the client
                record.finish(as_sluice_error(error))
                if late:
                    raise error from None
                raise
            if frames is not None and isinstance(response, SSEResponse):
                response.map_events(frames)
            return response

        app.add_api_route(path, route, methods=["POST"], name=name, openapi_extra=_body_schema(model))
        lean.add(path, route)  # served from here; FastAPI's route documents it

    completion_route("/v1/chat/completions", ChatCompletionRequest, "chat.completions")
    completion_route("/v1/completions", CompletionRequest, "completions")
    completion_route("/v1/responses", ResponsesRequest, "responses")
    completion_route("/v1/messages", MessagesRequest, "messages", messages.anthropic_frames)

    @app.post("/v1/messages/count_tokens", openapi_extra=_body_schema(CountTokensRequest))
    async def count_tokens(request: Request) -> Response:
        """The prompt's tokens as a worker of the model counts them. Admitted like a
        generation (a request against the key's RPM); no tokens are charged to its TPM."""
        record = begin(request, "messages.count_tokens")
        try:
            req, ctx, _ = await admitted(request, CountTokensRequest, record)
            try:
                count = await svc(request).counter.count(req, ctx)
            finally:
                await to_the_end(svc(request).tenancy.settle_all(ctx.take_charges(), 0, ctx.request_id))
        except BaseException as exc:
            record.finish(as_sluice_error(exc))
            raise
        record.finish()
        return Response(orjson.dumps({"input_tokens": count}), media_type="application/json", headers=ctx.headers)

    async def admitted_pooling(request: Request, model: type[PoolingRequest], record: RequestRecord,
                               ) -> tuple[PoolingRequest, RequestContext]:
        """As :func:`admitted`, for the requests of gateway/surfaces/pooling.py: charged their
        prompt's estimate (corrected by the tokens the engine counted), one slot each."""
        s = svc(request)
        key = await s.tenancy.authenticate(headers_of(request).get("authorization"))
        req, body = await parse_body(request, model, settings.max_body_bytes)  # type: ignore[type-var]
        refused = req.refusal()
        if refused is not None:
            raise InvalidRequest(f"{refused[0]}: {refused[1]}", param=refused[0])
        if req.model is None:  # /tokenize and /detokenize may leave it out, as vLLM's may
            live = await s.admission.live_models()
            if len(live) != 1:
                raise InvalidRequest("model: required here (this gateway serves several models)", param="model")
            req.model = live[0]
        chars = req.prompt_chars()
        if chars > settings.max_prompt_chars:
            raise InvalidRequest(f"the input has {chars} characters; the limit is {settings.max_prompt_chars}",
                                 param="input", code="context_length_exceeded")
        estimate = chars // 4 + 1
        ctx = _context(request, req, body, settings, key, record, estimate)
        await charge(s, ctx, key, req.model, estimate, 1)
        record.describe(req.model, 1, ctx.priority, key.prefix if key else None)
        return req, ctx

    def pooling_route(paths: tuple[str, ...], model: type[PoolingRequest], name: str) -> None:
        async def route(request: Request) -> Response:
            record = begin(request, name)
            try:
                req, ctx = await admitted_pooling(request, model, record)
                return await svc(request).pooling.serve(req, ctx)
            except BaseException as exc:
                record.finish(as_sluice_error(exc))
                raise

        for index, path in enumerate(paths):  # vLLM's aliases answer too, documented once
            app.add_api_route(path, route, methods=["POST"], name=f"{name}{path}", openapi_extra=_body_schema(model),
                              include_in_schema=index == 0)
            lean.add(path, route)  # short requests: the same lean path as completions

    pooling_route(("/v1/embeddings",), EmbeddingRequest, "embeddings")
    pooling_route(("/v1/score", "/score"), ScoreRequest, "score")
    pooling_route(("/v1/rerank", "/rerank", "/v2/rerank"), RerankRequest, "rerank")
    pooling_route(("/tokenize",), TokenizeRequest, "tokenize")
    pooling_route(("/detokenize",), DetokenizeRequest, "detokenize")

    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        s = svc(request)
        _check_admin(request, settings, await s.tenancy.enforced())
        for model in await s.redis.smembers(keys.MODELS):
            name = model.decode()
            for cls, depth in (await s.admission.queue_depths(name)).items():
                s.metrics.queue_depth.labels(name, cls).set(depth)
            s.metrics.live_workers.labels(name).set(await s.admission.live_workers(name))
        return Response(s.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/streams/{key}")
    async def reattach(key: str, request: Request) -> Response:
        """Re-attach to a stream started with this Idempotency-Key, after Last-Event-ID. With
        ``X-Sluice-Timeout-Ms`` the stream ends for this client at that deadline (the in-band
        timeout, then ``[DONE]``); its response comes by then and a moment, whatever Redis
        does, as a completion's does (without it, by the queue and first-token timeouts: the
        wait a stream not yet begun is given). The nemesis, Cluster: two GETs got no headers
        for 25 s while every Redis call of theirs waited out its own timeout in turn."""
        given = headers_of(request)
        until = resolve_deadline(given, settings) if "x-sluice-timeout-ms" in given else None
        answer_by = until if until is not None else \
            time.monotonic() + settings.queue_timeout_s + settings.ttft_timeout_s
        bound = ticks.timeout(answer_by - time.monotonic() + ANSWER_GRACE_S)
        try:
            async with bound:
                caller = await svc(request).tenancy.authenticate(given.get("authorization"))
                if caller is not None:
                    # One request of the key's RPM, no tokens, no concurrency (its producer holds
                    # the stream's): unpaid, one paid stream was read again without end (a
                    # review: 24 reads of a 4.6 MB journal after the RPM was spent, 171 ms of CPU each).
                    await svc(request).tenancy.admit(caller, 0, _request_id(request), weight=0)
                last_event = given.get("last-event-id") or request.query_params.get("last_event_id")
                owner = caller.prefix if caller else "-"
                return await svc(request).serving.reattach(scoped(owner, Idempotency.check_key(key)), last_event,
                                                           until=until)
        except TimeoutError:
            if bound.expired():
                raise DeadlineExceeded("the deadline passed before the stream could be re-attached") from None
            raise

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        await svc(request).tenancy.authenticate(headers_of(request).get("authorization"))
        models = await svc(request).admission.live_models()
        adapters = [_adapter_card(a) for a in await svc(request).adapters.listed() if a["parent"] in models]
        return _json({"object": "list", "data": [_model_card(m) for m in models] + adapters})

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str, request: Request) -> Response:
        await svc(request).tenancy.authenticate(headers_of(request).get("authorization"))
        if keys.model_name_problem(model) is not None:
            raise ModelNotFound("no model has this name", param="model")  # the name may be megabytes
        adapter = next((a for a in await svc(request).adapters.listed() if a["name"] == model), None)
        if adapter is not None and await svc(request).admission.live_workers(adapter["parent"]) > 0:
            return _json(_adapter_card(adapter))
        if await svc(request).admission.live_workers(model) == 0:
            raise await svc(request).admission.missing_model(model)
        return _json(_model_card(model))

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_json(request: Request) -> Response:
        await svc(request).tenancy.authenticate(headers_of(request).get("authorization"))
        return _json(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> Response:
        await svc(request).tenancy.authenticate(headers_of(request).get("authorization"))
        return get_swagger_ui_html(openapi_url="/openapi.json", title="Sluice API")

    @app.get("/health")
    async def health() -> Response:
        return _json({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        try:
            models = await svc(request).admission.live_models()
        except (RedisError, OSError):
            raise Unavailable("redis is unreachable", retry_after_s=2) from None
        if not models:
            raise Unavailable("no live worker", retry_after_s=2)
        return _json({"status": "ready", "models": models})

    _install_openapi(app, [ChatCompletionRequest, CompletionRequest, ResponsesRequest, MessagesRequest,
                           EmbeddingRequest, ScoreRequest, RerankRequest, TokenizeRequest, DetokenizeRequest])
    return Front(app, lean, _new_request_id)


def svc(request: Request) -> Services:
    """This process's services, from the lifespan state (read from the scope: ``request.state``
    builds an object per request to read it through, ~1 µs a call, three calls a request)."""
    services: Services | None = request.scope.get("state", {}).get("services")
    if services is None:
        raise Unavailable("gateway is starting", retry_after_s=1)
    return services


def _model_card(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "sluice"}


def _adapter_card(adapter: dict[str, Any]) -> dict[str, Any]:
    """A LoRA adapter as vLLM's server lists one: its base model as ``parent``."""
    return {**_model_card(adapter["name"]), "parent": adapter["parent"], "root": adapter["path"]}


def _json(obj: object, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def _check_admin(request: Request, settings: GatewaySettings, keys_enforced: bool) -> None:
    """/metrics: the admin key when one is configured. Without one, only an open gateway
    (no API keys) answers, and only loopback clients: a gateway with API keys never
    trusts an address, since a local reverse proxy makes every client look local."""
    if settings.admin_key:
        given = headers_of(request).get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {settings.admin_key}".encode()):
            raise AuthenticationFailed("this endpoint needs the admin key")
    elif keys_enforced:
        raise AuthenticationFailed("this gateway has API keys: set SLUICE_GATEWAY_ADMIN_KEY to read /metrics")
    elif request.client is None or not is_loopback(request.client.host):
        raise AuthenticationFailed("this endpoint answers loopback clients only (or set an admin key)")


def _context(
    request: Request, req: ChatCompletionRequest | CompletionRequest | PoolingRequest, body: bytes,
    settings: GatewaySettings, key: ApiKey | None, record: RequestRecord, cost: int,
) -> RequestContext:
    owner = key.prefix if key else "-"
    given = headers_of(request)
    idem = given.get("idempotency-key")
    limit = settings.name_limits.get(req.model)
    priority = resolve_priority(req.priority, req.service_tier, given, settings,
                                limit.priority if limit is not None else None)
    headers: dict[str, str] = {}
    if key is not None and priority < key.priority_ceiling:
        headers["x-sluice-priority-clamped"] = "true"
        priority = key.priority_ceiling
    last_event = given.get("last-event-id")
    return RequestContext(
        request_id=_request_id(request),
        priority=priority,
        deadline=resolve_deadline(given, settings),
        disconnected=request.is_disconnected,
        idempotency_key=None if idem is None else scoped(owner, Idempotency.check_key(idem)),
        fingerprint=fingerprint(body) if idem is not None else "",
        body=body if idem is not None else b"",
        last_event=last_event if event_ids.parse(last_event)[0] else None,
        held=Held.of(last_event),
        tenant=owner,
        cost=cost,
        headers=headers,
        record=record,
    )


#: A completion's waits each end by its deadline with an answer of their own (a 504, in
#: band or as a status); the bound on them all comes this much later, a backstop.
ANSWER_GRACE_S = 1.0


def _answer_within_s(request: Request, settings: GatewaySettings) -> float:
    """Seconds until a completion must have its response (its deadline, plus the grace). A
    malformed ``X-Sluice-Timeout-Ms`` counts as absent here: parsing the request says so."""
    try:
        deadline = resolve_deadline(headers_of(request), settings)
    except InvalidRequest:
        deadline = time.monotonic() + settings.request_timeout_s
    return deadline - time.monotonic() + ANSWER_GRACE_S


def _credential(request: Request) -> str | None:
    """The API key as ``Authorization`` carries it; the Messages routes also take Anthropic's
    ``x-api-key``."""
    headers = headers_of(request)
    if _is_messages(request):
        return messages.credential(headers)
    return headers.get("authorization")


def _is_messages(request: Request) -> bool:
    # The scope's path, not ``request.url``: that builds and parses the whole URL (a few
    # per cent of a short request's CPU); only characters outside the prefix differ.
    return str(request.scope["path"]).startswith(MESSAGES_PATH)


#: Routes under this path answer in the Anthropic Messages API's shapes, errors included.
MESSAGES_PATH = "/v1/messages"


def refusal_body(exc: SluiceError, path: bytes) -> bytes:
    """The body of a request refused before any route ran (its head, or a connection past the
    process's most: sluice/connection_bounds.py), in the shape of the API its path so far names."""
    if path.startswith(MESSAGES_PATH.encode()):
        return messages.error_body(messages.error_type(exc.status, exc.type, exc.code), exc.message)
    return connection_bounds.openai_error(exc, path)


def _request_id(request: Request) -> str:
    rid = request.scope.get("sluice.request_id")
    return rid if isinstance(rid, str) else _new_request_id(headers_of(request).get("x-request-id", ""))


def _new_request_id(given: str) -> str:
    return given if _REQUEST_ID.match(given) else random_hex()


class RequestIdMiddleware:
    """Every response carries ``x-request-id``: the client's when valid, else a fresh one
    (FastAPI's routes; :class:`sluice.lean_routes.Front` does the same for the lean ones)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), "")
        rid = scope["sluice.request_id"] = _new_request_id(given)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    headers.append((b"x-request-id", rid.encode()))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


_REF = "#/components/schemas/{model}"


def _body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The request body's schema for OpenAPI (the body is parsed by hand, not by FastAPI)."""
    schema = model.model_json_schema(ref_template=_REF)
    schema.pop("$defs", None)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _install_openapi(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Add the hand-parsed bodies' nested models to ``components.schemas``."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = build()
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schemas.update(model.model_json_schema(ref_template=_REF).get("$defs", {}))
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _install_error_handlers(app: FastAPI) -> None:
    def render(request: Request, exc: SluiceError, headers: dict[str, str] | None = None) -> Response:
        """OpenAI's error shape; Anthropic's on the Messages routes."""
        return (messages.error_response if _is_messages(request) else error_response)(exc, headers)

    @app.exception_handler(SluiceError)
    async def sluice_error(request: Request, exc: SluiceError) -> Response:
        return render(request, exc, {"x-request-id": _request_id(request)})

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return render(request, validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            return render(request, RouteNotFound(f"no route {request.method} {request.url.path}"))
        if exc.status_code == 405:
            return render(request, MethodNotAllowed(f"method {request.method} not allowed here"))
        err = SluiceError(str(exc.detail))
        err.status = exc.status_code
        return render(request, err)

    @app.exception_handler(RedisError)
    async def redis_error(request: Request, exc: RedisError) -> Response:
        return render(request, redis_faults.unavailable(exc))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return render(request, SluiceError("internal error in the gateway"))
