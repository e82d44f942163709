"""The gateway process: uvicorn serving :func:`gateway.app.create_app`, one or several
processes on one port.

One gateway *process* is one Python event loop and tops out near one core's worth of
relaying. ``sluice gateway --procs N`` runs N of them behind one port: each binds its
own listening socket with ``SO_REUSEPORT`` and the kernel spreads new connections over
them. They share nothing but Redis (each has its own grant listener, leases and HTTP
client pool), so the supervisor only starts them, restarts one that dies (with
backoff) and, on SIGTERM or Ctrl-C, stops them all and waits for their streams.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from redis.exceptions import RedisError

from gateway.admission.tenancy import StartupRefused, Tenancy
from gateway.app import create_app, refusal_body
from gateway.config import GatewaySettings
from gateway.metrics import MULTIPROC_DIR_ENV, forget_process
from sluice.apikeys import load_records
from sluice.connection_bounds import ConnectionBounds
from sluice.processes import Child, default_procs
from sluice.redis_pool import create_pool
from sluice.serve import Server, run_async, settle_gc, uvicorn_config
from sluice.telemetry import setup_tracing

log = logging.getLogger("sluice.gateway")


async def preflight(settings: GatewaySettings) -> None:
    """Checks that must stop the process with a message, before uvicorn starts. Redis that
    does not answer (restarting, failing over) is waited for up to ``redis_startup_wait_s``,
    then refused with a message (it was a traceback)."""
    if settings.tokenizer and not any((Path(settings.tokenizer) / name).is_file()
                                      for name in ("tokenizer.json", "tokenizer_config.json")):
        raise StartupRefused(f"SLUICE_GATEWAY_TOKENIZER={settings.tokenizer}: no tokenizer there (a model "
                             "folder with tokenizer.json or tokenizer_config.json; empty: none)")
    if settings.keys_file is not None:
        try:  # a gateway told to fall back on keys it cannot read does not start without them
            load_records(settings.keys_file)
        except (OSError, ValueError) as exc:
            raise StartupRefused(f"SLUICE_GATEWAY_KEYS_FILE: {exc}") from None
    deadline = time.monotonic() + settings.redis_startup_wait_s
    waiting = False
    while True:
        try:
            redis = await create_pool(settings.redis_url)
            try:
                return await Tenancy(redis, settings).check_startup()
            finally:
                await redis.aclose()
        except (RedisError, OSError) as exc:
            if time.monotonic() >= deadline:
                raise StartupRefused(
                    f"Redis did not answer for {settings.redis_startup_wait_s:g} s ({type(exc).__name__}: {exc}); "
                    "is it running, and is the Redis URL (--redis-url, SLUICE_REDIS_URL) right?") from None
            if not waiting:
                waiting = True
                log.warning("Redis does not answer (%s: %s): waiting up to %g s for it before starting",
                            type(exc).__name__, exc, settings.redis_startup_wait_s)
            await asyncio.sleep(0.5)


def listen_socket(host: str, port: int, backlog: int = 4096) -> socket.socket:
    """A listening socket that other processes may bind to the same address too."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    sock.listen(backlog)
    return sock


def run(settings: GatewaySettings, log_level: str = "INFO") -> None:
    try:
        run_async(preflight(settings))
    except StartupRefused as exc:
        print(f"sluice gateway: {exc}", file=sys.stderr)
        sys.exit(2)
    procs = settings.procs or default_procs()
    if procs > 1:
        sys.exit(_supervise(settings, procs, log_level))
    _serve(settings)


def _serve(settings: GatewaySettings) -> None:
    setup_tracing("sluice-gateway")
    config = uvicorn_config(
        create_app(settings), settings.host, settings.port,
        graceful_s=settings.shutdown_grace_s, lifespan=True, proxy_headers=False,  # Front applies them
        bounds=ConnectionBounds(max_bytes=settings.max_head_bytes, timeout_s=settings.head_timeout_s,
                                render=refusal_body, max_connections=settings.max_connections,
                                max_unsent_bytes=settings.max_unsent_bytes),
    )
    settle_gc()
    sockets = [listen_socket(settings.host, settings.port)] if settings.reuse_port else None
    run_async(Server(config).serve(sockets=sockets))  # type: ignore[arg-type]


def _supervise(settings: GatewaySettings, procs: int, log_level: str) -> int:
    port = settings.port
    if port == 0:  # every process must bind the same port: pick it here
        with listen_socket(settings.host, 0) as probe:
            port = probe.getsockname()[1]
    metrics_dir = tempfile.mkdtemp(prefix="sluice-gateway-metrics-")  # one /metrics for all N
    env = {**os.environ, "SLUICE_GATEWAY_HOST": settings.host, "SLUICE_GATEWAY_PORT": str(port),
           "SLUICE_REDIS_URL": settings.redis_url, "SLUICE_GATEWAY_PROCS": "1",
           "SLUICE_GATEWAY_REUSE_PORT": "true", MULTIPROC_DIR_ENV: metrics_dir}
    argv = [sys.executable, "-m", "sluice", "--log-level", log_level, "gateway"]
    children = [Child(f"gateway-{i}", argv, env=env) for i in range(procs)]
    stopping = False
    forgotten: set[int] = set()

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("starting %d gateway processes on %s:%d", procs, settings.host, port)
    try:
        for child in children:
            child.start()
        while not stopping:
            time.sleep(0.2)
            for child in children:
                if not child.alive() and not stopping:
                    if child.process is not None and child.process.pid not in forgotten:
                        forgotten.add(child.process.pid)
                        forget_process(child.process.pid, metrics_dir)
                    child.restart_if_due()
    finally:
        for child in children:
            child.signal_stop()
        for child in children:
            child.stop(timeout_s=settings.shutdown_grace_s + 5)
        shutil.rmtree(metrics_dir, ignore_errors=True)
    log.info("all gateway processes stopped")
    return 0
