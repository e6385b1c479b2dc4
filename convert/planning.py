"""KV-cache arithmetic and memory planning from ``config.json`` alone (no weights needed).

KV cache per token = ``2 (K and V) x layers x KV heads x head_dim x bytes per element``; e.g.
Llama-2-7B (32 layers, 32 heads of 128) in fp16: 524,288 bytes as MHA, 131,072 with 8 KV heads.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mha2gqa.convert.families import AttentionDims, Family, detect_family
from mha2gqa.errors import Mha2GqaError

KV_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
_UNITS = {
    "TB": 10**12,
    "GB": 10**9,
    "MB": 10**6,
    "KB": 10**3,
    "TIB": 2**40,
    "GIB": 2**30,
    "MIB": 2**20,
    "KIB": 2**10,
    "B": 1,
}


def parse_size(text: str) -> int:
    """``"80GB"`` -> 80e9, ``"80GiB"`` -> 80 * 2**30, ``"1024"`` -> 1024 bytes."""
    t = text.strip().upper().replace(" ", "")
    for unit in sorted(_UNITS, key=len, reverse=True):
        if t.endswith(unit):
            number = t[: -len(unit)]
            break
    else:
        unit, number = "B", t
    try:
        return int(float(number) * _UNITS[unit])
    except ValueError:
        raise Mha2GqaError(f"{text!r} is not a size; write e.g. 80GB, 24GiB or 500MB") from None


def format_bytes(n: float) -> str:
    """``1536 -> "1.50 KiB"``: binary units, two decimals, thousands separated."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def load_config(model: str, revision: str | None = None) -> dict[str, Any]:
    """``config.json`` of a local folder, or of a hub id (only that file is downloaded)."""
    path = Path(model).expanduser()
    if path.is_dir():
        from mha2gqa.convert.checkpoint import read_config

        return read_config(path)
    if path.suffix == ".json" and path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    from huggingface_hub import hf_hub_download

    try:
        return json.loads(Path(hf_hub_download(model, "config.json", revision=revision)).read_text(encoding="utf-8"))
    except Exception as e:
        raise Mha2GqaError(
            f"{model}: no such folder, and its config.json cannot be fetched from the hub ({type(e).__name__})"
        ) from None


@dataclass
class ModelShape:
    """What the planner needs to know about a model."""

    family: str
    architecture: str
    dims: AttentionDims
    parameters: int
    kv_parameters_per_head: int  # parameters that exist once per KV head (all layers)
    weights_dtype: str

    def parameters_at(self, num_kv_heads: int) -> int:
        return self.parameters - (self.dims.num_kv_heads - num_kv_heads) * self.kv_parameters_per_head


def model_shape(config: dict[str, Any]) -> ModelShape:
    """Family, head counts and parameter counts (exact, from the model class on ``meta``)."""
    from mha2gqa.convert.validate import expected_tensors

    family: Family = detect_family(config)
    dims = AttentionDims.from_config(config)
    expected = expected_tensors(config)
    params = sum(_numel(s) for name, s in expected.shapes.items() if name not in expected.tied)
    per_head = _kv_params_per_head(config, expected.shapes, dims, family)
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    arch = (config.get("architectures") or [family.architectures[0]])[0]
    return ModelShape(family.family, arch, dims, params, per_head, dtype)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _kv_params_per_head(
    config: dict[str, Any], shapes: dict[str, tuple[int, ...]], dims: AttentionDims, family: Family
) -> int:
    """Parameters that scale with the KV-head count, per KV head (summed over layers)."""
    d = dims.head_dim
    total = 0
    for layer in range(dims.num_layers):
        modules = [family.qkv_proj] if family.fused else [family.k_proj, family.v_proj]
        for module in modules:
            for suffix in (".weight", ".bias"):
                shape = shapes.get(module.format(layer=layer) + suffix)
                if shape is not None:
                    per_row = _numel(shape[1:]) if len(shape) > 1 else 1
                    total += d * per_row * (2 if family.fused else 1)
        norm = family.k_norm
        if norm is not None and norm.layout in ("rows", "indexed") and norm.name.format(layer=layer, head=0) in shapes:
            total += d
    return total


@dataclass
class PlanRow:
    num_kv_heads: int
    kv_bytes_per_token: int
    kv_bytes_per_sequence: int
    weights_bytes: int
    max_sequences: int


def plan(
    shape: ModelShape, gpu_memory: int, seq_len: int, kv_dtype: str, weights_bytes_per_param: int
) -> list[PlanRow]:
    """For every valid KV-head count G (the divisors of the current count): KV bytes per token and
    per sequence, weights, and how many sequences of ``seq_len`` fit in ``gpu_memory`` (all memory
    not taken by weights counted as KV cache; activations and fragmentation not modelled)."""
    if kv_dtype not in KV_DTYPE_BYTES:
        raise Mha2GqaError(f"--dtype {kv_dtype}: choose one of {', '.join(KV_DTYPE_BYTES)}")
    rows = []
    cur = shape.dims.num_kv_heads
    for g in [g for g in range(cur, 0, -1) if cur % g == 0]:
        per_token = shape.dims.kv_cache_bytes_per_token(g, KV_DTYPE_BYTES[kv_dtype])
        weights = shape.parameters_at(g) * weights_bytes_per_param
        free = gpu_memory - weights
        rows.append(PlanRow(g, per_token, per_token * seq_len, weights, max(free // (per_token * seq_len), 0)))
    return rows


def describe(shape: ModelShape) -> dict[str, Any]:
    return {
        "family": shape.family,
        "architecture": shape.architecture,
        **asdict(shape.dims),
        "parameters": shape.parameters,
        "weights_dtype": shape.weights_dtype,
        "kv_cache_bytes_per_token": {
            name: shape.dims.kv_cache_bytes_per_token(shape.dims.num_kv_heads, b) for name, b in KV_DTYPE_BYTES.items()
        },
    }
