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
from mha2gqa.convert.safetensors_io import DTYPES, TORCH_TO_CODE, TensorInfo
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


#: Methods that rewrite q/k/v/o of a layer together; those that need calibration; every method.
LAYER_METHODS = ("svd", "aligned")
GROUPINGS = ("contiguous", "similarity")
CALIBRATED_METHODS = ("svd",)
ALL_METHODS = (*METHODS, "random", *LAYER_METHODS)


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


def _fresh(shape: tuple[int, ...], dtype: str, kind: str, std: float, seed: int) -> torch.Tensor:
    """A freshly initialised tensor as transformers' ``_init_weights`` makes it: weights
    ``normal(0, initializer_range)``, biases 0, norm weights 1 (seeded per tensor)."""
    torch_dtype = DTYPES[dtype][0]
    if kind == "weight":
        gen = torch.Generator().manual_seed(seed)
        return (torch.randn(shape, generator=gen, dtype=torch.float32) * std).to(torch_dtype)
    return (torch.ones if kind == "norm" else torch.zeros)(shape, dtype=torch_dtype)


def _fresh_fused(ckpt: Checkpoint, name: str, dims: AttentionDims, groups: int, std: float, seed: int) -> torch.Tensor:
    q, k, _ = split_fused_qkv(ckpt.load(name), dims.num_heads, dims.num_kv_heads, dims.head_dim)
    kind = "weight" if name.endswith(".weight") else "bias"
    shape = (groups * dims.head_dim, *k.shape[1:])
    dtype = TORCH_TO_CODE[k.dtype]
    return torch.cat([q, _fresh(shape, dtype, kind, std, seed), _fresh(shape, dtype, kind, std, seed + 1)])


def _layer_groups(stats, groups: int) -> dict[str, list[list[int]]] | None:
    """Which source KV heads each new KV head pools, per layer (similarity grouping)."""
    if stats is None:
        return None
    out = {}
    for layer, st in sorted(stats.layers.items()):
        perm = st.perm or []
        size = len(perm) // groups if perm else 0
        out[str(layer)] = [perm[j * size : (j + 1) * size] for j in range(groups)] if perm else None
    return out


class _LayerMerge:
    """Computes one layer's merged q/k/v/o once, hands the tensors out one by one and forgets
    them as they are written, so memory stays at one layer's attention weights."""

    def __init__(self, ckpt: Checkpoint, family: Family, dims: AttentionDims, groups: int, layer: int, stats,
                 rot: int, method: str):  # fmt: skip
        self.ckpt, self.family, self.dims, self.groups, self.layer, self.stats, self.rot = (
            ckpt, family, dims, groups, layer, stats, rot
        )  # fmt: skip
        self.method = method
        self.ready: dict[str, torch.Tensor] | None = None

    def names(self) -> dict[str, str]:
        """Role -> tensor name for this layer's tensors that exist in the checkpoint."""
        fam, fill = self.family, partial(str.format, layer=self.layer)
        roles = {"o": fill(fam.o_proj) + ".weight"}
        if fam.fused:
            roles |= {"qkv": fill(fam.qkv_proj) + ".weight", "qkv_bias": fill(fam.qkv_proj) + ".bias"}
        else:
            for key, module in (("q", fam.q_proj), ("k", fam.k_proj), ("v", fam.v_proj)):
                roles |= {key: fill(module) + ".weight", f"{key}_bias": fill(module) + ".bias"}
        return {role: n for role, n in roles.items() if n in self.ckpt.tensors}

    def get(self, name: str) -> torch.Tensor:
        if self.ready is None:
            self.ready = self._compute()
        return self.ready.pop(name)

    def _compute(self) -> dict[str, torch.Tensor]:
        from mha2gqa.convert.merge import (
            aligned_merge_layer,
            permute_heads,
            pool_merge_layer,
            svd_merge_layer,
            weight_stats,
        )

        dims, names = self.dims, self.names()
        src = {role: self.ckpt.load(n) for role, n in names.items()}
        w = {role: t.float() for role, t in src.items()}  # float32 maths; the statistics stay float64
        if self.family.fused:
            for suffix in ("", "_bias"):
                if "qkv" + suffix in w:
                    w["q" + suffix], w["k" + suffix], w["v" + suffix] = split_fused_qkv(
                        w.pop("qkv" + suffix), dims.num_heads, dims.num_kv_heads, dims.head_dim
                    )
        shape = (dims.num_heads, dims.num_kv_heads, self.groups, dims.head_dim, self.rot)
        # aligned without calibration: statistics from the weights alone
        layer_stats = weight_stats(w, *shape) if self.stats is None else self.stats.layers[self.layer]
        if layer_stats.perm is not None:  # similarity grouping: similar heads made contiguous
            w = permute_heads(w, layer_stats.perm, dims.num_heads, dims.head_dim)
        if self.method in METHODS:
            merged = pool_merge_layer(w, self.groups, dims.head_dim, METHODS[self.method])
        else:
            merge = svd_merge_layer if self.method == "svd" else aligned_merge_layer
            merged = merge(w, layer_stats, *shape)
        if self.family.fused:
            for suffix in ("", "_bias"):
                if "q" + suffix in merged:
                    merged["qkv" + suffix] = torch.cat([merged.pop(x + suffix) for x in ("q", "k", "v")])
        return {names[role]: merged[role].to(src[role].dtype) for role in names}


def plan_conversion(
    ckpt: Checkpoint,
    family: Family,
    dims: AttentionDims,
    num_kv_heads: int,
    method: str,
    stats=None,
    rotary_dim: int | None = None,
    seed: int = 0,
) -> list[OutputTensor]:
    """Every output tensor, in source storage order: byte copies except what the method changes
    (K/V for ``mean``/``first``/``random``; Q, K, V and O for ``svd``, from calibration ``stats``).

    Tensor shapes (head_dim * KV heads rows) are checked here, so a wrong config fails before
    anything is written.
    """
    g, d = num_kv_heads, dims.head_dim
    reducer = METHODS.get(method)
    std = float(ckpt.config.get("initializer_range", 0.02))
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

    def fresh(name: str, info: TensorInfo, shape: tuple[int, ...], kind: str) -> OutputTensor:
        tensor_seed = seed * 1_000_003 + int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
        return OutputTensor(name, info.dtype, shape, partial(_fresh, shape, info.dtype, kind, std, tensor_seed))

    layers = range(dims.num_layers) if g != dims.num_kv_heads else range(0)  # G = current: exact copy
    for layer in layers:
        fill = partial(str.format, layer=layer)
        if method in LAYER_METHODS or (stats is not None and stats.layers[layer].perm is not None):
            merge = _LayerMerge(ckpt, family, dims, g, layer, stats, rotary_dim or d, method)
            for role, name in merge.names().items():
                info = ckpt.tensors[name]
                rows = info.shape[0]
                if role in ("k", "k_bias", "v", "v_bias"):
                    rows = need(name, dims.num_kv_heads * d).shape[0] // dims.num_kv_heads * g
                elif role.startswith("qkv"):
                    need(name, (dims.num_heads + 2 * dims.num_kv_heads) * d)
                    rows = (dims.num_heads + 2 * g) * d
                rules[name] = OutputTensor(name, info.dtype, (rows, *info.shape[1:]), partial(merge.get, name))
            continue
        if family.fused:
            for suffix in (".weight", ".bias"):
                name = fill(family.qkv_proj) + suffix
                if name in ckpt.tensors:
                    info = need(name, (dims.num_heads + 2 * dims.num_kv_heads) * d)
                    shape = ((dims.num_heads + 2 * g) * d, *info.shape[1:])
                    if method == "random":
                        produce = partial(_fresh_fused, ckpt, name, dims, g, std, seed + layer * 7919)
                    else:
                        produce = partial(_pooled_fused, ckpt, name, dims, g, reducer)
                    rules[name] = OutputTensor(name, info.dtype, shape, produce)
        else:
            for module in (family.k_proj, family.v_proj):
                for suffix in (".weight", ".bias"):
                    name = fill(module) + suffix
                    if name in ckpt.tensors:
                        info = need(name, dims.num_kv_heads * d)
                        shape = (g * d, *info.shape[1:])
                        if method == "random":
                            rules[name] = fresh(name, info, shape, suffix[1:])
                        else:
                            rules[name] = OutputTensor(
                                name, info.dtype, shape, partial(_pooled, ckpt, name, g, d, reducer)
                            )
        norm = family.k_norm
        if norm is not None and norm.layout == "rows":
            name = fill(norm.name)
            if name in ckpt.tensors:
                info = need(name, dims.num_kv_heads * d)
                if method == "random":
                    rules[name] = fresh(name, info, (g * d,), "norm")
                else:
                    rules[name] = OutputTensor(name, info.dtype, (g * d,), partial(_pooled, ckpt, name, g, d, reducer))
        elif norm is not None and norm.layout == "indexed":
            names = [norm.name.format(layer=layer, head=h) for h in range(dims.num_kv_heads)]
            if all(n in ckpt.tensors for n in names):
                dropped.update(names[g:])
                for h in range(g):
                    info = ckpt.tensors[names[h]]
                    if method == "random":
                        rules[names[h]] = fresh(names[h], info, info.shape, "norm")
                    else:
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
    calibration: str | None = None,
    calibration_tokens: int = 16384,
    calibration_seq_len: int | None = None,
    device: str = "auto",
    seed: int = 0,
    grouping: str = "contiguous",
) -> ConversionResult:
    """Convert the checkpoint at ``src`` (folder or hub id) to ``num_kv_heads`` KV heads in ``dst``.

    Methods: ``mean``, ``first`` (pool or pick heads), ``random`` (fresh K/V as the model's own init,
    seeded), ``svd`` (activation-aware merge; reads ``calibration_tokens`` tokens of ``calibration``
    text through the original model first, on ``device``), ``aligned`` (rotate heads onto each
    other, then mean). ``grouping``: ``contiguous`` (transformers' ``repeat_kv`` blocks) or
    ``similarity`` (equal groups of the most similar heads per layer, from calibration, realised by
    permuting query heads with their KV heads).

    Streams tensor by tensor: peak memory is about one layer's attention weights, whatever the
    model size. Raises :class:`~mha2gqa.errors.Mha2GqaError` for bad input; nothing is left at
    ``dst`` then.
    """
    start = time.perf_counter()
    if method not in ALL_METHODS:
        raise Mha2GqaError(f"unknown method {method!r}: choose one of {', '.join(ALL_METHODS)}")
    ckpt = open_checkpoint(str(src), revision=revision, allow_pickle=allow_pickle)
    family = detect_family(ckpt.config)
    dims = AttentionDims.from_config(ckpt.config)
    check_num_kv_heads(dims, num_kv_heads)
    stats, rot, calibration_record = None, None, None
    if grouping not in GROUPINGS:
        raise Mha2GqaError(f"unknown grouping {grouping!r}: choose one of {', '.join(GROUPINGS)}")
    layered = method in LAYER_METHODS or grouping == "similarity"
    if grouping == "similarity" and method == "random":
        raise Mha2GqaError("--grouping similarity does not apply to --method random (fresh K/V ignore the grouping)")
    if layered and num_kv_heads != dims.num_kv_heads:
        if family.k_norm is not None or family.q_norm is not None:
            raise Mha2GqaError(
                f"--method {method} / --grouping {grouping} need keys linear in the input and heads that can be "
                f"reordered, but {family.family} normalises q/k per head; use --method mean or first, contiguous"
            )
        if not calibration and (method in CALIBRATED_METHODS or grouping == "similarity"):
            what = "--grouping similarity" if grouping == "similarity" else f"--method {method}"
            raise Mha2GqaError(f"{what} needs calibration text: pass --calibration DATA")
        from mha2gqa.convert.calibration import collect, rotary_dim

        if calibration:
            stats = collect(ckpt.folder, num_kv_heads, calibration, calibration_tokens, calibration_seq_len, device,
                            grouping=grouping, allow_pickle=allow_pickle)  # fmt: skip
            rot = stats.rotary_dim
            calibration_record = {"data": calibration, "tokens": stats.tokens, "rotary_dim": rot}
        else:
            from transformers import AutoConfig

            rot = rotary_dim(AutoConfig.from_pretrained(ckpt.folder))
            calibration_record = {"data": None, "tokens": 0, "rotary_dim": rot, "weights_only": True}
    tensors = plan_conversion(ckpt, family, dims, num_kv_heads, method, stats, rot, seed)
    new_config = dict(ckpt.config)
    new_config["num_key_value_heads"] = num_kv_heads
    checks = _Checks(ckpt, tensors, new_config)

    kv_dtype = _kv_dtype(ckpt, family)
    esize = DTYPES[kv_dtype][1]
    conversion = {
        "method": method,
        "calibration": calibration_record,
        "grouping": grouping,
        "source_kv_heads_per_kv_head_by_layer": _layer_groups(stats, num_kv_heads)
        if grouping == "similarity"
        else None,
        "seed": seed if method == "random" else None,
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
