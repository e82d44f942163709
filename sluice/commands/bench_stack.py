"""A private stack for one benchmark phase: Redis, sim workers and gateway processes.

Every child runs in its own process group with its output in a log file under
``logs_dir``, and dies with this process (PR_SET_PDEATHSIG). ``close()`` stops
them all, gateways first, and kills each group, so no orphan is left behind.

>>> shape = StackShape(gateways=3, workers=2, worker_args=["--sim-max-seqs=32"])
>>> with Stack(shape, Path("/tmp/logs")) as stack:
...     print(stack.gateway_urls)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import httpx

from sluice import keys
from sluice.embedded_redis import EmbeddedCluster, EmbeddedRedis, free_port
from sluice.processes import Child, child_preexec
from sluice.redis_url import sync_client

MODEL = "sim"


@dataclass
class StackShape:
    gateways: int = 3
    workers: int = 2
    #: "single" (one redis-server) or "cluster" (three masters).
    redis: str = "single"
    #: SLUICE_* settings every gateway gets.
    gateway_env: dict[str, str] = field(default_factory=dict)
    #: Extra flags every sim worker gets.
    worker_args: list[str] = field(default_factory=list)
    #: Log level of every child (INFO: gateways write their access log).
    log_level: str = "WARNING"


class LoggedChild(Child):
    """A supervised child whose stdout and stderr go to ``log_path``."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        super().__init__(name, argv, env)
        self.log_path = log_path

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                preexec_fn=child_preexec, start_new_session=True,  # noqa: PLW1509 - prctl only
            )

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid


def gateway_env(queue_timeout_s: float, **extra: str) -> dict[str, str]:
    """Gateway settings for a flood: a queue that holds everything, waits of ``queue_timeout_s``."""
    return {"SLUICE_GATEWAY_MAX_QUEUE": "20000", "SLUICE_GATEWAY_QUEUE_TIMEOUT_S": str(queue_timeout_s), **extra}


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


class Stack:
    def __init__(self, shape: StackShape, logs_dir: Path, label: str = "stack") -> None:
        self.shape = shape
        self.logs_dir = logs_dir
        self.label = label
        self.redis: EmbeddedRedis | EmbeddedCluster | None = None
        self.workers: list[LoggedChild] = []
        self.gateways: list[LoggedChild] = []
        self.gateway_urls: list[str] = []
        self.worker_urls: list[str] = []

    @property
    def redis_url(self) -> str:
        assert self.redis is not None
        return self.redis.url

    def start(self, timeout_s: float = 60.0) -> Self:
        s = self.shape
        self.redis = (EmbeddedCluster() if s.redis == "cluster" else EmbeddedRedis()).start()
        base = [sys.executable, "-m", "sluice", "--log-level", s.log_level]
        for _ in range(s.workers):
            self._spawn_worker()
        self._wait_workers(time.monotonic() + timeout_s)
        for i in range(s.gateways):
            port = free_port()
            argv = [*base, "gateway", "--procs", "1", "--port", str(port), "--redis-url", self.redis_url]
            self.gateways.append(self._spawn(f"gateway-{i}", argv, s.gateway_env))
            self.gateway_urls.append(f"http://127.0.0.1:{port}")
        for child, url in zip(self.gateways, self.gateway_urls, strict=True):
            self._wait_http(child, url + "/ready", time.monotonic() + timeout_s)
        return self

    def _spawn_worker(self, *args: str) -> None:
        port = free_port()
        name = f"w{len(self.worker_urls)}-{port}"
        argv = [sys.executable, "-m", "sluice", "--log-level", self.shape.log_level, "worker", "--engine", "sim",
                "--port", str(port), "--redis-url", self.redis_url, "--served-model-name", MODEL,
                "--worker-id", name, *self.shape.worker_args, *args]
        self.workers.append(self._spawn(f"worker-{name}", argv, {}))
        self.worker_urls.append(f"http://127.0.0.1:{port}")

    def add_worker(self, *args: str, timeout_s: float = 60.0) -> None:
        """Start one more sim worker (``args``: flags of its own, e.g. another model's name)
        and wait until it is registered."""
        self._spawn_worker(*args)
        self._wait_http(self.workers[-1], self.worker_urls[-1] + "/health", time.monotonic() + timeout_s)

    def kill_worker(self, index: int) -> None:
        """SIGKILL one worker, as a crash would; it leaves the stack's list of workers."""
        child = self.workers.pop(index)
        self.worker_urls.pop(index)
        child.kill_group()
        assert child.process is not None
        child.process.wait()

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> LoggedChild:
        child = LoggedChild(name, argv, _child_env(env), self.logs_dir / f"{self.label}-{name}.log")
        child.start()
        return child

    def _wait_workers(self, deadline: float) -> None:
        client = sync_client(self.redis_url)
        try:
            while client.hlen(keys.workers(MODEL)) < len(self.workers):
                self._check_alive(self.workers, deadline)
                time.sleep(0.1)
        finally:
            client.close()

    def _wait_http(self, child: LoggedChild, url: str, deadline: float) -> None:
        while True:
            self._check_alive([child], deadline)
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)

    def _check_alive(self, children: list[LoggedChild], deadline: float) -> None:
        for child in children:
            if not child.alive():
                raise RuntimeError(f"{child.name} exited early; log: {child.log_path}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{self.label} not ready in time; logs under {self.logs_dir}")

    def kill_gateway(self, index: int) -> None:
        """SIGKILL one gateway (its whole process group), as a crash would."""
        child = self.gateways[index]
        child.kill_group()
        assert child.process is not None
        child.process.wait()

    def close(self) -> None:
        for child in [*self.gateways, *self.workers]:
            child.stop(timeout_s=10)
        if self.redis is not None:
            self.redis.stop()

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
