"""The worker process: engine + HTTP service + Redis registration, with a graceful drain."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, cast

from opentelemetry.trace import Span
from redis.exceptions import RedisError

from engine_worker.adapters import AdapterEngine, Adapters, parse_loras
from engine_worker.config import WorkerSettings
from engine_worker.engines.base import Engine
from engine_worker.pooling import PoolingEngine, PoolRequest, answer
from engine_worker.protocol import GenerateRequest
from engine_worker.registration import Registration
from engine_worker.stream import NDJSONStream
from sluice import keys
from sluice.connection_bounds import ConnectionBounds
from sluice.models import ModelError, resolve
from sluice.prefix_index import PrefixIndex
from sluice.redis_pool import create_pool
from sluice.serve import Server, run_async, settle_gc, unsettle_gc, uvicorn_config
from sluice.tasks import GENERATE, SERVED
from sluice.telemetry import setup_tracing

log = logging.getLogger("sluice.worker")

#: Redis pings a starting worker tries before it gives up: about a day, 4 a second.
WAIT_FOR_REDIS = 345_600
#: How often the engine's KV events go to the prefix index.
KV_EVENTS_PERIOD_S = 0.2


def served_name(settings: WorkerSettings) -> str:
    """The name clients use for this worker's model; raises :class:`ModelError` for a name
    the gateways would refuse (sluice/keys.py: ``model_name_problem``)."""
    if settings.served_model_name:
        return checked_name(settings.served_model_name)
    if settings.engine == "sim":
        return "sim"
    if settings.engine == "openai":
        return settings.upstream_model or ""  # "": the server's own name, learnt at start
    return checked_name(resolve(settings.model).name)


def checked_name(name: str) -> str:
    problem = keys.model_name_problem(name)
    if problem is not None:
        raise ModelError(f"cannot serve the model as {name[:80]!r}: {problem} (set --served-model-name)")
    return name


def build_engine(settings: WorkerSettings) -> Engine:
    """The engine the settings ask for; raises :class:`ModelError` for a bad model path."""
    if settings.relay == "direct" and settings.engine != "openai":
        raise ModelError("--relay direct is for --engine openai (a server gateways can call)")
    if settings.engine == "sim":
        from engine_worker.engines.sim import SimEngine

        return SimEngine(
            ttft_ms=settings.sim_ttft_ms,
            token_ms=settings.sim_token_ms,
            max_seqs=settings.sim_max_seqs,
            fail_first=settings.sim_fail_first,
            crash_on=settings.sim_crash_on,
            prefill_ms_per_token=settings.sim_prefill_ms_per_token,
            prefill_chunk=settings.sim_prefill_chunk,
            cache_blocks=settings.sim_cache_blocks,
            role=settings.role,
            kv_transfer_ms_per_token=settings.sim_kv_transfer_ms_per_token,
        )
    if settings.engine == "openai":
        from engine_worker.engines.openai_upstream import OpenAIUpstreamEngine

        if not settings.upstream_url:
            raise ModelError("--engine openai needs --upstream-url (the server to front)")
        if settings.relay == "direct" and settings.upstream_api_key:
            raise ModelError("--relay direct cannot use an upstream API key: gateways would need it, and the "
                             "registry is no place for it")
        return OpenAIUpstreamEngine(
            settings.upstream_url,
            model=settings.upstream_model,
            api_key=settings.upstream_api_key,
            capacity=settings.upstream_capacity,
            tokens=settings.upstream_token_ids,
            poll_s=settings.upstream_poll_ms / 1000,
            start_timeout_s=settings.upstream_start_timeout_s,
        )
    model_dir = resolve(settings.model)
    if settings.engine == "vllm":
        from engine_worker.engines.vllm_engine import VllmEngine, has_gpu
        from engine_worker.engines.vllm_kv_events import kv_events_endpoint

        gpu = has_gpu()
        seqs = settings.vllm_max_num_seqs or (256 if gpu else 16)
        kv_gib = settings.vllm_kv_cache_gib if settings.vllm_kv_cache_gib is not None else (0 if gpu else 0.5)
        return VllmEngine(
            model_dir,
            served_model_name=served_name(settings),
            max_model_len=settings.vllm_max_model_len,
            max_num_seqs=seqs,
            kv_cache_bytes=int(kv_gib * 2**30) or None,
            enforce_eager=settings.vllm_enforce_eager,
            trtllm_kernels=settings.vllm_trtllm_kernels,
            tensor_parallel_size=settings.vllm_tensor_parallel_size,
            tool_call_parser=settings.tool_call_parser,
            kv_events_endpoint=kv_events_endpoint() if settings.prefix_index == "precise" else None,
            extra_args=settings.vllm_engine_args,
            task=settings.task,
            max_loras=max(settings.max_loras, len(settings.lora)),
            max_lora_rank=settings.max_lora_rank,
            kv_transfer_config=settings.vllm_kv_transfer_config,
        )
    from engine_worker.engines.trtllm_engine import TrtllmEngine

    if settings.task != GENERATE:
        raise ModelError("--engine trtllm generates only: --task embed needs vllm, sim or openai")
    return TrtllmEngine(
        model_dir,
        max_batch_size=settings.trtllm_max_batch_size,
        max_seq_len=settings.trtllm_max_seq_len,
        kv_cache_fraction=settings.trtllm_kv_cache_fraction,
    )


class Worker:
    """One engine behind ``/internal/generate``.

    Lifecycle: :meth:`run` (blocking) or :meth:`async_run`; on SIGTERM it
    deregisters (no new grants), answers new requests with 503, waits up to
    ``drain_timeout_s`` for in-flight streams, then exits.
    """

    def __init__(self, settings: WorkerSettings, engine: Engine | None = None) -> None:
        self.settings = settings
        self.model = served_name(settings)
        self.engine = engine or build_engine(settings)
        #: What this worker registers (sluice/tasks.py): a direct-relay worker's gateways call its
        #: server's generate API themselves, and nothing else.
        self.tasks = (GENERATE,) if settings.relay == "direct" else SERVED[settings.task]
        #: The engine's embed/tokenize half: the simulator's is a separate object.
        self.pooling: PoolingEngine | None = self._pooling_half()
        try:
            # Checked below: an engine without load_adapter refuses any adapter at start.
            self.adapters = Adapters(cast(AdapterEngine, self.engine), self.model, parse_loras(settings.lora),
                                     settings.max_loras)
        except ValueError as exc:
            raise ModelError(str(exc)) from None
        if self.adapters.enabled and not hasattr(self.engine, "load_adapter"):
            raise ModelError(f"the {self.engine.name} engine serves no LoRA adapters")
        if self.adapters.enabled and GENERATE not in self.tasks:
            # Adapters only generate (vLLM's pooling runner takes no LoRA): refuse at start.
            raise ModelError(f"--lora/--max-loras need a generating worker, not --task {settings.task}")
        self.draining = False
        self.in_flight = 0
        self.served = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._registration: Registration | None = None
        #: Set while running: adapters loaded on demand read their path from the directory.
        self.redis: Any = None

    def __repr__(self) -> str:
        return (
            f"Worker(id={self.settings.worker_id} engine={self.engine.name} "
            f"in_flight={self.in_flight} served={self.served} draining={self.draining})"
        )

    def describe(self) -> dict[str, object]:
        return {
            "id": self.settings.worker_id,
            "model": self.model,
            "engine": self.engine.name,
            "role": self.settings.role,
            "capacity": self.engine.capacity,
            "in_flight": self.in_flight,
            "served": self.served,
            "stats": self.engine.stats().as_dict(),
        }

    def _pooling_half(self) -> PoolingEngine | None:
        if self.engine.name == "sim":
            from engine_worker.engines.sim_pooling import SimPooling

            return SimPooling(self.settings.sim_embed_dim)
        if self.engine.name == "vllm":
            from engine_worker.engines.vllm_engine import VllmEngine
            from engine_worker.engines.vllm_pooling import VllmPooling

            assert isinstance(self.engine, VllmEngine)
            return VllmPooling(self.engine)
        if self.engine.name == "openai":
            from engine_worker.engines.openai_upstream import OpenAIUpstreamEngine
            from engine_worker.engines.upstream_pooling import UpstreamPooling

            assert isinstance(self.engine, OpenAIUpstreamEngine)
            return UpstreamPooling(self.engine)
        return None

    def serves(self, task: str) -> bool:
        return task in self.tasks and (task == GENERATE or self.pooling is not None)

    async def pool(self, request: PoolRequest) -> dict[str, object]:
        """Answer an embed, score or tokenize request (engine_worker/pooling.py)."""
        self._stream_started()
        try:
            return await answer(self.pooling, request)
        finally:
            self._stream_done()

    def open_stream(self, request: GenerateRequest, span: Span) -> NDJSONStream:
        def done() -> None:
            span.end()
            self._stream_done()

        return NDJSONStream(self.engine.generate(request), self._stream_started, done)

    def _stream_started(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def _stream_done(self) -> None:
        self.in_flight -= 1
        self.served += 1
        if self.in_flight == 0:
            self._idle.set()

    async def drain(self) -> None:
        self.draining = True
        if self._registration is not None:
            await self._registration.deregister()
        started = time.monotonic()
        try:
            await asyncio.wait_for(self._idle.wait(), self.settings.drain_timeout_s)
            log.info("drained in %.2fs", time.monotonic() - started)
        except TimeoutError:
            log.warning("drain timeout: %d streams still open, cancelling", self.in_flight)

    async def _report_kv_events(self, index: PrefixIndex) -> None:
        """Tell the gateways' prefix index what the engine cached and evicted, a few times
        a second (off the request path; a lost report only makes the index staler)."""
        while True:
            await asyncio.sleep(KV_EVENTS_PERIOD_S)
            events = self.engine.take_kv_events()
            if events:
                try:
                    await index.report(self.model, self.settings.worker_id, events)
                except (RedisError, OSError) as exc:
                    log.warning("could not report %d KV event(s): %s", len(events), exc)

    def run(self) -> None:
        setup_tracing("sluice-worker")
        run_async(self.async_run())

    def _registry_url(self) -> str:
        """Where gateways send this worker's requests: the worker, or under ``--relay direct``
        the server it fronts (gateway/relay/direct.py)."""
        if self.settings.relay == "direct":
            from engine_worker.engines.openai_upstream import OpenAIUpstreamEngine

            assert isinstance(self.engine, OpenAIUpstreamEngine)
            return self.engine.relay_url()
        return self.settings.url()

    async def async_run(self) -> None:
        from engine_worker.app import create_app
        from engine_worker.metrics import WorkerMetrics

        s = self.settings
        # Waits for Redis however long it is away (a worker that exits instead is restarted
        # into the same outage, again and again): the log says so every ~10 s.
        redis = await create_pool(s.redis_url, max_connections=s.redis_max_connections,
                                  client_name=f"sluice-worker-{s.worker_id}", retries=WAIT_FOR_REDIS)
        self.redis = redis
        try:
            await self.engine.start()
            if not self.model:  # an upstream server's own model name
                self.model = checked_name(str(getattr(self.engine, "model", "") or "model"))
            self.adapters.model = self.model
            await self.adapters.start()
            metrics = WorkerMetrics(self)
            app = create_app(self, metrics)
            settle_gc()  # the engine's frontend lives in this process: its start-up heap too
            server = Server(uvicorn_config(app, s.host, s.port, graceful_s=1, proxy_headers=False,
                                          bounds=ConnectionBounds(cut_slow_readers=False)), self.drain)
            serving = asyncio.create_task(server.serve())
            while not server.started:
                if serving.done():
                    await serving  # raises the bind error
                    return
                await asyncio.sleep(0.02)
            self._registration = Registration(
                redis,
                model=self.model,
                worker_id=s.worker_id,
                url=self._registry_url(),
                engine=self.engine.name,
                capacity=self.engine.capacity,
                heartbeat_ms=s.heartbeat_ms,
                stats=lambda: self.engine.stats().as_dict(),
                healthy=lambda: self.engine.healthy,
                tasks=tuple(t for t in self.tasks if self.serves(t)),
                role=s.role,
                record=self.adapters.record,
                also=lambda: self.adapters.publish(redis),
            )
            self.adapters.changed = self._registration.beat
            await self._registration.start()
            reporting = asyncio.create_task(self._report_kv_events(PrefixIndex(redis)), name="kv-events")
            log.info("worker %s serving %r at %s (gateways call %s)", s.worker_id, self.model, s.url(),
                     self._registry_url())
            metrics.stalls.start()  # its loop's backlog and the collector's pauses, while it serves
            try:
                await serving
            finally:
                reporting.cancel()
                metrics.stalls.close()
        finally:
            if self._registration is not None:
                await self._registration.deregister()
            await self.engine.shutdown()
            await redis.aclose()
            log.info("worker stopped: %r", self)
            unsettle_gc()  # the start-up heap frozen by settle_gc: freed at exit like the rest
