"""SIGINT, SIGTERM and SIGHUP (what Ctrl-C, ``kill``, systemd, Slurm and ``docker stop`` send) stop a
run cleanly: every ``finally`` and staged output cleans up on the way out, exit code 128 + signal.

The stop is cooperative. The handler only records the signal; long loops call :func:`check` at safe
points (after each tensor written, each window scored, each layer calibrated, each training step),
which raises :class:`Terminated` there. Raising from the handler itself could interrupt Python's
import machinery halfway and leave a module lock held, deadlocking a background thread that imports
at the same time (seen here: a SIGTERM during the converter's background check). A second signal
raises at once, for a run stuck where no check is reached.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

from mha2gqa.core.threads import review

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_pending: int | None = None


class Terminated(BaseException):
    """The process was asked to stop by ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        #: What was kept and how to go on, when the command keeps something (default: nothing kept).
        self.kept: str | None = None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def _record(signum: int, frame) -> None:
    global _pending
    if _pending is not None:  # asked twice: stop now
        raise Terminated(signum)
    _pending = signum


def check() -> None:
    """Raise :class:`Terminated` if a stop was asked for (call it at safe points of long loops); there
    too, a thread count chosen from the idle cores is reviewed (:func:`mha2gqa.core.threads.review`)."""
    if _pending is not None:
        raise Terminated(_pending)
    review()


def install() -> Callable[[], None]:
    """Handle SIGINT, SIGTERM and SIGHUP cooperatively (main thread only; elsewhere a no-op) and
    return what puts the previous handlers back. A signal that is ignored (a background job's
    SIGINT, ``nohup``'s SIGHUP) stays ignored."""
    global _pending
    _pending = None
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in HANDLED:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                previous[sig] = signal.signal(sig, _record)

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore
