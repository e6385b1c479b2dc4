"""How many CPU threads torch uses: ``--threads N``, else ``OMP_NUM_THREADS`` when set, else the
cores this process may use minus those other processes keep busy right now (at least one): the
machine's busy time is sampled over 0.1 s from ``/proc/stat`` (the 1-minute load average where that
file does not exist; it lags, counting work that just ended).

torch's default (every core) collapses on a busy machine: on 2 cores with the other one loaded, a
256-token forward pass of the demo model took 10x longer with 2 threads than with 1, because each
step waits for the thread that shares its core (``benchmarks/threads.py`` measures it)."""

from __future__ import annotations

import os
import sys
import time


def busy_cores(seconds: float = 0.1) -> float:
    """How many cores other processes keep busy now (this one is idle while it samples)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)  # total, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        try:
            return os.getloadavg()[0]
        except OSError:
            return 0.0
    busy = 1 - (idle1 - idle0) / max(total1 - total0, 1)
    return busy * (os.cpu_count() or 1)


def default_threads() -> int:
    """``OMP_NUM_THREADS`` when set, else the usable cores not busy with other work, at least 1."""
    if os.environ.get("OMP_NUM_THREADS", "").strip().isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, round(cores - busy_cores())))


def use_threads(threads: int | None) -> int:
    """Make torch use ``threads`` (None: :func:`default_threads`), before or after it is imported."""
    n = threads or default_threads()
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(n)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)
    return n
