"""Progress bars (tqdm) that read well where they are written: on a terminal, tqdm's own redrawn
bar; on a file or CI log (stderr not a terminal), a plain line at most every
:data:`PLAIN_SECONDS`, each its own line, so a log holds a few lines a stage instead of hundreds of
redraws. Every bar of the tool comes from :func:`bar`."""

from __future__ import annotations

import sys
from typing import Any, TextIO

#: Seconds between two progress lines when stderr is not a terminal.
PLAIN_SECONDS = 15.0


class _Lines:
    """A stream that turns tqdm's carriage-return redraws into whole lines (blank clears dropped)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


def is_terminal(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default stderr) is a terminal."""
    stream = stream or sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())


def bar(**kwargs: Any):
    """``tqdm.auto.tqdm(**kwargs)``, as plain timed lines when stderr is not a terminal."""
    from tqdm.auto import tqdm

    if not kwargs.get("disable") and not is_terminal():
        kwargs = {"mininterval": PLAIN_SECONDS, "maxinterval": PLAIN_SECONDS * 4, "ascii": True, **kwargs}
        kwargs["file"] = _Lines(sys.stderr)
        kwargs.setdefault("ncols", 100)
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
