"""Writing sharded safetensors checkpoints tensor by tensor (into a staged folder, see
:func:`mha2gqa.core.output.staged_output`).

Shards are planned up front from the output shapes and dtypes (``huggingface_hub``'s
``split_torch_state_dict_into_shards`` on meta tensors), so each file's header is written first
and its data streamed after it: copied byte ranges never become tensors, computed tensors are
produced one at a time. Memory stays bounded by the largest computed tensor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mha2gqa.core.dtypes import BY_CODE
from mha2gqa.core.errors import OutOfSpace, disk_full
from mha2gqa.core.progress import bar as progress_bar
from mha2gqa.core.safetensors_io import TensorInfo, copy_range
from mha2gqa.core.signals import check as check_signals
from mha2gqa.core.units import format_bytes

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


@dataclass
class OutputTensor:
    """One tensor to write: copied from ``source`` bytes, or computed by calling ``source``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    source: TensorInfo | Callable[[], torch.Tensor]
    copy: bool = False  # the source's tensor unchanged (for records: what a conversion rewrote)

    @property
    def nbytes(self) -> int:
        n = BY_CODE[self.dtype].bytes
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

    meta = {t.name: torch.empty(t.shape, dtype=BY_CODE[t.dtype].torch, device="meta") for t in tensors}
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
    if tuple(value.shape) != t.shape or value.dtype != BY_CODE[t.dtype].torch:
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
    bar = progress_bar(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="writing", disable=not progress)
    try:
        for filename, names in shards.items():
            path = folder / filename
            members = [by_name[n] for n in names]
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, memoryview(_header(members)))
                for t in members:
                    check_signals()
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
        if disk_full(e):
            need = format_bytes(total)
            raise OutOfSpace(
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
