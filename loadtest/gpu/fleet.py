"""The processes of the GPU routing bench: an embedded Redis, N workers sharing one GPU (or
sim workers), and one gateway per routing arm, started once and kept for every workload.

Workers publish their engines' KV events (``SLUICE_PREFIX_INDEX=precise``) for the whole
run; a gateway in ``approx`` mode never looks them up (its blocks are named by words), so
both indexes are measured against the same workers.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from sluice import keys
from sluice.commands.bench_stack import LoggedChild, _child_env, sync_client
from sluice.embedded_redis import EmbeddedRedis, free_port

#: Routing arms: name -> gateway environment.
ARMS: dict[str, dict[str, str]] = {
    "rr": {"SLUICE_GATEWAY_ROUTING": "rr"},
    "least": {"SLUICE_GATEWAY_ROUTING": "least"},
    # least as it was before issue 24's fix: slots in use only, the least loaded alone (each
    # closed-loop user back to the worker it left)
    "least-slots": {"SLUICE_GATEWAY_ROUTING": "least", "SLUICE_GATEWAY_ROUTE_LEAST_PENDING_WEIGHT": "0",
                    "SLUICE_GATEWAY_ROUTE_LEAST_SPREAD": "0"},
    # least with a request before its first token weighing 1 + W (the pending-prefill weight) and
    # those within S requests of the least loaded taken in turn: least-w0 is the default before
    # 2026-12-03's fix (waves at a worker on the H200), least-w12s3 the default since (gateway/config.py)
    **{f"least-w{w}": {"SLUICE_GATEWAY_ROUTING": "least", "SLUICE_GATEWAY_ROUTE_LEAST_PENDING_WEIGHT": str(w),
                       "SLUICE_GATEWAY_ROUTE_LEAST_SPREAD": "1"} for w in (0, 2, 4)},
    "least-w12s3": {"SLUICE_GATEWAY_ROUTING": "least", "SLUICE_GATEWAY_ROUTE_LEAST_PENDING_WEIGHT": "12",
                    "SLUICE_GATEWAY_ROUTE_LEAST_SPREAD": "3"},
    "cache-approx": {"SLUICE_GATEWAY_ROUTING": "cache", "SLUICE_PREFIX_INDEX": "approx"},
    "cache-precise": {"SLUICE_GATEWAY_ROUTING": "cache", "SLUICE_PREFIX_INDEX": "precise"},
}

#: Cache routing's knobs an arm's name may set after its base: ``cache-precise-p1-h0.5`` is
#: cache-precise with a pending-prefill weight of 1 and a hot-spot share of 0.5;
#: ``cache-precise-i0`` sends the workers no prompt ids, so each tokenizes its prompts
#: (gateway/config.py says what each one does).
KNOBS = {"p": "SLUICE_GATEWAY_ROUTE_PREFILL_WEIGHT", "l": "SLUICE_GATEWAY_ROUTE_LOAD_BLOCKS",
         "h": "SLUICE_GATEWAY_ROUTE_HOT_SHARE", "i": "SLUICE_GATEWAY_SEND_PROMPT_IDS"}


def arm_env(arm: str) -> dict[str, str]:
    """The gateway environment of a routing arm: a name of :data:`ARMS`, then any knobs."""
    letters = "".join(KNOBS)
    base, *knobs = re.split(rf"-(?=[{letters}][0-9.]+(?:-|$))", arm)
    if base not in ARMS or any(not re.fullmatch(rf"[{letters}][0-9.]+", k) for k in knobs):
        raise ValueError(f"unknown arm {arm!r}: one of {sorted(ARMS)}, then -{'/-'.join(KNOBS)} knobs")
    return {**ARMS[base], **{KNOBS[k[0]]: k[1:] for k in knobs}}


def stop_on_sigterm() -> None:
    """SIGTERM (a phase's ``timeout``) unwinds like Ctrl-C, so the fleet's ``with`` block stops
    its workers: each runs in its own session and would otherwise outlive the bench, holding
    its share of the GPU from the next phase."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass
class FleetShape:
    engine: str
    model: str
    served: str
    workers: int = 4
    max_num_seqs: int = 64
    max_model_len: int = 4096
    max_batched: int = 8192
    kv_blocks: int = 1024
    block_tokens: int = 16
    block_bytes: int = 512 * 1024
    gpu_util: float = 0.2
    enforce_eager: bool = False
    worker_env: dict[str, str] = field(default_factory=dict)
    gateway_procs: int = 4
    sim_prefill_ms: float = 0.02
    sim_token_ms: float = 8.0

    @property
    def cache_tokens(self) -> int:
        """One worker's KV cache in tokens."""
        return self.kv_blocks * self.block_tokens


class Fleet:
    def __init__(self, shape: FleetShape, logs: Path) -> None:
        self.shape = shape
        self.logs = logs
        self.redis = EmbeddedRedis()
        self.workers: list[LoggedChild] = []
        self.worker_urls: list[str] = []
        self.gateways: dict[str, tuple[LoggedChild, str]] = {}

    @property
    def redis_url(self) -> str:
        return self.redis.url

    def __enter__(self) -> Fleet:
        self.redis.start()
        return self

    def __exit__(self, *exc: object) -> None:
        children = [gw for gw, _ in self.gateways.values()] + self.workers
        for child in children:  # all at once: vLLM takes seconds to stop, four of them in turn too long
            if child.alive() and child.process is not None:
                child.process.terminate()
        for child in children:
            child.stop(timeout_s=15)
        self.redis.stop()

    def worker_argv(self, i: int, served: str) -> tuple[list[str], dict[str, str]]:
        """Worker ``i``'s command line and environment (``served``: the model name it serves)."""
        s = self.shape
        port = free_port()
        # vLLM workers run through the probe (loadtest/gpu/probe_worker.py): the same worker,
        # with vLLM's per-request and per-half-second scheduler stats in logs/engine-w{i}.jsonl
        entry = "loadtest.gpu.probe_worker" if s.engine == "vllm" else "sluice"
        argv = [sys.executable, "-m", entry, "--log-level", "WARNING", "worker", "--engine", s.engine,
                "--port", str(port), "--redis-url", self.redis_url, "--served-model-name", served,
                "--worker-id", f"w{i}"]
        env = {"SLUICE_PREFIX_INDEX": "precise", **s.worker_env}
        self.worker_urls.append(f"http://127.0.0.1:{port}")
        if s.engine == "vllm":
            env["BENCH_ENGINE_PROBE"] = str(self.logs / f"engine-w{i}.jsonl")
            argv += ["--model", s.model, f"--vllm-max-model-len={s.max_model_len}",
                     f"--vllm-max-num-seqs={s.max_num_seqs}",
                     f"--vllm-kv-cache-gib={s.kv_blocks * s.block_bytes / 2**30}"]
            if s.enforce_eager:
                argv.append("--vllm-enforce-eager")
            engine_args: dict[str, Any] = {"max_num_batched_tokens": s.max_batched,
                                           "num_gpu_blocks_override": s.kv_blocks}
            if os.environ.get("SLUICE_BENCH_DUMMY", "1") == "1":
                engine_args["load_format"] = "dummy"
            if s.gpu_util:
                engine_args["gpu_memory_utilization"] = s.gpu_util
            env |= {"SLUICE_WORKER_VLLM_ENGINE_ARGS": json.dumps(engine_args),
                    "VLLM_CACHE_ROOT": f"/tmp/vllm_cache_w{i}",  # no two compiles write one folder
                    "VLLM_PORT": str(41000 + 500 * i)}  # no two engines race for one port
        else:
            argv += [f"--sim-max-seqs={s.max_num_seqs}", f"--sim-cache-blocks={s.cache_tokens // 64}",
                     f"--sim-prefill-ms-per-token={s.sim_prefill_ms}", f"--sim-token-ms={s.sim_token_ms}"]
        return argv, env

    def start_workers(self, timeout_s: float) -> None:
        s = self.shape
        self.worker_urls = []
        for i in range(s.workers):
            argv, env = self.worker_argv(i, s.served)
            child = LoggedChild(f"worker-w{i}", argv, _child_env(env), self.logs / f"worker-w{i}.log")
            child.start()
            self.workers.append(child)
            if i == 0:
                log(f"worker argv: {' '.join(argv[2:])}; env {env}")
            if s.engine == "vllm":
                time.sleep(2)  # the kit's spacing: engines that start at one instant race for GPU memory checks
        failed = self.wait_registered({s.served: s.workers}, self.workers, timeout_s)
        if failed is not None:
            raise RuntimeError(f"{failed.name} exited early; log {failed.log_path}")

    def wait_registered(self, want: dict[str, int], watched: list[LoggedChild], timeout_s: float) -> LoggedChild | None:
        """Wait until each model has ``want`` workers registered; a watched worker that exits
        is returned (any other that exits raises)."""
        deadline = time.monotonic() + timeout_s
        client = sync_client(self.redis_url)
        try:
            while any(client.hlen(keys.workers(m)) < n for m, n in want.items()):
                for w in self.workers:
                    if not w.alive():
                        if w in watched:
                            return w
                        raise RuntimeError(f"{w.name} exited early; log {w.log_path}")
                if time.monotonic() > deadline:
                    raise RuntimeError("workers not ready in time")
                time.sleep(0.5)
        finally:
            client.close()
        return None

    def start_gateways(self, arms: list[str], tokenizer: str) -> None:
        for arm in dict.fromkeys(arms):  # an arm named twice (a repeat) shares its gateway
            port = free_port()
            env = {"SLUICE_GATEWAY_QUEUE_TIMEOUT_S": "600", "SLUICE_GATEWAY_TTFT_TIMEOUT_S": "300",
                   "SLUICE_GATEWAY_CONNECT_TIMEOUT_S": "10", "SLUICE_GATEWAY_MAX_QUEUE": "20000",
                   "SLUICE_GATEWAY_TOKENIZER": tokenizer, "TOKENIZERS_PARALLELISM": "false", **arm_env(arm)}
            # INFO: the gateway's access lines (queue wait, TTFT, worker, route per request:
            # loadtest/gpu/diagnose.py reads them); its other INFO lines are start-up and shut-down
            gw = LoggedChild(f"gateway-{arm}", [
                sys.executable, "-m", "sluice", "--log-level", "INFO", "gateway", "--procs",
                str(self.shape.gateway_procs), "--port", str(port),
                "--redis-url", self.redis_url + "?max_connections=4096"], _child_env(env), self.logs / f"gateway-{arm}.log")
            gw.start()
            self.gateways[arm] = (gw, f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 120
        for arm, (gw, url) in self.gateways.items():
            while True:
                if not gw.alive():
                    raise RuntimeError(f"gateway {arm} exited early; log {gw.log_path}")
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:  # /ready wants workers
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"gateway {arm} not ready")
                time.sleep(0.2)

    def worker_stats(self) -> dict[str, dict[str, float]]:
        client = sync_client(self.redis_url)
        try:
            return {k.decode(): orjson.loads(v) for k, v in client.hgetall(keys.stats(self.shape.served)).items()}
        finally:
            client.close()

    def in_flight(self) -> dict[str, int]:
        client = sync_client(self.redis_url)
        try:
            return {k.decode(): int(v) for k, v in client.hgetall(keys.inflight(self.shape.served)).items()}
        finally:
            client.close()

    def kill_worker(self, index: int) -> None:
        """SIGKILL a worker and its engine processes (the machine it stands for fails)."""
        w = self.workers[index]
        os.killpg(w.pid, signal.SIGKILL)

    def worker_pids(self) -> list[int]:
        return [w.pid for w in self.workers if w.alive()]

    def gateway_pid(self, arm: str) -> int:
        return self.gateways[arm][0].pid

    def redis_pid(self) -> int | None:
        process = getattr(self.redis, "process", None)
        return process.pid if process is not None else None

    def sampler_groups(self, arm: str | None) -> dict[str, tuple[list[int], str]]:
        """Process groups for loadtest/gpu/sampler.py while ``arm`` runs (None: no gateway)."""
        redis = self.redis_pid()
        return {"client": ([os.getpid()], "self"),
                "gateway": ([self.gateway_pid(arm)] if arm in self.gateways else [], "tree"),
                "frontends": (self.worker_pids(), "self"), "engines": (self.worker_pids(), "below"),
                "redis": ([redis] if redis else [], "tree")}
