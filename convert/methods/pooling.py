"""Reducing K/V heads into groups.

Grouping follows transformers' ``repeat_kv``: with ``r = H / G``, query head ``i`` reads KV head
``i // r``, so KV group ``j`` pools the *contiguous* source KV heads ``[j*s, (j+1)*s)`` where
``s = G_src / G`` (``G_src`` is the current number of KV heads, ``H`` for MHA).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: A head reducer maps ``[G_src, *per_head]`` to ``[G, *per_head]`` (float32 in and out).
Reducer = Callable[[torch.Tensor, int], torch.Tensor]


def _grouped(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``[G_src, *rest]`` -> ``[G, G_src/G, *rest]`` (contiguous groups)."""
    return x.reshape(num_groups, x.shape[0] // num_groups, *x.shape[1:])


def mean_heads(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """The GQA paper's conversion: mean of the heads in each group."""
    return _grouped(x, num_groups).mean(dim=1)


def first_heads(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """The GQA paper's ablation: keep the first head of each group."""
    return _grouped(x, num_groups)[:, 0]


def reduce_rows(weight: torch.Tensor, num_groups: int, head_dim: int, reducer: Reducer) -> torch.Tensor:
    """Pool a head-major projection: ``[G_src*head_dim, *rest]`` -> ``[G*head_dim, *rest]``.

    Works for weights ``[G_src*d, hidden]``, biases ``[G_src*d]`` and per-head norm vectors. The
    reduction runs in float32 and the result is cast back to the input dtype.
    """
    rest = weight.shape[1:]
    heads = weight.reshape(-1, head_dim, *rest).float()
    return reducer(heads, num_groups).reshape(num_groups * head_dim, *rest).to(weight.dtype)


def reduce_stacked(tensors: list[torch.Tensor], num_groups: int, reducer: Reducer) -> list[torch.Tensor]:
    """Pool per-head tensors given as a list of ``G_src`` tensors (e.g. one LayerNorm per head)."""
    out = reducer(torch.stack([t.float() for t in tensors]), num_groups)
    return [t.to(tensors[0].dtype) for t in out.unbind(0)]
