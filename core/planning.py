"""KV-cache and memory planning from ``config.json`` alone (no weights, no torch): parameter
counts from the family's declared terms, KV bytes from :class:`~mha2gqa.core.dims.AttentionDims`.
"""

from __future__ import annotations

import ast
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mha2gqa.core.dims import AttentionDims, config_value
from mha2gqa.core.dtypes import KV_DTYPES, by_name
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.families import TERM_NAMES, Family, detect_family
from mha2gqa.core.settings import setting


@dataclass
class PlanSettings:
    """What ``mha2gqa plan`` sizes a model for."""

    gpu_memory: str = setting("80GB", help="Accelerator memory, e.g. 80GB, 24GiB.")
    seq_len: int = setting(4096, help="Tokens per sequence (prompt + generation).", minimum=1)
    dtype: str = setting("bf16", help="KV-cache dtype.", choices=KV_DTYPES)
    weights_dtype: str | None = setting(None, help="Weights dtype [default: --dtype].", choices=KV_DTYPES)


def load_config(model: str, revision: str | None = None) -> dict[str, Any]:
    """``config.json`` of a local folder or file, or of a hub id (only that file is downloaded)."""
    from mha2gqa.core.checkpoint import read_config

    path = Path(model).expanduser()
    if path.is_dir():
        return read_config(path)
    if path.is_file():
        return read_config(path.parent, path.name)
    from huggingface_hub import hf_hub_download

    try:
        return read_config(Path(hf_hub_download(model, "config.json", revision=revision)).parent)
    except Mha2GqaError:
        raise
    except Exception as e:
        raise Mha2GqaError(
            f"{model}: no such folder, and its config.json cannot be fetched from the hub ({type(e).__name__})"
        ) from None


def _evaluate(expression: str, values: dict[str, int]) -> int:
    """An arithmetic term of :data:`~mha2gqa.core.families.TERM_NAMES` (``+``, ``*``, ``-``, parentheses)."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mult | ast.Sub):
            a, b = walk(node.left), walk(node.right)
            return a + b if isinstance(node.op, ast.Add) else a * b if isinstance(node.op, ast.Mult) else a - b
        if isinstance(node, ast.Name):
            return values[node.id]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError(f"unsupported term {expression!r}")

    return walk(ast.parse(expression, mode="eval"))


def count_parameters(config: dict[str, Any], family: Family, num_kv_heads: int | None = None) -> int | None:
    """Parameters of the model ``config`` describes (with ``num_kv_heads`` KV heads), from the
    family's declared terms; None when the family declares none or the config lacks a size."""
    if not family.parameter_terms:
        return None
    dims = AttentionDims.from_config(config)
    values: dict[str, int] = {}
    for short, key in TERM_NAMES.items():
        value = {"head_dim": dims.head_dim, "num_key_value_heads": dims.num_kv_heads}.get(key, config.get(key))
        if isinstance(value, bool) or not isinstance(value, int):
            return None
        values[short] = value
    if num_kv_heads is not None:
        values["G"] = num_kv_heads
    defaults = dict(family.parameter_defaults)
    total = 0
    for expression, condition in family.parameter_terms:
        if condition is not None:
            key = condition.lstrip("!")
            on = bool(config_value(config, key, defaults[key]))
            if on == condition.startswith("!"):
                continue
        total += _evaluate(expression, values)
    return total


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
    """Family, head counts and parameter counts. Counts come from the family's declared terms (no
    torch); a family without them is counted exactly by building its model class on ``meta``."""
    family = detect_family(config)
    dims = AttentionDims.from_config(config)
    params = count_parameters(config, family)
    if params is not None:
        per_head = params - count_parameters(config, family, dims.num_kv_heads - 1)
    else:
        params, per_head = _meta_counts(config, family, dims)
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    arch = (config.get("architectures") or [family.architectures[0]])[0]
    return ModelShape(family.family, arch, dims, params, per_head, dtype)


def _meta_counts(config: dict[str, Any], family: Family, dims: AttentionDims) -> tuple[int, int]:
    """``(parameters, parameters per KV head)`` from the model class built on ``meta``."""
    from mha2gqa.core.expected_tensors import expected_tensors

    def count(cfg: dict[str, Any]) -> int:
        expected = expected_tensors(cfg)
        total = 0
        for name, shape in expected.shapes.items():
            if name not in expected.tied:
                n = 1
                for s in shape:
                    n *= s
                total += n
        return total

    params = count(config)
    fewer = {**config, "num_key_value_heads": dims.num_kv_heads - 1} if dims.num_kv_heads > 1 else None
    per_head = params - count(fewer) if fewer else 0
    return params, per_head


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
    element = by_name(kv_dtype).bytes
    rows = []
    for g in shape.dims.valid_kv_heads():
        per_token = shape.dims.kv_cache_bytes_per_token(g, element)
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
            name: shape.dims.kv_cache_bytes_per_token(None, by_name(name).bytes) for name in KV_DTYPES
        },
    }
