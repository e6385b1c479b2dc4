"""MHA -> GQA checkpoint conversion (streaming, sharded, atomic)."""

from mha2gqa.convert.converter import (
    ALL_METHODS,
    GROUPINGS,
    ConversionResult,
    check_num_kv_heads,
    convert_checkpoint,
    query_heads_per_kv_head,
)
from mha2gqa.convert.families import AttentionDims, Family, detect_family, families
from mha2gqa.convert.pooling import METHODS

__all__ = [
    "ALL_METHODS",
    "GROUPINGS",
    "METHODS",
    "AttentionDims",
    "ConversionResult",
    "Family",
    "check_num_kv_heads",
    "convert_checkpoint",
    "detect_family",
    "families",
    "query_heads_per_kv_head",
]
