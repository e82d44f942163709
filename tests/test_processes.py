"""Supervised children: each is signalled once, then waited for."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from sluice.processes import Child

# A child that logs every SIGTERM it gets and takes 1 s to stop after the first one.
_COUNTING = """
import signal, sys, time
log = open(sys.argv[1], "a", buffering=1)
stopping = []
def on_term(sig, frame):
    log.write("TERM\\n")
    stopping.append(time.monotonic())
signal.signal(signal.SIGTERM, on_term)
log.write("ready\\n")
while not stopping or time.monotonic() - stopping[0] < 1.0:
    time.sleep(0.01)
"""


def test_a_child_signalled_then_stopped_gets_one_sigterm(tmp_path: Path) -> None:
    """A supervisor signals every child first, then waits for each: the wait must not signal
    again, since a second SIGTERM is a gateway's force-exit, which cuts its open streams."""
    log = tmp_path / "signals"
    child = Child("counting", [sys.executable, "-c", _COUNTING, str(log)])
    child.start()
    deadline = time.monotonic() + 10
    while "ready" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.02)
    child.signal_stop()
    time.sleep(0.3)  # the child has handled it and is stopping
    child.signal_stop()
    child.stop(timeout_s=10)
    assert child.process is not None and child.process.returncode == 0
    assert log.read_text().splitlines() == ["ready", "TERM"]
