"""The nemesis's fault schedule: Redis gets time to answer between two of its faults."""

from __future__ import annotations

import pytest

from sluice.nemesis.schedule import REDIS_GAP_S, SETTLE_S, fault_schedule, kinds_for


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
