"""The GPU bench's vLLM worker: ``python -m sluice ... worker`` with vLLM's own view of each
request and of its scheduler written as JSON lines, for the bench's diagnosis of TTFT.

    python -m loadtest.gpu.probe_worker --log-level WARNING worker --engine vllm ...   (fleet.py)

``BENCH_ENGINE_PROBE``: the file the lines go to (unset: the worker runs as ``python -m sluice``).
A stat logger is added to the ``AsyncLLM`` the worker builds (the worker's code is not
touched: ``AsyncLLM.from_engine_args`` gets one more logger factory). Lines:

- ``{"k": "req", "id", "t", "queued", "prefill", "e2e", "inference", "prompt", "cached", "gen"}``
  per finished request: ``queued`` is the time in vLLM's waiting queue (QUEUED to first
  SCHEDULED), ``prefill`` from SCHEDULED to the first token (a preemption during it
  included), in seconds; ``id`` is vLLM's request id (the gateway's id, then suffixes);
- ``{"k": "tick", "t", "running", "waiting", "kv", "running_max", "waiting_max", "kv_max",
  "preempted", "prompt_computed", "gen", "records"}`` every ``BENCH_ENGINE_PROBE_S`` (0.5 s)
  while the engine reports: the scheduler's last and largest counts over the interval,
  preemptions, prompt tokens computed (not cached) and tokens generated in it, the engine's
  outputs handled (``records``) and the longest time between two of them (``gap_max``: a
  stalled engine, or one with nothing to run).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _logger_class(path: str, period_s: float) -> Any:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class ProbeStatLogger(StatLoggerBase):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index
            self._out = open(path, "a", buffering=1)  # noqa: SIM115 - line-buffered, for the engine's life
            self._reset(time.time())
            self._last: tuple[int, int, float] = (0, 0, 0.0)
            self._last_record = 0.0

        def _reset(self, now: float) -> None:
            self._since = now
            self._max = [0, 0, 0.0]
            self._preempted = self._prompt = self._gen = self._records = 0
            self._gap_max = 0.0

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0, *args: Any, **kwargs: Any) -> None:
            now = time.time()
            if self._records or self._last_record:
                self._gap_max = max(self._gap_max, now - self._last_record)
            self._last_record = now
            self._records += 1
            if scheduler_stats is not None:
                waiting = int(scheduler_stats.num_waiting_reqs) + int(
                    getattr(scheduler_stats, "num_skipped_waiting_reqs", 0) or 0)
                self._last = (int(scheduler_stats.num_running_reqs), waiting, float(scheduler_stats.kv_cache_usage))
                self._max = [max(a, b) for a, b in zip(self._max, self._last, strict=True)]
            if iteration_stats is not None:
                self._preempted += int(iteration_stats.num_preempted_reqs)
                self._gen += int(iteration_stats.num_generation_tokens)
                tokens = getattr(iteration_stats, "prompt_token_stats", None)
                self._prompt += int(getattr(tokens, "computed", 0) or 0)
                for f in iteration_stats.finished_requests:
                    self._out.write(json.dumps({
                        "k": "req", "id": f.request_id, "t": round(now, 4), "queued": round(f.queued_time, 5),
                        "prefill": round(f.prefill_time, 5), "e2e": round(f.e2e_latency, 5),
                        "inference": round(f.inference_time, 5), "prompt": f.num_prompt_tokens,
                        "cached": getattr(f, "num_cached_tokens", 0), "gen": f.num_generation_tokens}) + "\n")
            if now - self._since >= period_s:
                running, waiting, kv = self._last
                self._out.write(json.dumps({
                    "k": "tick", "t": round(now, 3), "running": running, "waiting": waiting, "kv": round(kv, 4),
                    "running_max": self._max[0], "waiting_max": self._max[1], "kv_max": round(self._max[2], 4),
                    "preempted": self._preempted, "prompt_computed": self._prompt, "gen": self._gen,
                    "records": self._records, "gap_max": round(self._gap_max, 4)}) + "\n")
                self._out.flush()
                self._reset(now)

        def log_engine_initialized(self) -> None:
            pass

    return ProbeStatLogger


def install(path: str, period_s: float = 0.5) -> None:
    """Add the probe's logger to every AsyncLLM this process builds from engine args."""
    from vllm.v1.engine.async_llm import AsyncLLM

    original = AsyncLLM.from_engine_args.__func__  # type: ignore[attr-defined]
    probe = _logger_class(path, period_s)

    def from_engine_args(cls: Any, engine_args: Any, *args: Any, stat_loggers: Any = None, **kwargs: Any) -> Any:
        return original(cls, engine_args, *args, stat_loggers=[*(stat_loggers or []), probe], **kwargs)

    AsyncLLM.from_engine_args = classmethod(from_engine_args)  # type: ignore[method-assign,assignment]


def main() -> None:
    path = os.environ.get("BENCH_ENGINE_PROBE")
    if path:
        install(path, float(os.environ.get("BENCH_ENGINE_PROBE_S", "0.5")))
    from sluice.commands.main import main as sluice_main

    sys.argv[0] = "sluice"
    sluice_main()


if __name__ == "__main__":
    main()
