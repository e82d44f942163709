"""A serving process's stalls (sluice/stalls.py): what ready work waits on a busy loop, a
blocked loop's stall counted and logged, and each garbage collection's pause counted."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram

from sluice.stalls import GcPauses, LoopLag

ROOT = Path(__file__).resolve().parent.parent


def _histogram() -> tuple[Histogram, CollectorRegistry]:
    registry = CollectorRegistry()
    return Histogram("lag_seconds", "lag", buckets=(0.001, 0.01, 0.1, 0.5, 1, 5), registry=registry), registry


def _at_most(registry: CollectorRegistry, bound: str) -> float:
    return registry.get_sample_value("lag_seconds_bucket", {"le": bound}) or 0.0


async def test_a_busy_loop_shows_its_backlog() -> None:
    """A task that holds the loop 20 ms at each step: the probe's callback waits behind it."""
    histogram, registry = _histogram()
    probe = LoopLag(histogram, "gateway", sample_s=0.01)
    running = True

    async def hog() -> None:
        while running:
            time.sleep(0.02)  # a step of 20 ms of work
            await asyncio.sleep(0)

    probe.start()
    task = asyncio.create_task(hog())
    await asyncio.sleep(0.6)
    running = False
    await task
    probe.close()
    count = registry.get_sample_value("lag_seconds_count")
    assert count is not None and count >= 5
    waited = count - _at_most(registry, "0.01")
    assert waited >= count / 2, f"{waited} of {count} samples waited 10 ms or more behind 20 ms steps"
    assert registry.get_sample_value("lag_seconds_sum") >= 0.01 * waited


async def test_a_blocked_loop_is_counted_as_a_stall_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    histogram, registry = _histogram()
    probe = LoopLag(histogram, "gateway", sample_s=0.01, stall_s=0.3)
    probe.start()
    await asyncio.sleep(0.05)
    with caplog.at_level(logging.WARNING, logger="sluice.stalls"):
        time.sleep(0.6)  # the loop blocked: the probe's timer fires late
        await asyncio.sleep(0.05)
    probe.close()
    assert _at_most(registry, "+Inf") - _at_most(registry, "0.5") >= 1  # the stall, as its lateness
    assert [r for r in caplog.records if "gateway process's event loop was blocked for" in r.getMessage()]


async def test_closed_it_samples_no_more() -> None:
    histogram, registry = _histogram()
    probe = LoopLag(histogram, "gateway", sample_s=0.01)
    probe.start()
    await asyncio.sleep(0.1)
    probe.close()
    seen = registry.get_sample_value("lag_seconds_count")
    await asyncio.sleep(0.1)
    assert seen and registry.get_sample_value("lag_seconds_count") == seen


def test_each_collection_is_timed_by_its_generation_until_closed() -> None:
    """A full collection of a heap of 300,000 objects in cycles takes milliseconds: counted
    under generation 2 with about its duration; young collections under their own."""
    registry = CollectorRegistry()
    histogram = Histogram("gc_seconds", "gc", ["generation"], buckets=(0.001, 0.01, 0.1, 1), registry=registry)
    pauses = GcPauses(histogram)
    gc.disable()  # only the collections asked for below
    pauses.start()
    try:
        heap = [[] for _ in range(300_000)]
        for item in heap:
            item.append(item)  # each a cycle: the collector has to walk it
        began = time.perf_counter()
        gc.collect(2)
        took = time.perf_counter() - began
        gc.collect(0)
    finally:
        pauses.close()
        gc.enable()
    full = registry.get_sample_value("gc_seconds_count", {"generation": "2"})
    assert full == 1
    timed = registry.get_sample_value("gc_seconds_sum", {"generation": "2"})
    assert 0 < timed <= took and timed >= took / 2, (timed, took)
    assert registry.get_sample_value("gc_seconds_count", {"generation": "0"}) >= 1
    del heap
    gc.collect()
    assert registry.get_sample_value("gc_seconds_count", {"generation": "2"}) == 1  # closed: no more


def test_a_collection_inside_a_metrics_lock_does_not_hang_the_process(tmp_path) -> None:
    """prometheus_client's multiprocess mode (a --procs gateway) holds one process-wide lock,
    not reentrant, while it makes a new series, which allocates: a collection can start there.
    Observing from the collector's callback then waited on its own thread for ever."""
    script = (
        "import gc, os\n"
        "from gateway.metrics import GatewayMetrics\n"
        "from sluice.stalls import GcPauses\n"
        "m = GatewayMetrics()\n"
        "pauses = GcPauses(m.stalls.gc_pauses)\n"
        "pauses.start()\n"
        "gc.set_threshold(3)\n"
        "for i in range(2000):\n"
        "    m.requests.labels(f'model-{i}', 'ok').inc()\n"
        "gc.set_threshold(700)\n"
        "pauses.close()\n"
        "print('done')\n"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-2000:]
