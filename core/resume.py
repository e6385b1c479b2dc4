"""What a stopped conversion keeps so that ``--resume`` continues it: a folder beside DST,
``.DST.mha2gqa-resume/``, holding the run's fingerprint and each finished unit of work (a refitted
layer's tensors and its record; with ``--distill``, the distillation's run folder, its checkpoints
and the teacher's cache), each file written beside its final name and renamed into place.

The staged output itself stays atomic (removed on any failure); this folder is what survives a
kill, a pre-empted node or an out-of-memory stop. It is removed once DST is published. A run whose
fingerprint (the source's files, the calibration text, the recipe, the mha2gqa version) differs
from the stopped one's refuses to resume, in one line naming what changed; a run without
``--resume`` refuses to start over while the folder holds finished work (``--remove-stale``
deletes it).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mha2gqa.core.errors import Mha2GqaError, OutOfSpace

RESUME_TAG = "mha2gqa-resume"


class ResumeDamaged(Mha2GqaError):
    """Kept work that cannot be used as it is (damaged, edited, or of another run): the folder stays
    for the user to look at, and ``--remove-stale`` starts over."""


FINGERPRINT = "fingerprint.json"


def resume_folder(dst: Path) -> Path:
    """Where the run converting into ``dst`` keeps its finished work."""
    return dst.parent / f".{dst.name}.{RESUME_TAG}"


class ResumeFolder:
    """The finished work of one conversion (see the module doc)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    @classmethod
    def check(
        cls, dst: Path, fingerprint: dict[str, Any], resume: bool, remove_stale: bool, later: tuple[str, ...] = ()
    ) -> None:
        """Before any work: refuse a resume whose fingerprint differs, and a fresh run that would
        drop a stopped run's finished work unasked (what :meth:`open` would refuse, without writing).
        ``later``: keys the run learns only as it works (the text the model writes), which :meth:`open`
        compares then."""
        folder = resume_folder(Path(dst))
        if not folder.exists():
            return
        if resume:
            cls._check_same(folder, fingerprint, later)
        elif not remove_stale and _work(folder):
            raise _unasked(folder, dst)

    @classmethod
    def open(cls, dst: Path, fingerprint: dict[str, Any], resume: bool, remove_stale: bool) -> ResumeFolder:
        """The folder for the run into ``dst``: the stopped run's, when ``resume`` and the
        fingerprints agree; a fresh one otherwise (refusing to drop finished work unasked)."""
        folder = resume_folder(Path(dst))
        if folder.exists():
            if resume:
                cls._check_same(folder, fingerprint)
                return cls(folder)
            if not remove_stale and _work(folder):
                raise _unasked(folder, dst)
            shutil.rmtree(folder)
        try:
            folder.mkdir(parents=True)
            _write_atomic(folder / FINGERPRINT, json.dumps(fingerprint, indent=1, sort_keys=True).encode())
        except OSError as e:
            raise Mha2GqaError(f"cannot keep resumable work beside {dst} ({folder}): {e.strerror or e}") from None
        return cls(folder)

    @staticmethod
    def _check_same(folder: Path, fingerprint: dict[str, Any], later: tuple[str, ...] = ()) -> None:
        path = folder / FINGERPRINT
        try:
            held = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ResumeDamaged(f"{path}: not readable ({e}); pass --remove-stale to start over") from None
        if not isinstance(held, dict):
            raise ResumeDamaged(f"{path}: not a fingerprint; pass --remove-stale to start over")
        for key in sorted((set(held) | set(fingerprint)) - set(later)):
            if held.get(key) != fingerprint.get(key):
                raise Mha2GqaError(
                    f"--resume: the {key} changed since the stopped run ({_short(held.get(key))} -> "
                    f"{_short(fingerprint.get(key))}); run without --resume and with --remove-stale to start over"
                )

    @staticmethod
    def discard(dst: Path) -> None:
        """``dst`` is published by a run that keeps no work: a stopped run's folder beside it (which
        :meth:`check` let through: empty, or ``--remove-stale``) is stale, and goes with it."""
        shutil.rmtree(resume_folder(Path(dst)), ignore_errors=True)

    def path(self, name: str) -> Path:
        return self.folder / name

    def has(self, name: str) -> bool:
        return (self.folder / name).is_file()

    def write_bytes(self, name: str, data: bytes) -> Path:
        """Write ``name`` atomically (a unit of work is whole or absent); returns its path."""
        path = self.folder / name
        _write_atomic(path, data)
        return path

    def read_json(self, name: str) -> Any:
        path = self.folder / name
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ResumeDamaged(f"{path}: not readable ({e}); pass --remove-stale to start over") from None

    def finish(self) -> None:
        """The output is published: the finished work is no longer needed."""
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def resumable(resume: ResumeFolder | None) -> Iterator[None]:
    """Keep ``resume``'s finished work only where the run was interrupted (a signal, a kill, the
    system's errors): it goes once the output is published, and where the run stopped on a decision
    of its own (an error said in one line, ``--guard fail``), after which no resume would help; a full
    disk is the machine's state, not a decision: the finished work stays (if any), and the message says where."""
    if resume is None:
        yield
        return
    from mha2gqa.core.signals import Terminated

    try:
        yield
    except ResumeDamaged:  # the user's to look at; --remove-stale starts over
        raise
    except OutOfSpace as e:
        if not _work(resume.folder):  # nothing finished yet: nothing to keep
            resume.finish()
            raise
        raise OutOfSpace(
            f"{e}; the finished work is kept in {resume.folder}: free space, then the same command with --resume"
        ) from None
    except Mha2GqaError:
        resume.finish()
        raise
    except Terminated as e:
        e.kept = f"the finished work is kept in {resume.folder}: the same command with --resume continues"
        raise
    resume.finish()


def _work(folder: Path) -> list[str]:
    """The finished work in ``folder`` (its files but the fingerprint and half-written ones)."""
    return sorted(p.name for p in folder.iterdir() if p.name != FINGERPRINT and not p.name.startswith("."))


def _unasked(folder: Path, dst: Path) -> Mha2GqaError:
    return Mha2GqaError(
        f"{folder} holds {len(_work(folder))} file(s) of finished work of a stopped conversion into {dst}: pass "
        "--resume to continue it, or --remove-stale to start over"
    )


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _short(value: Any) -> str:
    if value is None:  # a key the other run's version did not record
        return "not recorded"
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."
