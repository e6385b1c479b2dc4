"""``--method random``: fresh K/V projections, initialised as transformers' ``_init_weights`` does
(weights ``normal(0, initializer_range)``, biases 0, norm weights 1), seeded per tensor."""

from __future__ import annotations

import torch

from mha2gqa.core.dtypes import BY_CODE


def fresh_tensor(shape: tuple[int, ...], dtype: str, kind: str, std: float, seed: int) -> torch.Tensor:
    """A new ``kind`` (``weight``, ``bias`` or ``norm``) tensor of ``shape`` in safetensors ``dtype``."""
    torch_dtype = BY_CODE[dtype].torch
    if kind == "weight":
        gen = torch.Generator().manual_seed(seed)
        return (torch.randn(shape, generator=gen, dtype=torch.float32) * std).to(torch_dtype)
    return (torch.ones if kind == "norm" else torch.zeros)(shape, dtype=torch_dtype)
