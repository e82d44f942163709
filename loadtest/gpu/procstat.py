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


def snapshot() -> dict[int, tuple[int, float]]:
    """Every live process: pid -> (parent pid, CPU seconds), read once."""
    out: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            got = _stat(int(entry))
            if got is not None:
                out[int(entry)] = got
    return out


def tree_of(snap: dict[int, tuple[int, float]], root: int) -> set[int]:
    """``root`` and its live descendants in ``snap``."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in snap.items():
        children.setdefault(parent, []).append(pid)
    seen: set[int] = set()
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        if pid in seen or pid not in snap:
            continue
        seen.add(pid)
        frontier += children.get(pid, [])
    return seen


def system() -> tuple[float, float, int, float]:
    """(busy CPU seconds, all CPU seconds, runnable threads, stolen CPU seconds) of the whole
    machine, /proc/stat (steal: time the host ran something else while this VM's CPU wanted to run)."""
    busy = total = steal = 0.0
    running = 0
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu "):
            ticks = [int(x) for x in line.split()[1:]]
            idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
            total = sum(ticks[:8]) / _TICK  # guest time is already in user
            busy = total - idle / _TICK
            steal = (ticks[7] if len(ticks) > 7 else 0) / _TICK
        elif line.startswith("procs_running "):
            running = int(line.split()[1])
    return busy, total, running, steal
