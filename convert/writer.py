"""Writing sharded safetensors checkpoints tensor by tensor, into a folder renamed into place.

Shards are planned up front from the output shapes and dtypes (``huggingface_hub``'s
``split_torch_state_dict_into_shards`` on meta tensors), so each file's header is written first
and its data streamed after it: copied byte ranges never become tensors, computed tensors are
produced one at a time. Memory stays bounded by the largest computed tensor.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mha2gqa.convert.safetensors_io import DTYPES, TensorInfo, copy_range
from mha2gqa.errors import Mha2GqaError

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


@dataclass
class OutputTensor:
    """One tensor to write: copied from ``source`` bytes, or computed by calling ``source``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    source: TensorInfo | Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype][1]
        for s in self.shape:
            n *= s
        return n


@dataclass
class WrittenCheckpoint:
    files: list[str]
    total_size: int
    weight_map: dict[str, str]


def plan_shards(tensors: list[OutputTensor], max_shard_size: int | str) -> dict[str, list[str]]:
    """File name -> tensor names, in HF's ``model-0000i-of-0000N.safetensors`` scheme."""
    from huggingface_hub import split_torch_state_dict_into_shards

    meta = {t.name: torch.empty(t.shape, dtype=DTYPES[t.dtype][0], device="meta") for t in tensors}
    split = split_torch_state_dict_into_shards(
        meta, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    return split.filename_to_tensors


def _header(tensors: list[OutputTensor]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned, as safetensors does
    return len(raw).to_bytes(8, "little") + raw


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


def _write_tensor(fd: int, t: OutputTensor) -> None:
    if isinstance(t.source, TensorInfo):
        copy_range(t.source.file, t.source.start, t.nbytes, fd)
        return
    value = t.source()
    if tuple(value.shape) != t.shape or value.dtype != DTYPES[t.dtype][0]:
        raise RuntimeError(
            f"internal error: {t.name} computed as {value.dtype}{tuple(value.shape)}, planned {t.dtype}{t.shape}"
        )
    raw = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    _write_all(fd, memoryview(raw))


def write_checkpoint(
    folder: Path,
    tensors: list[OutputTensor],
    max_shard_size: int | str,
    progress: bool = True,
    fsync: bool = False,
    after_each: Callable[[], None] | None = None,
) -> WrittenCheckpoint:
    """Write ``tensors`` as safetensors shards (plus an index when sharded) into ``folder``.

    ``fsync`` flushes each shard to disk before the next (durable against power loss, slower);
    ``after_each`` runs after every tensor (it may raise to abort the write).
    """
    shards = plan_shards(tensors, max_shard_size)
    by_name = {t.name: t for t in tensors}
    total = sum(t.nbytes for t in tensors)
    weight_map: dict[str, str] = {}
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="writing", disable=not progress)
    try:
        for filename, names in shards.items():
            path = folder / filename
            members = [by_name[n] for n in names]
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, memoryview(_header(members)))
                for t in members:
                    _write_tensor(fd, t)
                    weight_map[t.name] = filename
                    bar.update(t.nbytes)
                    if after_each is not None:
                        after_each()
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            need = tqdm.format_sizeof(total, "B", 1024)
            raise Mha2GqaError(
                f"disk full while writing {folder.parent}: the output needs {need}; free space or choose another DST"
            ) from None
        raise
    finally:
        bar.close()
    files = list(shards)
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return WrittenCheckpoint(files, total, weight_map)


def _is_within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


@contextlib.contextmanager
def staged_output(dst: Path, overwrite: bool = False, protect: Path | None = None) -> Iterator[Path]:
    """Yield a temporary folder beside ``dst``; rename it to ``dst`` only if the block succeeds.

    An existing non-empty ``dst`` is refused unless ``overwrite``; ``protect`` (the source) may be
    neither ``dst`` nor inside it. On any error the temporary folder is removed.
    """
    dst = Path(os.path.abspath(dst))
    if protect is not None and _is_within(Path(protect).resolve(), dst.resolve()):
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
