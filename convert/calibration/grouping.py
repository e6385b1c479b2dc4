"""Similarity grouping: which source KV heads share a new KV head, chosen per layer from calibration
statistics so that the merge loses least (the ``svd`` merge's own residual)."""

from __future__ import annotations

import torch

from mha2gqa.convert.calibration.stats import LayerStats
from mha2gqa.core.dims import contiguous_groups


def merge_residual(full: LayerStats, heads: list[int]) -> float:
    """What one shared KV head cannot keep of ``heads`` (source KV heads), from single-group
    statistics: the share of the group's key energy outside the best complex rank-1 fit of each
    rotary plane, plus the share of its value energy (and non-rotary key energy) outside the top
    ``d``-dimensional subspace -- the quantities the ``svd`` merge gives up. 0 for identical heads."""
    src = full.k_plane_gram.shape[-1]
    d = full.v_gram.shape[-1] // src
    rest = full.k_rest_gram.shape[-1] // src

    def rows(width: int) -> torch.Tensor:
        return torch.cat([torch.arange(h * width, (h + 1) * width) for h in heads])

    def lost(gram: torch.Tensor, keep: int) -> float:
        ev = torch.linalg.eigvalsh(gram)
        return float(1 - ev[..., -keep:].sum() / ev.sum().clamp_min(1e-300))

    out = lost(full.v_gram[0][rows(d)][:, rows(d)], d) + lost(full.k_plane_gram[0][:, heads][:, :, heads], 1)
    if rest:
        out += lost(full.k_rest_gram[0][rows(rest)][:, rows(rest)], rest)
    return out


def least_residual_groups(full: LayerStats, groups: int) -> list[list[int]]:
    """Equal-size groups of source KV heads that lose least in the merge (:func:`merge_residual`):
    a greedy search (each group starts from the lowest unassigned head and adds, one at a time, the
    head that keeps the group's residual lowest), kept only if its total residual beats the
    contiguous ``repeat_kv`` grouping's -- so the choice is never worse than the default by this
    measure."""
    n = full.k_plane_gram.shape[-1]
    size = n // groups
    free = list(range(n))
    greedy = []
    while free:
        group = [free.pop(0)]
        while len(group) < size:
            best = min(free, key=lambda h: (merge_residual(full, [*group, h]), h))
            free.remove(best)
            group.append(best)
        greedy.append(sorted(group))
    contiguous = contiguous_groups(n, groups)

    def cost(gs: list[list[int]]) -> float:
        return sum(merge_residual(full, g) for g in gs)

    return greedy if cost(greedy) < cost(contiguous) - 1e-12 else contiguous


def regroup(full: LayerStats, groups: list[list[int]], num_heads: int) -> LayerStats:
    """Group statistics for ``groups`` (lists of source KV heads) from single-group statistics,
    with ``perm`` (the source heads in their new order) recorded."""
    perm = [h for g in groups for h in g]
    src = len(perm)
    r = num_heads // src
    d = full.v_gram.shape[-1] // src
    rest = full.k_rest_gram.shape[-1] // src

    def rows(width: int, heads: list[int]) -> torch.Tensor:
        return (
            torch.cat([torch.arange(h * width, (h + 1) * width) for h in heads])
            if width
            else torch.zeros(0, dtype=torch.long)
        )

    v = torch.stack([full.v_gram[0][rows(d, g)][:, rows(d, g)] for g in groups])
    kr = torch.stack([full.k_rest_gram[0][rows(rest, g)][:, rows(rest, g)] for g in groups])
    kp = torch.stack([full.k_plane_gram[0][:, g][:, :, g] for g in groups])
    q = full.q_plane_energy[rows(r, perm)]
    o = full.o_gram[rows(r, perm)] if full.o_gram is not None else None
    return LayerStats(v, kp, kr, q, full.tokens, perm=perm, o_gram=o, plain_code=full.plain_code)
