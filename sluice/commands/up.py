"""``sluice up``: one command for Redis, workers and the gateway, with no orphans left behind.

Children get SIGTERM when this process dies (PR_SET_PDEATHSIG) and are stopped
in order on Ctrl-C or SIGTERM: gateway first (no new requests), then workers
(they drain), then the embedded Redis. A worker that dies is restarted with
exponential backoff, as a compose ``restart: unless-stopped`` would.

``--pd`` starts prefill and decode workers (sluice/roles.py); vLLM workers get vLLM's
ExampleConnector, which moves each prompt's KV through files in a folder of this
process's own, removed when it stops.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from types import FrameType

import httpx
from redis.exceptions import RedisError

from sluice import keys
from sluice.embedded_redis import EmbeddedRedis, free_port
from sluice.processes import Child, default_procs
from sluice.redis_pool import redact_url
from sluice.redis_url import sync_client
from sluice.roles import BOTH, DECODE, PREFILL, Role

log = logging.getLogger("sluice.commands.up")


@dataclass
class UpOptions:
    engine: str = "sim"
    workers: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    model: str | None = None
    served_model_name: str | None = None
    redis_url: str | None = None
    ready_timeout_s: float = 900.0
    log_level: str = "INFO"
    gateway_procs: int = 0
    gpus: str | None = None
    tensor_parallel: int = 1
    worker_args: list[str] = field(default_factory=list)
    #: Prefill/decode disaggregation: half the workers prefill, half decode.
    pd: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> UpOptions:
        return cls(
            engine=args.engine,
            workers=args.workers if args.workers is not None else 2 if args.pd else 1,
            host=args.host,
            port=args.port,
            model=args.model,
            served_model_name=args.served_model_name,
            redis_url=args.redis_url or os.environ.get("SLUICE_REDIS_URL"),
            ready_timeout_s=args.ready_timeout_s,
            log_level=args.log_level,
            gateway_procs=args.gateway_procs,
            gpus=args.gpus,
            tensor_parallel=args.tensor_parallel,
            worker_args=list(args.worker_arg),
            pd=args.pd,
        )


#: vLLM's NixlConnector listens on a side-channel port per engine (plus its tensor-parallel
#: rank); workers on one host each get their own, this far apart, from the base vLLM uses.
NIXL_PORT_BASE = 5600
NIXL_PORT_STRIDE = 16


def _worker_env(engine: str, index: int, devices: list[str] | None) -> dict[str, str] | None:
    """GPU workers see only their own devices; vLLM on CPU pins its compute to core 0 by
    default: spread CPU workers over the cores. Every vLLM worker gets its own NIXL
    side-channel port (all on vLLM's default collided: a second ``--pd`` worker with
    ``NixlConnector`` could not listen), counted from ``VLLM_NIXL_SIDE_CHANNEL_PORT`` if set."""
    if engine != "vllm" and devices is None:
        return None
    env = {**os.environ}
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    if engine == "vllm":
        base = int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", NIXL_PORT_BASE))
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(base + NIXL_PORT_STRIDE * index)
        if devices is None and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(index % (os.cpu_count() or 1))
    return env


def _gateway_env(engine: str, model: str | None) -> dict[str, str] | None:
    """vLLM workers: the gateway's processes tokenize each prompt with the model's own folder
    and send the ids, which a vLLM worker with the same tokenizer runs as they are
    (``SLUICE_GATEWAY_TOKENIZER``, gateway/config.py). Its frontend, one process, tokenized
    them otherwise, and bounded one-token requests on a GPU: on an H100, 64 and 256 streams,
    647-777 and 771-911 req/s without, 973 and 1,415 with (loadtest/gpu/h100-2026-12-07-tokenizer).
    A ``SLUICE_GATEWAY_TOKENIZER`` already set wins (empty: off)."""
    if engine != "vllm" or model is None or "SLUICE_GATEWAY_TOKENIZER" in os.environ:
        return None
    return {**os.environ, "SLUICE_GATEWAY_TOKENIZER": model}


def gpu_groups(gpus: str | None, tensor_parallel: int) -> list[list[str]] | None:
    """``--gpus 0,1,2,3 --tensor-parallel 2`` -> [["0", "1"], ["2", "3"]]: one worker per
    group. ``all`` asks ``nvidia-smi`` how many there are. None without ``--gpus``."""
    if not gpus:
        return None
    if gpus == "all":
        try:
            listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=True)
        except (OSError, subprocess.SubprocessError) as exc:
            raise ValueError(f"--gpus all: cannot list GPUs with nvidia-smi ({exc})") from None
        devices = [str(i) for i, line in enumerate(listing.stdout.splitlines()) if line.startswith("GPU ")]
    else:
        devices = [d.strip() for d in gpus.split(",") if d.strip()]
    if not devices or len(devices) % tensor_parallel:
        raise ValueError(f"--gpus gives {len(devices)} device(s), not a multiple of --tensor-parallel "
                         f"{tensor_parallel}")
    return [devices[i:i + tensor_parallel] for i in range(0, len(devices), tensor_parallel)]


def worker_roles(count: int, pd: bool) -> list[Role]:
    """Each worker's role: ``both``; with ``--pd`` the first half prefill, the rest decode."""
    if not pd:
        return [BOTH] * count
    if count < 2:
        raise ValueError(f"--pd needs a prefill and a decode worker: {count} worker(s) asked for")
    return [PREFILL] * (count // 2) + [DECODE] * (count - count // 2)


def example_connector(role: Role, folder: str) -> str:
    """vLLM's ``--kv-transfer-config`` for one side of a pair joined through files in ``folder``."""
    return json.dumps({"kv_connector": "ExampleConnector",
                       "kv_role": "kv_producer" if role == PREFILL else "kv_consumer",
                       "kv_connector_extra_config": {"shared_storage_path": folder}})


#: A worker that dies this many times before the stack is ready stops `sluice up`.
_STARTUP_RESTARTS = 3


class Supervisor:
    def __init__(self, options: UpOptions) -> None:
        self.options = options
        self._stop = False
        self.redis: EmbeddedRedis | None = None
        self.gateway: Child | None = None
        self.workers: list[Child] = []
        self.redis_url: str | None = None
        #: ``--pd`` with vLLM: the folder its ExampleConnector moves KV through.
        self.kv_folder: str | None = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop = True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            failed = self.start()
            if failed is not None:
                return failed
            self._banner()
            self._supervise()
            return 0
        finally:
            self.stop()

    def _model(self) -> str | None:
        """The model folder workers get; prepares the default model on first use."""
        from sluice.models import (
            default_model_dir,
            is_prepared,
            prepare_default,
            resolve,
        )

        o = self.options
        if o.engine == "sim":
            return None
        if o.model is None and not is_prepared(default_model_dir()):
            log.info("preparing the default model (once)")
            prepare_default(log=lambda line: log.info("%s", line))
        return str(resolve(o.model))

    def start(self) -> int | None:
        """Start Redis (unless given), workers and gateway; wait for ``/ready``.

        Returns None once ready, else the exit code to fail with.
        """
        from sluice.models import ModelError

        o = self.options
        if o.pd and o.engine == "trtllm":
            print("sluice up: --pd needs --engine vllm (its KV connectors) or sim", file=sys.stderr)
            return 2
        try:
            groups = gpu_groups(o.gpus, o.tensor_parallel)
            roles = worker_roles(len(groups) if groups else o.workers, o.pd)
        except ValueError as exc:
            print(f"sluice up: {exc}", file=sys.stderr)
            return 2
        try:
            model = self._model()
        except ModelError as exc:
            print(f"sluice up: {exc}", file=sys.stderr)
            return 2
        # Workers answer only gateways that hold this secret; every child inherits it.
        os.environ.setdefault("SLUICE_INTERNAL_TOKEN", secrets.token_urlsafe(32))
        redis_url = o.redis_url
        if redis_url is None:
            self.redis = EmbeddedRedis().start()
            redis_url = self.redis.url
            log.info("embedded redis-server on %s", redis_url)
        self.redis_url = redis_url
        base = [sys.executable, "-m", "sluice", "--log-level", o.log_level]
        if o.pd and o.engine == "vllm":
            self.kv_folder = tempfile.mkdtemp(prefix="sluice-pd-kv-")
        for i, role in enumerate(roles):
            port = free_port()
            argv = [*base, "worker", "--engine", o.engine, "--port", str(port),
                    "--redis-url", redis_url, "--worker-id", f"worker-{i}-{port}"]
            if groups and o.tensor_parallel > 1:
                argv += ["--vllm-tensor-parallel-size", str(o.tensor_parallel)]
            if model:
                argv += ["--model", model]
            if o.served_model_name:
                argv += ["--served-model-name", o.served_model_name]
            if role != BOTH:
                argv += ["--role", role]
                if self.kv_folder is not None:
                    argv += ["--kv-transfer-config", example_connector(role, self.kv_folder)]
            argv += o.worker_args  # after ours: a --kv-transfer-config given here wins
            env = _worker_env(o.engine, i, groups[i] if groups else None)
            self.workers.append(Child(f"worker-{i}", argv, env=env))
        procs = o.gateway_procs or default_procs(share=4)  # the workers need cores too
        self.gateway = Child("gateway", [*base, "gateway", "--host", o.host, "--port", str(o.port),
                                         "--redis-url", redis_url, "--procs", str(procs)],
                             env=_gateway_env(o.engine, model))
        for child in [*self.workers, self.gateway]:
            child.start()
        return None if self._wait_ready() else 1

    def _supervise(self) -> None:
        while not self._stop:
            time.sleep(0.2)
            for child in [*self.workers, self.gateway]:
                if not child.alive() and not self._stop:
                    child.restart_if_due()
        log.info("stopping")

    def url(self) -> str:
        host = self.options.host if self.options.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{self.options.port}"

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.options.ready_timeout_s
        while not self._stop and time.monotonic() < deadline:
            assert self.gateway is not None
            if not self.gateway.alive():
                print(f"sluice up: the gateway exited (code {self.gateway.process.returncode}); "
                      "see the log above", file=sys.stderr)  # type: ignore[union-attr]
                return False
            for worker in self.workers:
                if worker.alive():
                    continue
                if worker.restarts >= _STARTUP_RESTARTS:
                    code = worker.process.returncode if worker.process else None
                    print(f"sluice up: {worker.name} keeps exiting (last code {code}); see the log above",
                          file=sys.stderr)
                    return False
                worker.restart_if_due()
            try:
                answer = httpx.get(self.url() + "/ready", timeout=2)
                # Ready once every worker it started serves, not the first one (with --pd, a
                # prefill worker alone was "ready" and its first requests found no decode one).
                if answer.status_code == 200 and self._live_workers(answer.json().get("models", [])) >= len(self.workers):
                    return True
            except (httpx.HTTPError, RedisError, ValueError):
                pass
            time.sleep(0.25)
        if not self._stop:
            print(f"sluice up: not ready after {self.options.ready_timeout_s:.0f}s", file=sys.stderr)
        return self._stop and False

    def _live_workers(self, models: list[str]) -> int:
        """Workers of ``models`` whose heartbeat has not expired, on Redis's clock."""
        client = sync_client(self.redis_url or "")
        try:
            seconds, micros = client.time()
            now_ms = seconds * 1000 + micros // 1000
            return sum(1 for model in models for expiry in client.hvals(keys.alive(model)) if int(expiry) >= now_ms)
        finally:
            client.close()

    def _banner(self) -> None:
        url = self.url()
        try:
            models = httpx.get(url + "/ready", timeout=2).json().get("models", [])
        except (httpx.HTTPError, ValueError):
            models = []
        model = models[0] if models else "MODEL"
        roles = worker_roles(len(self.workers), self.options.pd)
        workers = (f"{roles.count(PREFILL)} prefill + {roles.count(DECODE)} decode" if self.options.pd
                   else str(len(self.workers)))
        print(
            f"\nSluice is ready at {url}  (models: {', '.join(models) or '-'}; "
            f"{workers} {self.options.engine} worker(s))\n"
            f"Redis: {redact_url(self.redis_url or '')}{' (embedded, not persisted)' if self.redis else ''}\n\n"
            f"  curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f"    -d '{{\"model\": \"{model}\", \"stream\": true, "
            f"\"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'\n\n"
            "Ctrl-C stops everything.\n",
            flush=True,
        )

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop(timeout_s=35)
        for worker in self.workers:
            worker.signal_stop()
        for worker in self.workers:
            worker.stop(timeout_s=40)
        if self.redis is not None:
            self.redis.stop()
        if self.kv_folder is not None:
            shutil.rmtree(self.kv_folder, ignore_errors=True)
        log.info("all children stopped")
