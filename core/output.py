"""Writing outputs so that nothing is ever lost and nothing half-written has the final name.

One discipline for every command that writes:

- **Check first.** An output may not be (or contain, or lie inside) one of the run's inputs; an
  existing one is refused unless ``overwrite``, and even then only when this tool wrote it
  (:func:`owned`): a folder holding one of our record files, or a file we recognise as ours.
- **Build beside, publish atomically.** Folders are built in a temporary sibling
  ``.<name>.mha2gqa-tmp-<pid>-<random>`` and files written to one; publishing is one
  ``renameat2`` call: ``RENAME_NOREPLACE`` for a new output (a concurrent writer that got there
  first makes this run fail with one line, and nothing of the winner is touched) or
  ``RENAME_EXCHANGE`` to replace (the old output is never missing, not even for an instant).
  Where the OS lacks ``renameat2`` (not Linux, or a filesystem without it), a new folder is claimed
  with ``mkdir`` and renamed onto, and a replacement moves the old one aside to
  ``.<name>.mha2gqa-old-<pid>-<random>`` first: a kill between the two renames leaves the old
  output there, reported as stale by the next run.
- **Clean up on every exit.** Errors, SIGINT, SIGTERM and SIGHUP remove the temporary sibling
  (:mod:`mha2gqa.core.signals`); SIGKILL cannot be caught, so every run looks for siblings left by
  dead processes and reports them (:func:`stale_temporaries`, removed with ``--remove-stale``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

from mha2gqa.core.errors import Mha2GqaError, OutOfSpace, disk_full
from mha2gqa.core.records import OWNED_FILE_MARKERS, OWNED_FOLDER_MARKERS
from mha2gqa.core.signals import check as check_signals

TMP_TAG = "mha2gqa-tmp"
OLD_TAG = "mha2gqa-old"
_AT_FDCWD = -100
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2

__all__ = ["check_destination", "check_overlap", "owned", "publish", "staged_output", "write_json", "write_text"]


def is_within(inner: Path, outer: Path) -> bool:
    """``inner`` is ``outer`` or lies inside it."""
    return inner == outer or outer in inner.parents


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def owned(path: Path) -> bool:
    """Whether ``path`` is something this tool wrote (so ``--overwrite`` may replace it): an empty
    folder, a folder holding one of our record files, or a file that carries our mark."""
    path = Path(path)
    if path.is_dir():
        return not any(path.iterdir()) or any((path / m).exists() for m in OWNED_FOLDER_MARKERS)
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            return False
        return isinstance(data, dict) and str(data.get("schema", "")).startswith("mha2gqa.")
    return any(marker.encode() in head for marker in OWNED_FILE_MARKERS) or _recorded(path)


#: The record beside a file of ours that cannot carry a mark in itself (a text for calibration).
RECORD_SUFFIX = ".mha2gqa.json"


def record_of(path: Path) -> Path:
    """Where the record of the unmarked file ``path`` lies (``<name>.mha2gqa.json`` beside it)."""
    return path.with_name(path.name + RECORD_SUFFIX)


def _recorded(path: Path) -> bool:
    """Whether the record beside ``path`` names this tool and the file's exact bytes (sha256)."""
    from mha2gqa.core.cache import file_sha256

    try:
        record = json.loads(record_of(path).read_text(encoding="utf-8"))
        digest = file_sha256(path)
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    ours = isinstance(record, dict) and str(record.get("schema", "")).startswith("mha2gqa.")
    return ours and record.get("sha256") == digest


Inputs = Mapping[str, "Path | str | None"]


def check_overlap(dst: Path, inputs: Inputs | None, what: str, folder: bool = True) -> Path:
    """Refuse a ``dst`` that is, contains or (a folder) lies inside one of ``inputs``."""
    dst = Path(os.path.abspath(Path(dst).expanduser()))
    real = _real(dst)
    for label, item in (inputs or {}).items():
        if item is None or not Path(item).exists():
            continue
        source = _real(Path(item))
        if is_within(source, real) or (folder and is_within(real, source) and source.is_dir()):
            kind = "is (or contains)" if is_within(source, real) else "lies inside"
            raise Mha2GqaError(f"{what} {dst} {kind} {label} ({item}): choose another output path")
    return dst


def check_destination(
    dst: Path, overwrite: bool, inputs: Inputs | None = None, what: str = "DST", folder: bool = True
) -> Path:
    """Refuse ``dst`` before any work: it overlaps one of the run's ``inputs`` (label -> path, e.g.
    ``{"the source model": folder}``), is of the wrong kind, exists without ``overwrite``, or exists
    and is not ours. Returns the absolute path."""
    dst = check_overlap(dst, inputs, what, folder)
    if dst.is_symlink() and not dst.exists():
        raise Mha2GqaError(f"{what} {dst} is a dangling symbolic link: remove it or choose another output path")
    if dst.is_symlink():  # the output is published by renaming onto the path: that would replace the link
        raise Mha2GqaError(
            f"{what} {dst} is a symbolic link (to {os.path.realpath(dst)}): give the real path, or remove the link"
        )
    if dst.exists():
        if folder and not dst.is_dir():
            raise Mha2GqaError(f"{what} {dst} exists and is not a folder: choose another output path")
        if not folder and dst.is_dir():
            raise Mha2GqaError(f"{what} {dst} is a folder: give a file name")
        empty_dir = dst.is_dir() and not any(dst.iterdir())
        if not empty_dir and not overwrite:
            state = "exists and is not empty" if folder else "exists"
            raise Mha2GqaError(f"{what} {dst} {state}: pass --overwrite to replace it")
        if not empty_dir and not owned(dst):
            raise Mha2GqaError(
                f"{what} {dst} exists and was not written by mha2gqa: --overwrite replaces only "
                "mha2gqa's own outputs; choose another path or remove it yourself"
            )
    return dst


@cache
def _renameat2():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    func = getattr(ctypes.CDLL(name, use_errno=True), "renameat2", None)
    if func is not None:
        func.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return func


def _rename2(src: Path, dst: Path, flags: int) -> bool:
    """``renameat2(src, dst, flags)``; False where the OS or filesystem does not offer it."""
    func = _renameat2()
    if func is None:
        return False
    if func(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def _lost_race(dst: Path, what: str) -> Mha2GqaError:
    return Mha2GqaError(
        f"{what} {dst} was created by another process while this one was writing; it was left as it "
        "is and this run's output discarded"
    )


def _temp_name(dst: Path, tag: str) -> str:
    return f".{dst.name}.{tag}-{os.getpid()}-"


def publish(tmp: Path, dst: Path, overwrite: bool, what: str = "DST") -> None:
    """Move the finished ``tmp`` (folder or file) to ``dst`` atomically (see the module doc)."""
    if not dst.exists() and not dst.is_symlink():
        try:
            if _rename2(tmp, dst, _RENAME_NOREPLACE):
                return
        except FileExistsError:
            raise _lost_race(dst, what) from None
        if tmp.is_dir():  # fallback: claim the name with mkdir, then rename onto the empty folder
            try:
                os.mkdir(dst)
            except FileExistsError:
                raise _lost_race(dst, what) from None
            os.rename(tmp, dst)
        else:
            try:
                os.link(tmp, dst)  # fails if dst exists
            except FileExistsError:
                raise _lost_race(dst, what) from None
            os.unlink(tmp)
        return
    empty_dir = dst.is_dir() and not dst.is_symlink() and not any(dst.iterdir())
    if not overwrite and not empty_dir:
        raise _lost_race(dst, what)
    if not empty_dir and not owned(dst):  # someone put something else there meanwhile
        raise _lost_race(dst, what)
    if _rename2(tmp, dst, _RENAME_EXCHANGE):
        old = tmp  # the previous output now has the temporary name
    elif tmp.is_dir():
        old = Path(tempfile.mkdtemp(prefix=_temp_name(dst, OLD_TAG), dir=dst.parent)) / "x"
        os.rename(dst, old)
        os.rename(tmp, dst)
    else:
        os.replace(tmp, dst)
        return
    _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
        if path.name == "x" and OLD_TAG in path.parent.name:
            shutil.rmtree(path.parent, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


_TEMP = re.compile(rf"^\.(?P<name>.+)\.(?:{TMP_TAG}|{OLD_TAG})-(?P<pid>\d+)-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_temporaries(dst: Path) -> list[Path]:
    """Temporary siblings of ``dst`` left by runs that died (SIGKILL, power loss)."""
    parent = Path(dst).parent
    if not parent.is_dir():
        return []
    found = []
    for entry in parent.iterdir():
        m = _TEMP.match(entry.name)
        if m and m.group("name") == Path(dst).name and not _alive(int(m.group("pid"))):
            found.append(entry)
    return sorted(found)


def handle_stale(dst: Path, remove: bool) -> None:
    """Report (or with ``remove``, delete) what dead runs left beside ``dst``."""
    stale = stale_temporaries(dst)
    if not stale:
        return
    if remove:
        for path in stale:
            _remove(path)
        return
    names = ", ".join(p.name for p in stale[:3]) + (f" and {len(stale) - 3} more" if len(stale) > 3 else "")
    sys.stderr.write(
        f"warning: {len(stale)} temporary output(s) beside {dst} were left by a run that was killed "
        f"({names}); pass --remove-stale to delete them\n"
    )


def _space_error(e: OSError, dst: Path, what: str, need: int | None = None) -> Mha2GqaError | None:
    if not disk_full(e):
        return None
    from mha2gqa.core.units import format_bytes

    needed = f"; it needs {format_bytes(need)}" if need else ""
    return OutOfSpace(f"disk full while writing {what} {dst}{needed}: free space or choose another path")


@contextlib.contextmanager
def staged_output(
    dst: Path, overwrite: bool = False, inputs: Inputs | None = None, what: str = "DST", remove_stale: bool = False
) -> Iterator[Path]:
    """Yield a temporary folder beside ``dst``; publish it as ``dst`` only if the block succeeds.

    ``inputs``: the run's inputs (label -> path), which ``dst`` may neither be, contain nor lie
    inside. On any error or signal the temporary folder is removed and ``dst`` is untouched."""
    dst = check_destination(dst, overwrite, inputs, what)
    handle_stale(dst, remove_stale)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=_temp_name(dst, TMP_TAG), dir=dst.parent))
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the result should look like mkdir's
    except OSError as e:
        raise _space_error(e, dst, what) or Mha2GqaError(
            f"cannot write next to {what} {dst}: {e.strerror or e}"
        ) from None
    try:
        yield tmp
        check_signals()  # a stop asked for during the last step: do not publish
        publish(tmp, dst, overwrite, what)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _space_error(e, dst, what) or e from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def scratch_folder(dst: Path) -> Iterator[Path]:
    """A private working folder beside ``dst`` (named as a staged output, so that a killed run's is
    reported and removed with ``--remove-stale``), removed when the block ends, however it ends."""
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=_temp_name(dst, TMP_TAG), dir=dst.parent))
    except OSError as e:
        raise _space_error(e, dst, "DST") or Mha2GqaError(f"cannot write next to {dst}: {e.strerror or e}") from None
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_text(
    path: Path, text: str | bytes, what: str = "--output", overwrite: bool = True, inputs: Inputs | None = None
) -> Path:
    """Write ``text`` to ``path`` through a temporary sibling published atomically; ``what`` names
    the option in errors. The destination is checked first (:func:`check_destination`)."""
    path = check_destination(path, overwrite, inputs, what, folder=False)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=_temp_name(path, TMP_TAG), dir=path.parent)
    except OSError as e:
        raise _space_error(e, path, what) or Mha2GqaError(
            f"{what} {path}: cannot write there: {e.strerror or e}"
        ) from None
    tmp = Path(name)
    data = text.encode("utf-8") if isinstance(text, str) else text
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())
        publish(tmp, path, overwrite, what)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _space_error(e, path, what, len(data)) or e from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def replace_own_file(path: Path, text: str) -> None:
    """Replace ``path``, a file of this tool's own already checked as such (a run log trimmed on
    ``--resume``), with ``text``: written beside it and renamed into place, so a stop or a full disk
    while writing leaves the old file whole."""
    fd, name = tempfile.mkstemp(prefix=_temp_name(path, TMP_TAG), dir=path.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def as_created(folder: Path) -> None:
    """Give every file directly in ``folder`` the mode a newly created file gets (``0o666`` less the
    umask): writers that publish through a private temporary file (transformers' ``save_pretrained``
    writes ``model.safetensors`` with mode 0600) leave files other users of a shared model cannot read."""
    mode = 0o666 & ~_umask()
    for path in Path(folder).iterdir():
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def write_json(
    path: Path, obj: Any, what: str = "--output", overwrite: bool = True, inputs: Inputs | None = None
) -> Path:
    """Write ``obj`` as indented JSON to ``path`` (as :func:`write_text`)."""
    return write_text(path, json.dumps(obj, indent=2, allow_nan=True) + "\n", what, overwrite, inputs)
