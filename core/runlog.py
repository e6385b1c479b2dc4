"""The JSON-lines run log (``uptrain_log.jsonl``): one record per line, written by the trainer and
read back by ``--resume`` and the report. Records: ``start``, ``train``, ``eval``, ``resume``, ``end``.

A run killed while writing leaves a torn last line; readers skip it with a warning, so such a run
can still be resumed and reported."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.records import UPTRAIN_LOG


class RunLog:
    """Appends records to the log at ``path`` (only where ``enabled``: the main process).

    ``keep_until_step``: a resumed run keeps the records up to its checkpoint's step and drops the
    rest; ``None`` starts a fresh log."""

    def __init__(self, path: Path, enabled: bool = True, keep_until_step: int | None = None) -> None:
        self.path, self.enabled = Path(path), enabled
        if not enabled:
            return
        if keep_until_step is not None and self.path.is_file():
            kept = [r for r in read_log(self.path) if r.get("step", 0) <= keep_until_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        else:
            self.path.unlink(missing_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")


def read_log(path: Path) -> list[dict[str, Any]]:
    """The records of a run log (or of the one in a run folder). A torn last line (a run killed
    mid-write) is skipped with a warning; damage anywhere else is an error."""
    path = Path(path)
    if path.is_dir():
        path = path / UPTRAIN_LOG
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise Mha2GqaError(f"{path}: cannot read the run log ({e})") from None
    records = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if i == len(lines) - 1:
                warnings.warn(f"{path}: ignoring a torn last line (a run stopped while writing it)", stacklevel=2)
                break
            raise Mha2GqaError(f"{path}: line {i + 1} is not a log record ({e}); the log is damaged") from None
        records.append(record)
    return records
