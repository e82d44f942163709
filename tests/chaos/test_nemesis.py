"""The nemesis, short: 320 requests and 32 faults of every kind one Redis server allows, seed 7.

Three gateway processes on two ports (one of them behind the harness's TCP proxy to Redis),
three sim workers, API keys on; plain, resumable and non-streaming clients, n > 1, three
tenants, slow readers, clients that leave and come back, one huge resumable stream past
the journal's cap. Every request is checked against the simulator's exact reference
(sluice/nemesis/checker.py); then the invariants (no slot, lease or queued request left,
no key without a TTL outside the registry and API keys, memory bounds, usage billed once).

Fails on any forbidden outcome: run with ``-s`` to read the table and the forbidden list.
The full run is ``sluice bench --scenario nemesis`` (5,000 requests, 320 faults).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.nemesis.run import NemesisConfig, run_nemesis

pytestmark = pytest.mark.chaos

SEED = 7


@pytest.mark.timeout(420)
async def test_nemesis_short_run_has_no_forbidden_outcome(tmp_path: Path) -> None:
    config = NemesisConfig(seed=SEED, streams=320, faults=32, duration_s=60.0, huge=1,
                           json_path=tmp_path / "nemesis.json", plot_path=tmp_path / "nemesis.png",
                           logs=tmp_path / "logs")
    config.logs.mkdir()  # type: ignore[union-attr]
    result = await run_nemesis(config)
    print("\n" + result.text() + f"\nsummary: {config.json_path}")
    applied = result.summary["faults"]
    assert result.summary["requests"] >= 300
    assert applied["applied"] >= 30 and len(applied["kinds"]) >= 6, applied
    assert not result.summary["fault_errors"], result.summary["fault_errors"]
    assert not result.forbidden, [f"{f['request']} {f['kinds']}: {f['detail'][:2]}" for f in result.forbidden[:10]]
    assert all(i.ok for i in result.invariants), [i.detail for i in result.invariants if not i.ok]
