"""SIGTERM and SIGHUP (what ``kill``, systemd, Slurm and ``docker stop`` send) stop a run the way
SIGINT does: as an exception, so every ``finally`` and staged output cleans up on the way out."""

from __future__ import annotations

import signal
import threading

HANDLED = (signal.SIGTERM, signal.SIGHUP)


class Terminated(BaseException):
    """The process was asked to stop by ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def _raise(signum: int, frame) -> None:
    raise Terminated(signum)


def install() -> None:
    """Turn SIGTERM and SIGHUP into :class:`Terminated` (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is threading.main_thread():
        for sig in HANDLED:
            signal.signal(sig, _raise)
