"""What the machine does while an arm runs: CPU per process group, runnable threads, GPU
busy, sampled every ``period_s`` in a thread of the bench (the load generator's process).

Groups: ``client`` (this process alone: the load generator), ``gateway`` (the arm's
gateway, all its processes), ``frontends`` (the workers' own processes: Sluice's worker
and vLLM's AsyncLLM), ``engines`` (everything under them: vLLM's engine cores), ``redis``;
``other`` is the machine's busy time less those. A sample's values are cores (CPU seconds
per second) over the period before it; ``runnable`` is /proc/stat's procs_running (threads
on a CPU or waiting for one: above the machine's cores, something waits for CPU);
``steal`` the cores the VM's host took away (wanted, not given); ``gpu`` is nvidia-smi's utilization.gpu (%, the share of time a kernel ran), when there is one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from loadtest.gpu import procstat

#: group -> (root pids, "self" | "tree" | "below": the roots alone, with every descendant, or
#: their descendants only)
Groups = dict[str, tuple[list[int], str]]


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class Sampler:
    def __init__(self, groups: Callable[[], Groups], period_s: float = 0.5) -> None:
        self._groups = groups
        self._period_s = period_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._gpu: subprocess.Popen[str] | None = None
        self._gpu_last: float | None = None
        self._gpu_thread: threading.Thread | None = None
        self.cores = os.cpu_count() or 1

    def __enter__(self) -> Sampler:
        if shutil.which("nvidia-smi"):
            self._gpu = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                 f"--loop-ms={int(self._period_s * 1000)}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._gpu_thread = threading.Thread(target=self._read_gpu, name="sampler-gpu", daemon=True)
            self._gpu_thread.start()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._gpu is not None:
            self._gpu.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._gpu.wait(timeout=5)

    def _read_gpu(self) -> None:
        assert self._gpu is not None and self._gpu.stdout is not None
        for line in self._gpu.stdout:
            with contextlib.suppress(ValueError):
                self._gpu_last = float(line.strip().split(",")[0])

    def _measure(self) -> tuple[float, dict[str, float], tuple[float, float, int, float]]:
        snap = procstat.snapshot()
        per: dict[str, float] = {}
        for name, (roots, mode) in self._groups().items():
            total = 0.0
            for root in roots:
                pids = procstat.tree_of(snap, root) if mode != "self" else ({root} & snap.keys())
                if mode == "below":
                    pids.discard(root)
                total += sum(snap[p][1] for p in pids)
            per[name] = total
        return time.time(), per, procstat.system()

    def _run(self) -> None:
        last = self._measure()
        while not self._stop.wait(self._period_s):
            try:
                now = self._measure()
            except OSError:
                continue
            dt = now[0] - last[0]
            if dt <= 0:
                continue
            sample: dict[str, Any] = {"t": round(now[0], 3)}
            for name, cpu in now[1].items():
                # a group whose processes changed (a new arm's gateway) restarts from its new total
                sample[name] = round(max(0.0, cpu - last[1].get(name, cpu)) / dt, 3)
            busy = (now[2][0] - last[2][0]) / max(now[2][1] - last[2][1], 1e-9) * self.cores
            sample["busy"] = round(busy, 3)
            sample["steal"] = round((now[2][3] - last[2][3]) / max(now[2][1] - last[2][1], 1e-9) * self.cores, 3)
            sample["other"] = round(max(0.0, busy - sum(sample[n] for n in now[1])), 3)
            sample["runnable"] = now[2][2]
            if self._gpu_last is not None:
                sample["gpu"] = self._gpu_last
            self.samples.append(sample)
            last = now

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """Means (and a few upper quantiles) over the samples taken between t0 and t1 (epoch s)."""
        rows = [s for s in self.samples if t0 <= s["t"] <= t1]
        if not rows:
            return {}
        out: dict[str, Any] = {"samples": len(rows), "cores": self.cores}
        for key in sorted({k for s in rows for k in s} - {"t"}):
            values = [s[key] for s in rows if key in s]
            out[f"{key}_mean"] = round(sum(values) / len(values), 2)
            if key in ("busy", "runnable", "client", "gateway", "gpu"):
                out[f"{key}_p90"] = _q(values, 0.9)
                out[f"{key}_max"] = max(values)
            if key == "gpu":
                out["gpu_p10"] = _q(values, 0.1)
        return out
