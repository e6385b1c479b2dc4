"""The streaming MHA -> GQA conversion: plan every output tensor, then write them one at a time."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from mha2gqa.convert.card import RECORD_NAME, model_card
from mha2gqa.convert.checkpoint import AUX_FILES, Checkpoint, open_checkpoint
from mha2gqa.convert.families import AttentionDims, Family, detect_family
from mha2gqa.convert.pooling import METHODS, Reducer, reduce_rows, reduce_stacked, split_fused_qkv
from mha2gqa.convert.safetensors_io import DTYPES, TensorInfo
from mha2gqa.convert.validate import check_tensors, expected_tensors
from mha2gqa.convert.writer import OutputTensor, staged_output, write_checkpoint
from mha2gqa.errors import Mha2GqaError


@dataclass
class ConversionResult:
    """What :func:`convert_checkpoint` wrote."""

    output: Path
    family: str
    method: str
    num_layers: int
    num_heads: int
    num_kv_heads_before: int
    num_kv_heads_after: int
    head_dim: int
    kv_cache_bytes_per_token_before: int
    kv_cache_bytes_per_token_after: int
    kv_cache_dtype: str
    files: list[str]
    total_size: int
    seconds: float
    record: dict[str, Any] = field(repr=False)

    def summary(self) -> str:
        """One line for the terminal."""
        return (
            f"{self.family}: KV heads {self.num_kv_heads_before} -> {self.num_kv_heads_after} "
            f"({self.num_heads} query heads, {self.num_layers} layers, method {self.method}); "
            f"KV cache {self.kv_cache_bytes_per_token_before:,} -> {self.kv_cache_bytes_per_token_after:,} "
            f"bytes/token ({self.kv_cache_dtype}); wrote {self.total_size / 2**20:,.1f} MiB in "
            f"{len(self.files)} shard(s) to {self.output} in {self.seconds:.1f} s"
        )


def check_num_kv_heads(dims: AttentionDims, num_kv_heads: int) -> None:
    """``num_kv_heads`` must divide the current KV-head count and not exceed it."""
    cur = dims.num_kv_heads
    if num_kv_heads < 1 or num_kv_heads > cur or cur % num_kv_heads:
        valid = ", ".join(str(g) for g in range(1, cur + 1) if cur % g == 0)
        raise Mha2GqaError(
            f"--num-kv-heads {num_kv_heads} is not valid for a model with {cur} KV heads: "
            f"choose a divisor of {cur} ({valid})"
        )


def query_heads_per_kv_head(num_heads: int, num_kv_heads: int) -> list[list[int]]:
    """transformers' ``repeat_kv`` grouping: KV head ``j`` serves query heads ``[j*r, (j+1)*r)``."""
    r = num_heads // num_kv_heads
    return [list(range(j * r, (j + 1) * r)) for j in range(num_kv_heads)]


def _pooled(ckpt: Checkpoint, name: str, groups: int, head_dim: int, reducer: Reducer) -> torch.Tensor:
    return reduce_rows(ckpt.load(name), groups, head_dim, reducer)


def _pooled_fused(ckpt: Checkpoint, name: str, dims: AttentionDims, groups: int, reducer: Reducer) -> torch.Tensor:
    q, k, v = split_fused_qkv(ckpt.load(name), dims.num_heads, dims.num_kv_heads, dims.head_dim)
    return torch.cat(
        [q, reduce_rows(k, groups, dims.head_dim, reducer), reduce_rows(v, groups, dims.head_dim, reducer)]
    )


def _pooled_indexed(ckpt: Checkpoint, names: list[str], head: int, groups: int, reducer: Reducer) -> torch.Tensor:
    per = len(names) // groups
    members = names[head * per : (head + 1) * per]
    return reduce_stacked([ckpt.load(n) for n in members], 1, reducer)[0]


def plan_conversion(
    ckpt: Checkpoint, family: Family, dims: AttentionDims, num_kv_heads: int, method: str
) -> list[OutputTensor]:
    """Every output tensor, in source storage order: byte copies except the K/V heads.

    Tensor shapes (head_dim * KV heads rows) are checked here, so a wrong config fails before
    anything is written.
    """
    reducer = METHODS[method]
    g, d = num_kv_heads, dims.head_dim
    rules: dict[str, OutputTensor] = {}
    dropped: set[str] = set()

    def need(name: str, rows: int) -> TensorInfo:
        info = ckpt.tensors[name]
        if info.shape[0] != rows:
            raise Mha2GqaError(
                f"{name} has {info.shape[0]} rows, but the config implies {rows} "
                f"({dims.num_kv_heads} KV heads x head_dim {d} in the K/V part); check head_dim in config.json"
            )
        return info

    layers = range(dims.num_layers) if g != dims.num_kv_heads else range(0)  # G = current: exact copy
    for layer in layers:
        fill = partial(str.format, layer=layer)
        if family.fused:
            for suffix in (".weight", ".bias"):
                name = fill(family.qkv_proj) + suffix
                if name in ckpt.tensors:
                    info = need(name, (dims.num_heads + 2 * dims.num_kv_heads) * d)
                    shape = ((dims.num_heads + 2 * g) * d, *info.shape[1:])
                    rules[name] = OutputTensor(
                        name, info.dtype, shape, partial(_pooled_fused, ckpt, name, dims, g, reducer)
                    )
        else:
            for module in (family.k_proj, family.v_proj):
                for suffix in (".weight", ".bias"):
                    name = fill(module) + suffix
                    if name in ckpt.tensors:
                        info = need(name, dims.num_kv_heads * d)
                        rules[name] = OutputTensor(
                            name, info.dtype, (g * d, *info.shape[1:]), partial(_pooled, ckpt, name, g, d, reducer)
                        )
        norm = family.k_norm
        if norm is not None and norm.layout == "rows":
            name = fill(norm.name)
            if name in ckpt.tensors:
                info = need(name, dims.num_kv_heads * d)
                rules[name] = OutputTensor(name, info.dtype, (g * d,), partial(_pooled, ckpt, name, g, d, reducer))
        elif norm is not None and norm.layout == "indexed":
            names = [norm.name.format(layer=layer, head=h) for h in range(dims.num_kv_heads)]
            if all(n in ckpt.tensors for n in names):
                dropped.update(names[g:])
                for h in range(g):
                    info = ckpt.tensors[names[h]]
                    rules[names[h]] = OutputTensor(
                        names[h], info.dtype, info.shape, partial(_pooled_indexed, ckpt, names, h, g, reducer)
                    )
    out: list[OutputTensor] = []
    for info in sorted(ckpt.tensors.values(), key=lambda t: (str(t.file), t.start or 0, t.name)):
        if info.name in dropped:
            continue
        if info.name in rules:
            out.append(rules[info.name])
        elif ckpt.format == "safetensors":
            out.append(OutputTensor(info.name, info.dtype, info.shape, info))
        else:
            out.append(OutputTensor(info.name, info.dtype, info.shape, partial(ckpt.load, info.name)))
    return out


def _kv_dtype(ckpt: Checkpoint, family: Family) -> str:
    name = (family.qkv_proj or family.k_proj).format(layer=0) + ".weight"
    info = ckpt.tensors.get(name)
    return info.dtype if info else "F32"


def _source_record(ckpt: Checkpoint) -> dict[str, Any]:
    files = []
    for path in ckpt.files:
        entry: dict[str, Any] = {"name": path.name, "size": path.stat().st_size}
        if ckpt.format == "safetensors":
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                entry["header_sha256"] = hashlib.sha256(f.read(n)).hexdigest()
        files.append(entry)
    return {
        "path": str(ckpt.folder),
        "repo_id": ckpt.repo_id,
        "revision": ckpt.revision,
        "config_sha256": hashlib.sha256((ckpt.folder / "config.json").read_bytes()).hexdigest(),
        "format": ckpt.format,
        "files": files,
    }


class _Checks:
    """Validate source and planned output against transformers' own model classes (built on the
    meta device) in a background thread, so the ~2 s of importing transformers overlaps the
    first copies. ``poll`` raises as soon as a check fails; ``wait`` blocks until both ran."""

    def __init__(self, ckpt: Checkpoint, tensors: list[OutputTensor], new_config: dict[str, Any]) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mha2gqa-check")
        self._done = False
        source = {name: info.shape for name, info in ckpt.tensors.items()}
        output = {t.name: t.shape for t in tensors}
        self._future = self._pool.submit(self._run, source, ckpt.config, str(ckpt.folder), output, new_config)

    @staticmethod
    def _run(source: dict, config: dict, what: str, output: dict, new_config: dict) -> None:
        check_tensors(source, expected_tensors(config), what)
        check_tensors(output, expected_tensors(new_config), "converted model (internal error)")

    def poll(self) -> None:
        if not self._done and self._future.done():
            self.wait()

    def wait(self) -> None:
        self._future.result()
        self._done = True

    def __enter__(self) -> _Checks:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    num_kv_heads: int,
    method: str = "mean",
    *,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    allow_pickle: bool = False,
    revision: str | None = None,
    progress: bool = True,
    fsync: bool = False,
) -> ConversionResult:
    """Convert the checkpoint at ``src`` (folder or hub id) to ``num_kv_heads`` KV heads in ``dst``.

    Streams tensor by tensor: peak memory is about one K/V projection, whatever the model size.
    Raises :class:`~mha2gqa.errors.Mha2GqaError` for bad input; nothing is left at ``dst`` then.
    """
    start = time.perf_counter()
    if method not in METHODS:
        raise Mha2GqaError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
    ckpt = open_checkpoint(str(src), revision=revision, allow_pickle=allow_pickle)
    family = detect_family(ckpt.config)
    dims = AttentionDims.from_config(ckpt.config)
    check_num_kv_heads(dims, num_kv_heads)
    tensors = plan_conversion(ckpt, family, dims, num_kv_heads, method)
    new_config = dict(ckpt.config)
    new_config["num_key_value_heads"] = num_kv_heads
    checks = _Checks(ckpt, tensors, new_config)

    kv_dtype = _kv_dtype(ckpt, family)
    esize = DTYPES[kv_dtype][1]
    conversion = {
        "method": method,
        "num_layers": dims.num_layers,
        "num_heads": dims.num_heads,
        "num_kv_heads_before": dims.num_kv_heads,
        "num_kv_heads_after": num_kv_heads,
        "head_dim": dims.head_dim,
        "query_heads_per_kv_head": query_heads_per_kv_head(dims.num_heads, num_kv_heads),
        "source_kv_heads_per_kv_head": query_heads_per_kv_head(dims.num_kv_heads, num_kv_heads),
        "kv_cache_dtype": kv_dtype,
        "kv_cache_bytes_per_token_before": dims.kv_cache_bytes_per_token(dims.num_kv_heads, esize),
        "kv_cache_bytes_per_token_after": dims.kv_cache_bytes_per_token(num_kv_heads, esize),
    }
    from mha2gqa import __version__

    record: dict[str, Any] = {
        "mha2gqa_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "family": family.family,
        "source": _source_record(ckpt),
        "conversion": conversion,
    }
    dst = Path(dst)
    with checks, staged_output(dst, overwrite=overwrite, protect=ckpt.folder) as tmp:
        written = write_checkpoint(tmp, tensors, max_shard_size, progress=progress, fsync=fsync, after_each=checks.poll)
        checks.wait()
        (tmp / "config.json").write_text(json.dumps(new_config, indent=2) + "\n", encoding="utf-8")
        for name in AUX_FILES:
            if (ckpt.folder / name).is_file():
                shutil.copyfile(ckpt.folder / name, tmp / name)
        record["output"] = {"files": written.files, "total_size": written.total_size}
        (tmp / RECORD_NAME).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        (tmp / "README.md").write_text(model_card(record), encoding="utf-8")
    return ConversionResult(
        output=dst.absolute(),
        family=family.family,
        method=method,
        num_layers=dims.num_layers,
        num_heads=dims.num_heads,
        num_kv_heads_before=dims.num_kv_heads,
        num_kv_heads_after=num_kv_heads,
        head_dim=dims.head_dim,
        kv_cache_bytes_per_token_before=conversion["kv_cache_bytes_per_token_before"],
        kv_cache_bytes_per_token_after=conversion["kv_cache_bytes_per_token_after"],
        kv_cache_dtype=kv_dtype,
        files=written.files,
        total_size=written.total_size,
        seconds=time.perf_counter() - start,
        record=record,
    )
