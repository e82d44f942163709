"""The event loop's lag (gateway/loop_lag.py): what ready work waits on a busy loop, and a
blocked loop's stall counted and logged."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import CollectorRegistry, Histogram

from gateway.loop_lag import LoopLag


def _histogram() -> tuple[Histogram, CollectorRegistry]:
    registry = CollectorRegistry()
    return Histogram("lag_seconds", "lag", buckets=(0.001, 0.01, 0.1, 0.5, 1, 5), registry=registry), registry


def _at_most(registry: CollectorRegistry, bound: str) -> float:
    return registry.get_sample_value("lag_seconds_bucket", {"le": bound}) or 0.0


async def test_a_busy_loop_shows_its_backlog() -> None:
    """A task that holds the loop 20 ms at each step: the probe's callback waits behind it."""
    histogram, registry = _histogram()
    probe = LoopLag(histogram, sample_s=0.01)
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
    probe = LoopLag(histogram, sample_s=0.01, stall_s=0.3)
    probe.start()
    await asyncio.sleep(0.05)
    with caplog.at_level(logging.WARNING, logger="sluice.gateway"):
        time.sleep(0.6)  # the loop blocked: the probe's timer fires late
        await asyncio.sleep(0.05)
    probe.close()
    assert _at_most(registry, "+Inf") - _at_most(registry, "0.5") >= 1  # the stall, as its lateness
    assert [r for r in caplog.records if "event loop was blocked for" in r.getMessage()]


async def test_closed_it_samples_no_more() -> None:
    histogram, registry = _histogram()
    probe = LoopLag(histogram, sample_s=0.01)
    probe.start()
    await asyncio.sleep(0.1)
    probe.close()
    seen = registry.get_sample_value("lag_seconds_count")
    await asyncio.sleep(0.1)
    assert seen and registry.get_sample_value("lag_seconds_count") == seen
