"""mha2gqa's own caches on disk: where they live, and the lock that lets concurrent runs build an
entry once (the demo model, the original's reference scores, token shards, teacher outputs)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mha2gqa.core.errors import Mha2GqaError

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".json")


def cache_root() -> Path:
    """``$MHA2GQA_CACHE``, else ``$XDG_CACHE_HOME/mha2gqa``, else ``~/.cache/mha2gqa``."""
    if os.environ.get("MHA2GQA_CACHE"):
        return Path(os.environ["MHA2GQA_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mha2gqa"


def _lock_file(root: Path, key: str, what: str):
    """The open lock file of entry ``key`` under ``root`` (``.<key>.lock``)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        return open(root / f".{key}.lock", "a+")
    except OSError as e:
        raise Mha2GqaError(f"{what}: cannot create its lock ({e.strerror or e}); choose a writable folder") from None


@contextmanager
def locked(
    root: Path, key: str, what: str, waiting: str | None = None, log: Callable[[str], None] | None = None
) -> Iterator[None]:
    """Hold the lock of entry ``key`` under ``root`` (``.<key>.lock`` beside it): runs sharing a cache
    build an entry once; the others wait here (``log`` hears ``waiting`` first), then find it. ``what``
    names the cache in errors (``--reference-cache DIR``). No-op where ``fcntl`` is missing (two
    builders: the second is refused when it publishes)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with _lock_file(root, key, what) as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if log and waiting:
                log(waiting)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def try_lock(root: Path, key: str, what: str) -> Callable[[], None] | None:
    """The lock of entry ``key`` under ``root`` (the file :func:`locked` uses), taken without waiting:
    the function that releases it, or None while another process holds it. Where ``fcntl`` is
    missing, always taken."""
    try:
        import fcntl
    except ImportError:
        return lambda: None
    handle = _lock_file(root, key, what)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None

    def release() -> None:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()

    return release


def model_identity(path: str, folder: Path) -> dict[str, Any]:
    """What identifies a model's weights in a cache key without reading them: its path, and every
    weight and config file's name, size and modification time."""
    files = sorted(f for f in folder.iterdir() if f.is_file() and f.suffix in _WEIGHT_SUFFIXES)
    return {
        "path": path,
        "folder": str(folder),
        "files": [[f.name, (st := f.stat()).st_size, st.st_mtime_ns] for f in files],
    }


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read 16 MiB at a time (a cache key's part for a file)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def entry_name(material: dict[str, Any]) -> str:
    """A cache entry's folder name: 24 hex digits of the sha256 of ``material`` (JSON-able: what its
    content depends on)."""
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:24]


def computed_with() -> dict[str, str | None]:
    """The library versions a cached result's numbers depend on (part of every key)."""
    from mha2gqa.core.records import versions

    lib = versions()
    return {k: lib.get(k) for k in ("mha2gqa", "torch", "transformers")}
