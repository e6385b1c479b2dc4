"""Reading safetensors checkpoints lazily: headers, byte ranges and one tensor at a time.

A safetensors file is ``u64 little-endian N | N bytes of JSON header | data``; each header entry
gives ``dtype``, ``shape`` and ``data_offsets`` relative to the data section. Untouched tensors are
copied as byte ranges (they never become tensors); tensors that are transformed are read with
``safetensors.safe_open`` one at a time, so memory stays bounded by the largest tensor.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mha2gqa.core.dtypes import BY_CODE
from mha2gqa.core.errors import Mha2GqaError

_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: ``file`` and absolute byte range ``[start, end)`` inside it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int | None  # None: not byte-addressable (a pickle checkpoint)
    end: int | None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * BY_CODE[self.dtype].bytes


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate one file's header without touching its data.

    Returns ``(tensors, metadata)``. Raises :class:`Mha2GqaError` for a truncated or corrupt file.
    """
    path = Path(path)
    size = path.stat().st_size
    hint = "the file is corrupt or truncated (re-download it)"
    if size < 8:
        raise Mha2GqaError(f"{path}: not a safetensors file ({size} bytes); {hint}")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > min(_MAX_HEADER, size - 8):
            raise Mha2GqaError(f"{path}: header length {n} does not fit in {size} bytes; {hint}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Mha2GqaError(f"{path}: header is not valid JSON ({e}); {hint}") from None
    if not isinstance(header, dict):
        raise Mha2GqaError(f"{path}: header is not a JSON object; {hint}")
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + n
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype, shape, (lo, hi) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise Mha2GqaError(f"{path}: malformed header entry for {name!r}; {hint}") from None
        if not all(_natural(x) for x in (lo, hi, *shape)):
            raise Mha2GqaError(
                f"{path}: tensor {name!r} has a shape or data_offsets that are not non-negative "
                f"integers ({list(shape)}, {[lo, hi]}); {hint}"
            )
        if not isinstance(dtype, str) or dtype not in BY_CODE:
            raise Mha2GqaError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        if hi - lo != math.prod(shape) * BY_CODE[dtype].bytes or lo < 0:
            raise Mha2GqaError(f"{path}: tensor {name!r} byte range does not match its shape; {hint}")
        tensors[name] = TensorInfo(name, dtype, shape, path, base + lo, base + hi)
    spans = sorted((t.start, t.end) for t in tensors.values())
    pos = base
    for lo, hi in spans:  # safetensors requires the data to be contiguous, in header order or not
        if lo != pos:
            raise Mha2GqaError(f"{path}: tensor data is not contiguous at byte {pos}; {hint}")
        pos = hi
    if pos > size:
        raise Mha2GqaError(f"{path}: data ends at byte {pos} but the file has {size} bytes (truncated); {hint}")
    if pos < size:
        raise Mha2GqaError(f"{path}: {size - pos} unexpected bytes after the data; {hint}")
    return tensors, metadata


def _natural(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def load_tensor(info: TensorInfo) -> Any:
    """Read one tensor (``torch.Tensor``) with ``safe_open`` (the handle is closed again straight away)."""
    from safetensors import safe_open

    try:
        with safe_open(str(info.file), framework="pt") as f:
            return f.get_tensor(info.name)
    except Exception as e:  # safetensors raises its own error types
        raise Mha2GqaError(f"{info.file}: cannot read tensor {info.name!r}: {e}") from None


def copy_range(src: Path, start: int, length: int, dst_fd: int, chunk: int = 64 << 20) -> None:
    """Append ``length`` bytes of ``src`` from ``start`` to the open ``dst_fd``, in the kernel where
    possible (``copy_file_range``), else through a bounded buffer."""
    with open(src, "rb") as f:
        fd = f.fileno()
        done = 0
        if hasattr(os, "copy_file_range"):
            try:
                while done < length:
                    n = os.copy_file_range(fd, dst_fd, min(chunk, length - done), start + done)
                    if n == 0:
                        raise Mha2GqaError(f"{src}: unexpected end of file (truncated?)")
                    done += n
                return
            except OSError as e:
                import errno

                if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
        while done < length:
            buf = os.pread(fd, min(chunk, length - done), start + done)
            if not buf:
                raise Mha2GqaError(f"{src}: unexpected end of file (truncated?)")
            view = memoryview(buf)
            while view:
                view = view[os.write(dst_fd, view) :]
            done += len(buf)


def read_shard_index(files: Iterable[Path]) -> dict[str, TensorInfo]:
    """Headers of several shards merged into one name -> :class:`TensorInfo` map."""
    out: dict[str, TensorInfo] = {}
    for path in files:
        tensors, _ = read_header(path)
        for name, info in tensors.items():
            if name in out:
                raise Mha2GqaError(f"tensor {name!r} appears in both {out[name].file} and {path}")
            out[name] = info
    return out
