"""Progress bars (tqdm) that read well where they are written: on a terminal, tqdm's own redrawn
bar; on a file or CI log (stderr not a terminal), a plain line at most every
:data:`PLAIN_SECONDS`, each its own line, so a log holds a few lines a stage instead of hundreds of
redraws. Inside :func:`lines_to` (a job, whose output is its log) the bars write those plain lines
to that log instead, so no stage a job runs is silent for long. Every bar of the tool comes from
:func:`bar`."""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, TextIO

#: Seconds between two progress lines when stderr is not a terminal.
PLAIN_SECONDS = 15.0


#: terminal cursor moves (``ESC [ n A``...) tqdm writes for nested bars: meaningless in a log
_CURSOR = re.compile(r"\x1b\[\d*[A-Za-z]")


class _Lines:
    """A stream that turns tqdm's carriage-return redraws into whole lines (blank clears dropped)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        line = _CURSOR.sub("", text.replace("\r", "")).rstrip()  # (tqdm moves the cursor for nested bars)
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


class _Log:
    """A stream whose every line goes to a log function."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log = log

    def write(self, text: str) -> None:
        self.log(text.rstrip("\n"))

    def flush(self) -> None:
        pass


#: Where the bars write while a job runs (:func:`lines_to`); None: stderr.
_SINK: ContextVar[Callable[[str], None] | None] = ContextVar("mha2gqa_progress_sink", default=None)


@contextlib.contextmanager
def lines_to(log: Callable[[str], None]) -> Iterator[None]:
    """Every bar made inside the block writes plain lines to ``log`` instead of stderr: none for a bar
    done within :data:`PLAIN_SECONDS`, else one at most every :data:`PLAIN_SECONDS` and its last."""
    token = _SINK.set(log)
    try:
        yield
    finally:
        _SINK.reset(token)


def sink() -> Callable[[str], None] | None:
    """The log the bars write to (inside :func:`lines_to`), else None."""
    return _SINK.get()


def is_terminal(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default stderr) is a terminal."""
    stream = stream or sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())


def bar(**kwargs: Any):
    """``tqdm.auto.tqdm(**kwargs)``, as plain timed lines when stderr is not a terminal."""
    from tqdm.auto import tqdm

    sink = _SINK.get()
    if not kwargs.get("disable") and (sink is not None or not is_terminal()):
        kwargs = {"mininterval": PLAIN_SECONDS, "maxinterval": PLAIN_SECONDS * 4, "ascii": True, **kwargs}
        kwargs["file"] = _Lines(sys.stderr if sink is None else _Log(sink))
        kwargs.setdefault("ncols", 100)
        if sink is not None:  # a job's log: a stage done within PLAIN_SECONDS says nothing more than its line
            kwargs.setdefault("delay", PLAIN_SECONDS)
    return tqdm(**kwargs)


def quiet_library_bars() -> None:
    """huggingface_hub's and transformers' own bars (downloads, loading weights) off when stderr is
    not a terminal, where they are only redraws (transformers reads the hub's switch when it loads;
    nothing heavy is imported here)."""
    if is_terminal():
        return
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
