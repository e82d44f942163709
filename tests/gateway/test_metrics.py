"""A stream's inter-token gaps, counted in its own Gaps and added a bucket at a time, read on
/metrics exactly as observing each gap would (gateway/metrics.py)."""

from __future__ import annotations

import math
import random

from prometheus_client import generate_latest

from gateway.metrics import Gaps, GatewayMetrics


def _itl(metrics: GatewayMetrics) -> dict[str, float]:
    """The inter-token histogram's exposed samples, by name and labels."""
    samples = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith("sluice_gateway_inter_token_latency_seconds") and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            samples[name.removeprefix("sluice_gateway_inter_token_latency_seconds")] = float(value)
    return samples


def test_gaps_added_by_bucket_read_as_each_observed() -> None:
    rng = random.Random(7)
    # Every bucket, its bounds exactly (observe counts a gap equal to a bound in that bound's
    # bucket), and past the last bound (+Inf).
    gaps = [0.0, 0.001, 0.0025, 0.005, 2.5, 3.0, 1e-9, 99.0] + [rng.expovariate(150) for _ in range(1000)]
    observed, batched = GatewayMetrics(), GatewayMetrics()
    for model in ("a", "b"):
        series = observed.itl.labels(model)
        for gap in gaps:
            series.observe(gap)
        counted = Gaps(batched.itl.labels(model), model)
        for gap in gaps:
            counted.add(gap)  # 1,008 gaps: three flushes on the way (every 256), one left
        counted.flush()
        counted.flush()  # nothing left: adds nothing
    want, got = _itl(observed), _itl(batched)
    assert want.keys() == got.keys() and len(want) == 2 * 14  # 12 buckets, count, sum; two models
    for name, value in want.items():  # the sum added in another order: equal to float rounding
        assert got[name] == value if not name.startswith("_sum") else math.isclose(got[name], value), name
    assert got['_bucket{le="+Inf",model="a"}'] == len(gaps) == 1008


def test_a_long_stream_s_gaps_reach_the_series_before_it_ends() -> None:
    metrics = GatewayMetrics()
    counted = Gaps(metrics.itl.labels("m"), "m")
    for _ in range(Gaps.FLUSH_EVERY - 1):
        counted.add(0.004)
    assert _itl(metrics)['_count{model="m"}'] == 0  # held, not yet added
    counted.add(0.004)
    assert _itl(metrics)['_count{model="m"}'] == Gaps.FLUSH_EVERY
    assert _itl(metrics)['_bucket{le="0.0025",model="m"}'] == 0
    assert _itl(metrics)['_bucket{le="0.005",model="m"}'] == Gaps.FLUSH_EVERY
