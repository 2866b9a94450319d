"""Whether the machine is idle: what a throughput figure needs (Linux ``/proc/stat``).

A run's tokens/s is its own only when nothing else uses the CPU: the sweeps measure the cores
other processes use before a run (:func:`busy_cores`) and while it runs (:func:`run_training`:
all the machine's CPU time minus the run's own).
"""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import time
from pathlib import Path

BUSY_CORES = 0.25
"""Other processes' CPU use (cores) above which a throughput figure is not a run's own."""


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) CPU time of the whole machine in clock ticks, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_cores(seconds: float = 2.0) -> float | None:
    """Cores' worth of CPU that all processes use over ``seconds`` (None off Linux)."""
    a = _cpu_jiffies()
    time.sleep(seconds)
    b = _cpu_jiffies()
    if a is None or b is None or b[1] == a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1]) * (os.cpu_count() or 1)


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def machine_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} logical CPUs"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs"


def run_training(cmd: list[str], env: dict) -> tuple[int, float | None]:
    """Run one training; its return code and the cores other processes used meanwhile."""
    j0, c0, t0 = _cpu_jiffies(), _children_cpu_s(), time.perf_counter()
    rc = subprocess.run(cmd, env=env).returncode
    j1, c1, wall = _cpu_jiffies(), _children_cpu_s(), time.perf_counter() - t0
    if j0 is None or j1 is None or wall <= 0:
        return rc, None
    machine_s = (j1[0] - j0[0]) / os.sysconf("SC_CLK_TCK")
    return rc, max(machine_s - (c1 - c0), 0.0) / wall


def measured_alone(record: dict) -> bool:
    """Whether a run's throughput is its own: its load record (``other_cores`` during the run,
    ``busy_cores_before``) exists and says nothing else used more than ``BUSY_CORES``."""
    loads = [record.get("other_cores"), record.get("busy_cores_before")]
    return loads[0] is not None and all(x is None or x <= BUSY_CORES for x in loads)
