"""``--method random``: fresh K/V projections, initialised as transformers' ``_init_weights`` does
(weights ``normal(0, initializer_range)``, biases 0, norm weights 1), seeded per tensor."""

from __future__ import annotations

import torch

from mha2gqa.core.dtypes import BY_CODE, from_torch
from mha2gqa.core.families import Family


def fresh_tensor(shape: tuple[int, ...], dtype: str, kind: str, std: float, seed: int) -> torch.Tensor:
    """A new ``kind`` (``weight``, ``bias`` or ``norm``) tensor of ``shape`` in safetensors ``dtype``."""
    torch_dtype = BY_CODE[dtype].torch
    if kind == "weight":
        gen = torch.Generator().manual_seed(seed)
        return (torch.randn(shape, generator=gen, dtype=torch.float32) * std).to(torch_dtype)
    return (torch.ones if kind == "norm" else torch.zeros)(shape, dtype=torch_dtype)


def fresh_fused(
    fused: torch.Tensor,
    kind: str,
    family: Family,
    num_heads: int,
    num_kv_heads: int,
    groups: int,
    head_dim: int,
    std: float,
    seed: int,
) -> torch.Tensor:
    """A fused qkv tensor (``family``'s layout) with its q rows kept and fresh k and v rows for ``groups`` heads."""
    q, k, _ = family.split_qkv(fused, num_heads, num_kv_heads, head_dim)
    shape = (groups * head_dim, *k.shape[1:])
    dtype = from_torch(k.dtype).code
    fresh_k, fresh_v = fresh_tensor(shape, dtype, kind, std, seed), fresh_tensor(shape, dtype, kind, std, seed + 1)
    return family.join_qkv(q, fresh_k, fresh_v, num_heads, groups, head_dim)
