"""Supervised children: each is signalled once, then waited for."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from sluice.processes import Child

# A child that counts every SIGTERM it gets, takes 1 s to stop after the first one, then logs
# them. Its handler does no I/O: one that wrote to the log ran inside the main code's write of
# "ready" (the test saw the line before that write returned) and failed on the writer's lock
# ("reentrant call", a CI flake).
_COUNTING = """
import signal, sys, time
stopping = []
def on_term(sig, frame):
    stopping.append(time.monotonic())
signal.signal(signal.SIGTERM, on_term)
with open(sys.argv[1], "a") as log:
    log.write("ready\\n")
    log.flush()
    while not stopping or time.monotonic() - stopping[0] < 1.0:
        time.sleep(0.01)
    log.write("TERM\\n" * len(stopping))
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
