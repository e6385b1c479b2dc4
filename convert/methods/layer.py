"""What every layer merge shares: rotary planes as complex numbers, the merged layer's tensors,
head permutations (similarity grouping) and the pooling merge applied to a whole layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mha2gqa.convert.methods.pooling import Reducer, reduce_rows


@dataclass(frozen=True)
class Fold:
    """Where one KV group's key merge writes: the new key rows and bias ``new`` (``[d, hidden]``,
    ``[d]`` or None; filled in place), and the query rows and bias ``queries`` the members' transforms
    fold into (in place); ``r`` query heads per source KV head, ``d`` dimensions a head."""

    new: tuple[torch.Tensor, torch.Tensor | None]
    queries: tuple[torch.Tensor, torch.Tensor | None]
    r: int
    d: int


def complex_rows(w: torch.Tensor, start: int, half: int) -> torch.Tensor:
    """Rows ``start + [0, half)`` and ``start + half + [0, half)`` as complex ``[half, ...]``."""
    return torch.complex(w[start : start + half], w[start + half : start + 2 * half])


def layer_out(q, qb, o, k_rows, kb_rows, v_rows, vb_rows) -> dict[str, torch.Tensor]:
    """The merged layer as the role -> tensor dict the converter writes (biases only if present)."""
    out = {"q": q, "o": o, "k": torch.cat(k_rows), "v": torch.cat(v_rows)}
    for key, value in (("q_bias", qb), ("k_bias", kb_rows), ("v_bias", vb_rows)):
        if value is not None and (key == "q_bias" or len(value)):
            out[key] = value if key == "q_bias" else torch.cat(value)
    return out


def permute_heads(
    w: dict[str, torch.Tensor], perm: list[int], num_heads: int, head_dim: int
) -> dict[str, torch.Tensor]:
    """Reorder the source KV heads as ``perm`` and, with each, the query heads that read it
    (``q``/``q_bias`` rows and ``o`` columns move together, so the layer computes the same thing)."""
    d, r = head_dim, num_heads // len(perm)

    def rows(heads: list[int]) -> torch.Tensor:
        return torch.cat([torch.arange(h * d, (h + 1) * d) for h in heads])

    kv_rows = rows(perm)
    q_rows = rows([i for h in perm for i in range(h * r, (h + 1) * r)])
    out = dict(w)
    for key in ("k", "k_bias", "v", "v_bias"):
        if key in w:
            out[key] = w[key][kv_rows]
    for key in ("q", "q_bias"):
        if key in w:
            out[key] = w[key][q_rows]
    out["o"] = w["o"][:, q_rows]
    return out


def pool_merge_layer(
    w: dict[str, torch.Tensor], groups: int, head_dim: int, reducer: Reducer
) -> dict[str, torch.Tensor]:
    """``mean``/``first`` on (already permuted) contiguous groups: K/V pooled, q/o as they are."""
    out = dict(w)
    for key in ("k", "k_bias", "v", "v_bias"):
        if key in w:
            out[key] = reduce_rows(w[key], groups, head_dim, reducer)
    return out
