"""Writing outputs so that nothing half-written ever has the final name: folders are built in a
temporary sibling and renamed into place; single files are written beside and renamed."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mha2gqa.core.errors import Mha2GqaError


def is_within(inner: Path, outer: Path) -> bool:
    """``inner`` is ``outer`` or lies inside it."""
    return inner == outer or outer in inner.parents


@contextlib.contextmanager
def staged_output(dst: Path, overwrite: bool = False, protect: Path | None = None) -> Iterator[Path]:
    """Yield a temporary folder beside ``dst``; rename it to ``dst`` only if the block succeeds.

    An existing non-empty ``dst`` is refused unless ``overwrite``; ``protect`` (the source) may be
    neither ``dst`` nor inside it. On any error the temporary folder is removed.
    """
    dst = Path(os.path.abspath(dst))
    if protect is not None and is_within(Path(protect).resolve(), dst.resolve()):
        raise Mha2GqaError(f"DST {dst} is (or contains) the source model: choose another output folder")
    if dst.exists() and not dst.is_dir():
        raise Mha2GqaError(f"DST {dst} exists and is not a folder: choose another output path")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise Mha2GqaError(f"DST {dst} exists and is not empty: pass --overwrite to replace it")
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the result should look like mkdir's
    except OSError as e:
        raise Mha2GqaError(f"cannot write next to DST {dst}: {e.strerror or e}") from None
    try:
        yield tmp
        if dst.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            os.rename(dst, old / "x")
            os.rename(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text(path: Path, text: str | bytes, what: str = "--output") -> None:
    """Write ``text`` to ``path`` atomically (a temporary sibling renamed into place); ``what``
    names the option in errors."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as e:
        raise Mha2GqaError(f"{what} {path}: cannot write there: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8") if isinstance(text, str) else text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, obj: Any, what: str = "--output") -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    write_text(path, json.dumps(obj, indent=2, allow_nan=True) + "\n", what)
