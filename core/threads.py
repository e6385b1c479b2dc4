"""How many CPU threads torch uses: ``--threads N``, else ``OMP_NUM_THREADS`` when set, else the
cores this process may use minus those other processes keep busy right now (at least one): the busy
time of the cores it may use (its CPU affinity: work pinned to other cores does not compete with it)
is sampled over 0.1 s from ``/proc/stat`` (the 1-minute load average where that file does not exist;
it lags, counting work that just ended).

Chosen that way, the count is reviewed as the run goes (:func:`review`, from the long loops' safe
points): every :data:`REVIEW_EVERY` seconds, the cores other processes kept busy since the last look
(the machine's busy time less this process's own) decide it again. A run that started while something
else was busy for a moment does not spend all of it on one thread (seen: a 2-core conversion on one
thread for 12 minutes after another command ran at its start), and one that others joined later gives
their cores back.

torch's default (every core) collapses on a busy machine: on 2 cores with the other one loaded, a
256-token forward pass of the demo model took 10x longer with 2 threads than with 1, because each
step waits for the thread that shares its core (``benchmarks/threads.py`` measures it)."""

from __future__ import annotations

import os
import sys
import threading
import time

#: seconds between two reviews of a chosen thread count
REVIEW_EVERY = 10.0
#: the thread count chosen from the idle cores and its last look at the machine
#: ``(monotonic time, machine busy s, machine total s, this process's CPU s)``; None: fixed by the user
_chosen: tuple[float, float, float, float] | None = None
_clock = time.monotonic


def usable_cores() -> set[int] | None:
    """The CPUs this process may run on (its affinity), None where the platform does not say."""
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def cpu_times(stat: str, cpus: set[int] | None) -> tuple[int, int]:
    """``(total, idle)`` clock ticks of the CPUs ``cpus`` (None: the whole machine) in ``/proc/stat``'s
    text ``stat``: user to steal (guest time is counted in user already); idle with iowait. Where a
    CPU of ``cpus`` has no line of its own, the whole machine's."""
    rows: dict[str | int, list[int]] = {}
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if name.startswith("cpu"):
            rows["all" if name == "cpu" else int(name[3:])] = [int(x) for x in rest.split()][:8]
    chosen = [rows[c] for c in cpus or ()] if cpus and all(c in rows for c in cpus) else [rows["all"]]
    total = sum(sum(r) for r in chosen)
    idle = sum(r[3] + (r[4] if len(r) > 4 else 0) for r in chosen)
    return total, idle


def _stat(cpus: set[int] | None) -> tuple[int, int]:
    with open("/proc/stat", encoding="ascii") as f:
        return cpu_times(f.read(), cpus)


def busy_cores(seconds: float = 0.1) -> float:
    """How many of the cores this process may use other processes keep busy now (this one is idle
    while it samples)."""
    cpus = usable_cores()
    try:
        total0, idle0 = _stat(cpus)
        time.sleep(seconds)
        total1, idle1 = _stat(cpus)
    except (OSError, ValueError, IndexError, KeyError):
        try:
            return os.getloadavg()[0]
        except OSError:
            return 0.0
    busy = 1 - (idle1 - idle0) / max(total1 - total0, 1)
    return busy * (len(cpus) if cpus else os.cpu_count() or 1)


def default_threads() -> int:
    """``OMP_NUM_THREADS`` when set, else the usable cores not busy with other work, at least 1."""
    if _env_threads():
        return _env_threads()
    cpus = usable_cores()
    cores = len(cpus) if cpus else os.cpu_count() or 1
    return max(1, min(cores, round(cores - busy_cores())))


def _env_threads() -> int | None:
    """``OMP_NUM_THREADS`` when it holds a positive count."""
    held = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(held) if held.isdigit() and int(held) > 0 else None


def use_threads(threads: int | None) -> int:
    """Make torch use ``threads`` (None: :func:`default_threads`, reviewed as the run goes by
    :func:`review`), before or after it is imported."""
    global _chosen
    chosen = not threads and not _env_threads()
    n = threads or default_threads()
    _set(n)
    _chosen = _look() if chosen else None
    return n


def _set(n: int) -> None:
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(n)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)


def _look() -> tuple[float, float, float, float] | None:
    """``(now, the busy and total CPU seconds of the cores this process may use, this process's)``;
    None without ``/proc/stat``."""
    try:
        total, idle = _stat(usable_cores())
    except (OSError, ValueError, IndexError, KeyError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    own = os.times()
    return _clock(), (total - idle) / tick, total / tick, own.user + own.system


def review() -> None:
    """Where the thread count was chosen from the idle cores (not ``--threads`` or ``OMP_NUM_THREADS``),
    at most every :data:`REVIEW_EVERY` seconds: choose it again from the cores other processes kept busy
    since the last look. Main thread only (torch's count belongs to the calling thread)."""
    global _chosen
    if _chosen is None or threading.current_thread() is not threading.main_thread():
        return
    if _clock() - _chosen[0] < REVIEW_EVERY:
        return
    now = _look()
    if now is None:
        return
    busy, total, own = (b - a for a, b in zip(_chosen[1:], now[1:], strict=True))
    _chosen = now
    if total <= 0:
        return
    torch = sys.modules.get("torch")
    if torch is None:
        return
    cpus = usable_cores()
    cores = len(cpus) if cpus else os.cpu_count() or 1
    others = max(0.0, busy - own) / total * cores
    n = toward(torch.get_num_threads(), max(1, min(cores, round(cores - others))))
    if n != torch.get_num_threads():
        _set(n)


def toward(now: int, target: int) -> int:
    """Half the way from ``now`` threads to ``target`` (rounded toward it): two processes that review
    each other's load settle on a share each instead of taking every core in turn."""
    return (now + target + 1) // 2 if target > now else (now + target) // 2
