"""Tensor element types, once: safetensors codes, torch names, short names, bytes per element.

Importing this module does not import torch; :attr:`DType.torch` does, when asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mha2gqa.core.errors import Mha2GqaError


@dataclass(frozen=True)
class DType:
    code: str  # safetensors header code, e.g. "BF16"
    name: str  # torch attribute, e.g. "bfloat16"
    bytes: int
    short: str | None = None  # e.g. "bf16"
    floating: bool = True

    @property
    def torch(self) -> Any:
        import torch

        return getattr(torch, self.name)


_ALL = (
    DType("F64", "float64", 8, "fp64"),
    DType("F32", "float32", 4, "fp32"),
    DType("F16", "float16", 2, "fp16"),
    DType("BF16", "bfloat16", 2, "bf16"),
    DType("F8_E4M3", "float8_e4m3fn", 1, "fp8"),
    DType("F8_E5M2", "float8_e5m2", 1),
    DType("I64", "int64", 8, floating=False),
    DType("I32", "int32", 4, floating=False),
    DType("I16", "int16", 2, floating=False),
    DType("I8", "int8", 1, floating=False),
    DType("U8", "uint8", 1, floating=False),
    DType("BOOL", "bool", 1, floating=False),
)
BY_CODE: dict[str, DType] = {d.code: d for d in _ALL}
_BY_NAME: dict[str, DType] = {**{d.name: d for d in _ALL}, **{d.short: d for d in _ALL if d.short}}

#: Element types a model may be loaded (evaluated, trained) in, by the names users type.
MODEL_DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
#: KV-cache element types the planner knows, by short name.
KV_DTYPES = ("bf16", "fp16", "fp32", "fp8")


def by_name(name: str) -> DType:
    """``"bf16"``, ``"bfloat16"`` or ``"torch.bfloat16"`` -> :class:`DType`."""
    key = str(name).removeprefix("torch.")
    if key not in _BY_NAME:
        raise Mha2GqaError(f"unknown dtype {name!r}: choose one of {', '.join(sorted(_BY_NAME))}")
    return _BY_NAME[key]


def from_torch(dtype: Any) -> DType:
    """The :class:`DType` of a ``torch.dtype``."""
    return by_name(str(dtype))
