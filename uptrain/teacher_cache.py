"""Distillation from a cached teacher: one pass of the teacher writes, for the training windows, its
top-K log-probabilities and the log of the remaining mass (the reference cache's top-K form, at the
distillation temperature); the student then trains alone, so memory holds one model at a time.

An entry ``<cache>/<key>/`` is named by the sha256 of what its numbers depend on (the token store,
the teacher's files, window length, K, temperature, dtype, the window order's seed and batch, the
library versions). It holds ``manifest.json`` and, per chunk of ``chunk_steps`` optimizer steps in
training order, one file per teacher process::

    chunk-000003-steps-128-part-0-of-2.safetensors
        values [S, B/P, T, K] float32 (sorted log-probabilities), indices [S, B/P, T, K] int32,
        rest [S, B/P, T] float32; part p holds rows [p*B/P, (p+1)*B/P) of each step's batch, for the
        chunk's first S steps (a run shorter than the chunk computes only the steps it needs; a
        longer run sharing the entry recomputes that chunk whole)

written beside its final name and renamed into place, with the sha256 of its tensor bytes in its
metadata (checked when read: a damaged or tampered chunk is one line naming it). 8K + 4 bytes per
training token. A window the steps read again (a run of more than one epoch) is computed once
(:class:`Seen`, within :data:`REUSE_BYTES`). Chunks are filled in step order, so a teacher pass
(``uptrain --teacher-only``) can run ahead of a training run that reads the same entry: the trainer
waits for a chunk it needs.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mha2gqa.core import typed
from mha2gqa.core.cache import computed_with, entry_name, try_lock
from mha2gqa.core.errors import Mha2GqaError, first_line

SCHEMA = "mha2gqa.teacher/1"
MANIFEST = "manifest.json"
_PART = re.compile(r"^chunk-(\d{6})-steps-(\d+)-part-(\d+)-of-(\d+)\.safetensors$")
#: Training tokens per chunk (a chunk is at least one step).
CHUNK_TOKENS = 1 << 16
FIELDS = ("values", "indices", "rest")
#: The most bytes of top-K forms a teacher pass keeps to give a window it reads again (past them, such
#: a window is computed again): 8K + 4 bytes a token, so 256 MiB hold some 500 windows of 1,024 at K 64.
REUSE_BYTES = 256 << 20


def chunk_steps(batch_size: int, seq_len: int) -> int:
    return max(1, CHUNK_TOKENS // (batch_size * seq_len))


def teacher_key_material(store_key: str, teacher: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """What an entry's numbers depend on."""
    return {"schema": SCHEMA, "tokens": store_key, "teacher": teacher, "settings": settings,
            "versions": computed_with()}  # fmt: skip


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class _EntrySettings:
    """What reading an entry relies on in its manifest's settings (all positive)."""

    top_k: int
    vocab_size: int
    seq_len: int
    batch_size: int
    chunk_steps: int
    temperature: float


@dataclass
class TeacherCache:
    """One entry: its folder and manifest (``settings``: top_k, vocab, seq_len, batch_size, chunk_steps...)."""

    folder: Path
    settings: dict[str, Any]

    @property
    def chunk_steps(self) -> int:
        return self.settings["chunk_steps"]

    def _bad(self, name: str, why: str) -> Mha2GqaError:
        return Mha2GqaError(
            f"teacher cache {self.folder / name}: {why}; remove {self.folder} and run again to rebuild it"
        )

    # -- writing --------------------------------------------------------------------------------------
    def write_part(self, chunk: int, part: int, parts: int, tensors: dict[str, torch.Tensor]) -> None:
        """Publish one process's part of ``chunk`` (written beside its name, then renamed)."""
        from safetensors.torch import save_file

        steps = tensors["values"].shape[0]
        name = f"chunk-{chunk:06d}-steps-{steps}-part-{part}-of-{parts}.safetensors"
        tmp = self.folder / f".{name}.{os.getpid()}.tmp"
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        try:
            save_file(tensors, tmp, metadata={"sha256": _digest(tensors)})
            os.replace(tmp, self.folder / name)
        except Exception as e:
            from mha2gqa.uptrain.checkpoints import out_of_space

            if out_of_space(e, self.folder):  # safetensors says it in its own words (SafetensorError)
                raise OSError(errno.ENOSPC, "No space left on device", str(self.folder / name)) from None
            raise
        finally:
            tmp.unlink(missing_ok=True)

    # -- reading --------------------------------------------------------------------------------------
    def steps_of(self, chunk: int, total: int) -> int:
        """The steps of ``chunk`` a run of ``total`` steps reads."""
        return min(self.chunk_steps, total - chunk * self.chunk_steps)

    def parts_of(self, chunk: int, steps: int) -> list[Path] | None:
        """A complete set of part files of ``chunk`` (one teacher run's) holding at least its first
        ``steps`` steps, or None while there is none."""
        found: dict[tuple[int, int], dict[int, Path]] = {}
        for path in self.folder.glob(f"chunk-{chunk:06d}-*.safetensors"):
            m = _PART.match(path.name)
            if m and int(m.group(2)) >= steps:
                found.setdefault((int(m.group(2)), int(m.group(4))), {})[int(m.group(3))] = path
        for (_, parts), files in sorted(found.items(), reverse=True):
            if len(files) == parts:
                return [files[p] for p in range(parts)]
        return None

    def missing(self, total: int) -> list[int]:
        """The chunks a run of ``total`` steps needs that are not (all) there."""
        chunks = range(-(-total // self.chunk_steps))
        return [c for c in chunks if self.parts_of(c, self.steps_of(c, total)) is None]

    def read_chunk(self, chunk: int, steps: int, wait: Callable[[], bool] | None = None) -> dict[str, torch.Tensor]:
        """``values``/``indices``/``rest`` of the windows of ``chunk``'s first ``steps`` steps (at least)
        as ``[S, B, T, ...]``. While the chunk is incomplete and ``wait()`` says a teacher pass is
        running, wait for it."""
        from safetensors import SafetensorError, safe_open

        parts = self.parts_of(chunk, steps)
        while parts is None:
            running = wait is not None and wait()
            parts = self.parts_of(chunk, steps)  # looked at after asking: a pass that ended in between published it
            if parts is None and not running:
                raise self._bad(f"chunk-{chunk:06d}", "this chunk is missing (the teacher pass stopped before it)")
            if parts is None:
                time.sleep(1.0)
        pieces: dict[str, list[torch.Tensor]] = {k: [] for k in FIELDS}
        s = self.settings
        for path in parts:
            try:
                with safe_open(path, "pt") as f:
                    meta = f.metadata() or {}
                    tensors = {k: f.get_tensor(k) for k in FIELDS}
            except (SafetensorError, OSError, KeyError) as e:
                raise self._bad(path.name, f"not a teacher-cache chunk ({first_line(e, 120)})") from None
            if meta.get("sha256") != _digest(tensors):
                raise self._bad(path.name, "its content changed since it was written")
            v, i, r = (tensors[k] for k in FIELDS)
            shape = (int(_PART.match(path.name).group(2)), v.shape[1], s["seq_len"], s["top_k"])
            ok = (v.dtype, i.dtype, r.dtype) == (torch.float32, torch.int32, torch.float32)
            if not ok or tuple(v.shape) != shape or i.shape != v.shape or tuple(r.shape) != shape[:3]:
                raise self._bad(path.name, "its tensors do not have the shapes and types of this entry")
            if i.numel() and (int(i.min()) < 0 or int(i.max()) >= s["vocab_size"]):
                raise self._bad(path.name, "it holds token indices outside the vocabulary")
            if not (torch.isfinite(v).all() and (v <= 0).all() and not r.isnan().any() and (r <= 0).all()):
                # log-probabilities: finite and at most 0 (the rest -inf only where K is the vocabulary)
                raise self._bad(path.name, "it holds values that are not log-probabilities (NaN, infinite or positive)")
            for k in FIELDS:
                pieces[k].append(tensors[k])
        out = {k: torch.cat(v, 1) for k, v in pieces.items()}
        if out["values"].shape[1] != s["batch_size"]:
            raise self._bad(f"chunk-{chunk:06d}", "its parts do not add up to one batch per step")
        return out

    @classmethod
    def open(cls, folder: Path, key: str) -> TeacherCache:
        path = folder / MANIFEST
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise Mha2GqaError(
                f"teacher cache {path}: not readable ({e}); remove {folder} and run again to rebuild it"
            ) from None
        settings = manifest.get("settings") if isinstance(manifest, dict) else None
        try:
            checked = typed.read(_EntrySettings, settings, "settings")
            ok = all(0 < v < math.inf for v in dataclasses.astuple(checked))
        except typed.RecordError:
            ok = False
        if not ok or manifest.get("schema") != SCHEMA or manifest.get("key") != key:
            raise Mha2GqaError(
                f"teacher cache {path}: not a teacher cache of this entry; remove {folder} and run again"
            )
        return cls(folder, settings)

    @classmethod
    def create(cls, root: Path, material: dict[str, Any], settings: dict[str, Any]) -> TeacherCache:
        """The entry of ``material`` under ``root``: opened, or created with its manifest."""
        key = entry_name(material)
        folder = root / key
        if (folder / MANIFEST).is_file():
            return cls.open(folder, key)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{MANIFEST}.{os.getpid()}.tmp"
            manifest = {"schema": SCHEMA, "key": key, "material": material, "settings": settings}
            tmp.write_text(json.dumps(manifest, indent=1, default=str) + "\n", encoding="utf-8")
            os.replace(tmp, folder / MANIFEST)
        except OSError as e:
            raise Mha2GqaError(f"teacher cache {folder}: cannot write it ({e.strerror or e}); choose another") from None
        return cls.open(folder, key)


@torch.no_grad()
def teacher_part(
    teacher: torch.nn.Module, windows: torch.Tensor, top_k: int, temperature: float, micro: int
) -> dict[str, torch.Tensor]:
    """The top-K form of ``teacher``'s next-token distributions at ``temperature`` on ``windows``
    ``[n, T + 1]`` (inputs ``[:, :-1]``), ``micro`` windows per forward: ``values``/``indices``
    ``[n, T, K]``, ``rest`` ``[n, T]``."""
    from mha2gqa.eval.perplexity import top_k_form

    device = next(teacher.parameters()).device
    out: dict[str, list[torch.Tensor]] = {k: [] for k in FIELDS}
    for start in range(0, windows.shape[0], micro):
        inputs = windows[start : start + micro, :-1].to(device)
        logits = teacher(input_ids=inputs, use_cache=False).logits.float() / temperature
        n, t, v = logits.shape
        form = top_k_form(logits.reshape(n * t, v), inputs.reshape(-1), top_k)
        out["values"].append(form["values"].reshape(n, t, -1).cpu())
        out["indices"].append(form["indices"].reshape(n, t, -1).cpu())
        out["rest"].append(form["rest"].reshape(n, t).cpu())  # -inf when K is the vocabulary: no tail
    return {k: torch.cat(v) for k, v in out.items()}


class CachedTeacher:
    """The trainer's view of an entry: the targets of a step's rows, one chunk read (and verified) at
    a time; ``wait()`` says whether a teacher pass is still filling the entry."""

    def __init__(self, cache: TeacherCache, total: int, wait: Callable[[], bool]) -> None:
        self.cache, self.total, self.wait = cache, total, wait
        self._chunk: tuple[int, dict[str, torch.Tensor]] | None = None

    def targets(self, step: int, rows: slice) -> dict[str, torch.Tensor]:
        """``values``/``indices``/``rest`` of rows ``rows`` of optimizer step ``step`` (0-based)."""
        chunk, within = divmod(step, self.cache.chunk_steps)
        if self._chunk is None or self._chunk[0] != chunk:
            self._chunk = (chunk, self.cache.read_chunk(chunk, self.cache.steps_of(chunk, self.total), self.wait))
        return {k: v[within, rows] for k, v in self._chunk[1].items()}


@dataclass(frozen=True)
class PassShare:
    """This process's share of a teacher pass: ``part`` of the ``parts`` of every chunk, ``micro``
    windows a forward."""

    part: int
    parts: int
    micro: int


@dataclass(frozen=True)
class StepWindows:
    """The windows a teacher pass computes: ``ids(step)``, this process's window indices of 0-based
    optimizer step ``step`` (in row order), and ``tokens(ids)``, their ``[n, T + 1]`` tokens."""

    ids: Callable[[int], list[int]]
    tokens: Callable[[list[int]], torch.Tensor]


class Seen:
    """The top-K forms a pass has computed, by window index, up to ``budget`` bytes: a run of more
    than one epoch reads every window again, and a window's form does not depend on its step."""

    def __init__(self, budget: int = REUSE_BYTES) -> None:
        self.kept: dict[int, dict[str, torch.Tensor]] = {}
        self.budget, self.bytes, self.computed, self.read = budget, 0, 0, 0

    def step(
        self, teacher: torch.nn.Module, ids: list[int], windows: StepWindows, s: dict[str, Any], micro: int
    ) -> dict[str, torch.Tensor]:
        """``values``/``indices``/``rest`` ``[len(ids), T, ...]`` of windows ``ids``, each computed once
        (:func:`teacher_part`, ``micro`` windows a forward) while it fits the budget."""
        new = [i for i in dict.fromkeys(ids) if i not in self.kept]
        fresh: dict[int, dict[str, torch.Tensor]] = {}
        if new:
            form = teacher_part(teacher, windows.tokens(new), s["top_k"], s["temperature"], micro)
            fresh = {i: {k: form[k][n] for k in FIELDS} for n, i in enumerate(new)}
            self.computed += len(new)
        self.read += len(ids)
        for i, one in fresh.items():
            size = sum(t.numel() * t.element_size() for t in one.values())
            if self.bytes + size <= self.budget:  # a copy: a view would hold its whole batch
                self.kept[i], self.bytes = {k: t.clone() for k, t in one.items()}, self.bytes + size
        return {k: torch.stack([(fresh[i] if i in fresh else self.kept[i])[k] for i in ids]) for k in FIELDS}


def fill(
    cache: TeacherCache,
    teacher: torch.nn.Module,
    chunks: list[int],
    total: int,
    windows: StepWindows,
    share: PassShare,
    log: Callable[[str], None],
    progress: bool = False,
) -> None:
    """Compute and publish this process's part of every chunk in ``chunks`` (their steps a run of
    ``total`` steps reads), in order, with a bar over the steps (``progress``); a window the pass read
    at an earlier step is taken from there (:class:`Seen`)."""
    from mha2gqa.core.progress import bar as progress_bar
    from mha2gqa.core.signals import check as check_signals

    part, parts = share.part, share.parts
    s = cache.settings
    started = time.perf_counter()
    tail, tokens, seen = 0.0, 0, Seen()
    count = sum(cache.steps_of(chunk, total) for chunk in chunks)
    bar = progress_bar(total=count, unit="step", desc="teacher pass", disable=not progress)
    for n, chunk in enumerate(chunks):
        check_signals()
        start = chunk * cache.chunk_steps
        done = []
        for step in range(start, start + cache.steps_of(chunk, total)):
            done.append(seen.step(teacher, windows.ids(step), windows, s, share.micro))
            bar.update(1)
        cache.write_part(chunk, part, parts, {k: torch.stack([d[k] for d in done]) for k in FIELDS})
        tail += sum(float(d["rest"].exp().sum()) for d in done)
        tokens += sum(d["rest"].numel() for d in done)
        if n == 0 or (n + 1) % 10 == 0 or n + 1 == len(chunks):
            log(
                f"teacher pass: chunk {n + 1:,}/{len(chunks):,} ({time.perf_counter() - started:.1f} s, "
                f"{seen.computed:,} of {seen.read:,} windows computed; the teacher's mass outside its top "
                f"{s['top_k']}: {tail / max(tokens, 1):.2%} on average)"
            )
    bar.close()


def producer_lock(cache: TeacherCache) -> Callable[[], None] | None:
    """The entry's producer lock, taken without waiting: its release, or None while another process
    (a teacher pass) holds it."""
    return try_lock(cache.folder, "producer", f"teacher cache {cache.folder}")


def producer_running(cache: TeacherCache) -> bool:
    """Whether another process holds the entry's producer lock (a teacher pass is filling it)."""
    release = producer_lock(cache)
    if release is None:
        return True
    release()
    return False
