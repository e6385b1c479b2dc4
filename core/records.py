"""Run records: the files mha2gqa writes beside its outputs, timestamps, versions and provenance."""

from __future__ import annotations

import contextlib
import datetime as _dt
import platform
import subprocess
from pathlib import Path
from typing import Any

#: Written by ``convert`` into every converted model (and carried along by ``uptrain``).
CONVERSION_RECORD = "mha2gqa_conversion.json"
#: Written by ``uptrain`` into the final model and every checkpoint.
UPTRAIN_RECORD = "mha2gqa_uptrain.json"
#: The uptraining log (JSON lines) in an ``uptrain --output`` folder.
UPTRAIN_LOG = "uptrain_log.jsonl"
#: Schema tag of ``eval --output`` results.
EVAL_SCHEMA = "mha2gqa.eval/1"
#: Schema tag of ``bench --output`` figures (read back by ``plan --bench``).
BENCH_SCHEMA = "mha2gqa.bench/1"
#: Written by ``run`` / ``demo`` into the folder a job owns.
RUN_RECORD = "mha2gqa_run.json"
#: The demo model's own settings, beside its weights.
DEMO_RECORD = "demo_settings.json"
#: The manifest of an ``eval`` reference cache entry (the original's scores, one model at a time).
REFERENCE_RECORD = "mha2gqa_reference.json"
#: Files whose presence marks a folder as written by mha2gqa (``--overwrite`` may replace it).
OWNED_FOLDER_MARKERS = (CONVERSION_RECORD, UPTRAIN_RECORD, UPTRAIN_LOG, RUN_RECORD, DEMO_RECORD, REFERENCE_RECORD)
#: Marks in the first bytes of the files mha2gqa writes (reports, figures).
FILE_MARK = "<!-- written by mha2gqa -->"
OWNED_FILE_MARKERS = (FILE_MARK, "Software\x00mha2gqa")


def version() -> str:
    """The installed mha2gqa version (``0+unknown`` in a never-installed source tree)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _version

    try:
        return _version("mha2gqa")
    except PackageNotFoundError:
        return "0+unknown"


def now() -> str:
    """UTC timestamp, seconds precision, ISO 8601."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def versions() -> dict[str, str]:
    """Python and the versions of the libraries whose behaviour a result depends on."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _version

    out = {"python": platform.python_version()}
    for pkg in ("mha2gqa", "torch", "transformers", "accelerate", "datasets", "safetensors"):
        with contextlib.suppress(PackageNotFoundError):
            out[pkg] = _version(pkg)
    return out


def git_revision() -> str | None:
    """The commit of the mha2gqa source tree when it is a git checkout."""
    try:
        here = Path(__file__).resolve().parent
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return rev.stdout.strip() or None if rev.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def read_record_json(path: Path, again: str) -> Any | None:
    """The JSON of the record file ``path`` (None where there is none); unreadable, one error naming it
    and what to do (``again``: e.g. "convert the model again")."""
    import json

    from mha2gqa.core.errors import Mha2GqaError

    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Mha2GqaError(f"{path}: not readable JSON ({e}); {again}") from None
