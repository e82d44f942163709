"""The nemesis's fault schedule: Redis gets time to answer between two of its faults; and the
report of its failovers."""

from __future__ import annotations

import pytest

from sluice.nemesis.faults import FaultRun
from sluice.nemesis.report import failover_serving
from sluice.nemesis.schedule import REDIS_GAP_S, SETTLE_S, Fault, fault_schedule, kinds_for


@pytest.mark.parametrize("topology", ["single", "sentinel", "cluster"])
def test_redis_faults_leave_redis_answering_between_them(topology: str) -> None:
    """Regression (the 2026-12-03 runs): a failover was scheduled as if instant, and the Redis
    faults after it queued behind it, back to back: Redis was in a fault 445-570 s of 600."""
    faults = fault_schedule(7, 330, 600.0, kinds_for(topology), gateways=3, workers=3)
    redis = [f for f in faults if f.target == "redis"]
    for before, after in zip(redis, redis[1:]):
        ends = before.at_s + before.duration_s + SETTLE_S.get(before.kind, 0.0)
        assert after.at_s >= ends + REDIS_GAP_S, (before, after)
    assert len(faults) >= 320 and len({f.kind for f in faults}) == len(kinds_for(topology))
    assert sum(f.duration_s + SETTLE_S.get(f.kind, 0.0) for f in redis) < 0.5 * 600


def test_a_failover_that_never_began_counts_as_not_applied() -> None:
    """Regression: a failover that found no replica fit to take over failed before its
    serving watcher started, and the report said "9 of 9, 0 not applied" of 17."""
    def failover(at_s: float, error: str | None) -> FaultRun:
        run = FaultRun(Fault(0, at_s, "sentinel_failover", "redis", 0.0), started_s=at_s, ended_s=at_s + 11,
                       error=error)
        if error is None:
            run.serving_s = {8000: 0.5}
        return run

    runs = [failover(10.0, None), failover(60.0, "RuntimeError: no replica fit to take over"),
            FaultRun(Fault(1, 30.0, "redis_stop", "redis", 2.0), started_s=30.0, ended_s=32.0, error="boom")]
    report = failover_serving(runs, [8000])
    assert report["failovers"] == 1 and report["not_applied"] == 1
