"""How many CPU threads torch uses: ``--threads N``, else ``OMP_NUM_THREADS`` when set, else the
cores this process may use minus the load already on them (at least one).

torch's default (every core) collapses on a busy machine: on 2 cores with the other one loaded, a
256-token forward pass of the demo model took 10x longer with 2 threads than with 1, because each
step waits for the thread that shares its core (``benchmarks/threads.py`` measures it)."""

from __future__ import annotations

import os
import sys


def default_threads() -> int:
    """``OMP_NUM_THREADS`` when set, else usable cores minus the 1-minute load average, at least 1."""
    if os.environ.get("OMP_NUM_THREADS", "").strip().isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        busy = os.getloadavg()[0]
    except OSError:
        busy = 0.0
    return max(1, min(cores, round(cores - busy)))


def use_threads(threads: int | None) -> int:
    """Make torch use ``threads`` (None: :func:`default_threads`), before or after it is imported."""
    n = threads or default_threads()
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(n)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)
    return n
