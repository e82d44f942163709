"""CPU seconds of process trees, read from /proc (no psutil on the device's plain Python).

A gateway with ``--procs N`` is a supervisor and N children; a vLLM worker is the worker
and its engine core (and its compile workers): each is measured as its whole tree.
"""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of one process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def tree_cpu_s(root: int) -> float:
    """CPU seconds used so far by ``root`` and every live descendant."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            got = _stat(int(entry))
            if got is not None:
                parents[int(entry)], cpu[int(entry)] = got
    total, frontier = 0.0, [root]
    seen: set[int] = set()
    while frontier:
        pid = frontier.pop()
        if pid in seen or pid not in cpu:
            continue
        seen.add(pid)
        total += cpu[pid]
        frontier += [child for child, parent in parents.items() if parent == pid]
    return total


def trees_cpu_s(roots: list[int]) -> float:
    return sum(tree_cpu_s(pid) for pid in roots)
