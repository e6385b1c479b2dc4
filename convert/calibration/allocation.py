"""Per-layer KV budgets (``convert --per-layer auto``): how many KV heads each layer keeps.

Each layer's cost of keeping ``G`` KV heads is measured on calibration text, as what the method's
merge cannot keep: the mean over the layer's ``G`` groups of the share of the group's key and value
energy the shared head loses (:func:`~mha2gqa.convert.calibration.grouping.merge_residual` for the
layer methods, the distance to the pooled vector for ``mean``/``first``; 0 for heads that are
already alike). The groups are the ones the conversion will use (contiguous, or the
similarity grouping's). Then the allocation with the least total cost whose KV heads sum to at most
the budget is found exactly, by dynamic programming over layers and heads spent.
"""

from __future__ import annotations

import torch

from mha2gqa.convert.calibration.grouping import least_residual_groups, merge_residual
from mha2gqa.convert.calibration.stats import LayerStats
from mha2gqa.core.errors import SettingError


def _block_traces(gram: torch.Tensor, heads: list[int], width: int) -> torch.Tensor:
    """``[s, s]`` traces of the ``width x width`` blocks of ``gram`` between ``heads``."""
    idx = torch.stack([torch.arange(h * width, (h + 1) * width) for h in heads])  # [s, width]
    sub = gram[idx[:, None, :, None], idx[None, :, None, :]]  # [s, s, width, width]
    return sub.diagonal(dim1=-2, dim2=-1).sum(-1)


def pooling_residual(full: LayerStats, heads: list[int], keep: str) -> float:
    """What one pooled KV head loses of ``heads``: the share of their key and value energy (summed
    over calibration tokens, from the single-group Grams) off the pooled vector -- the group mean
    (``keep="mean"``) or the first head (``"first"``). 0 for identical heads."""
    src = full.k_plane_gram.shape[-1]
    d = full.v_gram.shape[-1] // src
    rest = full.k_rest_gram.shape[-1] // src
    n = len(heads)

    def lost(t: torch.Tensor) -> float:  # t: [n, n] (complex) sums of <x_a, x_b> over tokens
        t = t.real.double()
        energy = t.diagonal().sum()
        # mean: sum_h |x_h - mean|^2 = sum_h |x_h|^2 - |sum_h x_h|^2 / n; first: sum_h |x_h - x_0|^2
        off = energy - t.sum() / n if keep == "mean" else (t.diagonal() - 2 * t[:, 0] + t[0, 0]).sum()
        return float(off / energy.clamp_min(1e-300))

    planes = full.k_plane_gram[0][:, heads][:, :, heads].sum(0)  # [n, n] over the rotary planes
    out = lost(planes) + lost(_block_traces(full.v_gram[0], heads, d))
    if rest:
        out += lost(_block_traces(full.k_rest_gram[0], heads, rest))
    return out


def layer_costs(full: LayerStats, candidates: list[int], similarity: bool, method: str = "svd") -> dict[int, float]:
    """``{G: cost}`` of one layer from its single-group statistics (over all source KV heads): the
    mean over its groups of what ``method``'s merge loses (:func:`merge_residual` for the layer
    methods, :func:`pooling_residual` for ``mean``/``first``; 1 for ``random``, which keeps nothing)."""
    n = full.k_plane_gram.shape[-1]
    out = {}
    for g in candidates:
        if g == n:
            out[g] = 0.0
            continue
        size = n // g
        groups = least_residual_groups(full, g) if similarity else [list(range(j * size, (j + 1) * size))
                                                                    for j in range(g)]  # fmt: skip
        if method in ("mean", "first"):
            out[g] = sum(pooling_residual(full, grp, method) for grp in groups) / g
        elif method == "random":
            out[g] = 1.0
        else:
            out[g] = sum(merge_residual(full, grp) for grp in groups) / g
    return out


def allocate(costs: list[dict[int, float]], budget: int) -> tuple[int, ...]:
    """The KV heads of each layer that minimise the summed cost with at most ``budget`` heads in all
    (exact: dynamic programming over layers x heads spent; ties go to more heads, then to earlier
    layers). ``costs[l]``: ``{G: cost}`` of layer ``l``."""
    least = sum(min(c) for c in costs)
    if budget < least:
        raise SettingError("kv_budget", f"{{name}}: {budget} KV heads in all cannot give each of the {len(costs)} "
                           f"layers its fewest ({least}); raise the budget")  # fmt: skip
    # best[b] = (cost, -heads, choices) over the layers so far, spending exactly b heads
    best: dict[int, tuple[float, int, tuple[int, ...]]] = {0: (0.0, 0, ())}
    for layer_costs_ in costs:
        nxt: dict[int, tuple[float, int, tuple[int, ...]]] = {}
        for spent, (cost, neg, picks) in best.items():
            for g, c in sorted(layer_costs_.items(), reverse=True):
                b = spent + g
                if b > budget:
                    continue
                cand = (cost + c, neg - g, (*picks, g))
                if b not in nxt or cand[:2] < nxt[b][:2]:
                    nxt[b] = cand
        best = nxt
    return min(best.values(), key=lambda v: (round(v[0], 12), v[1]))[2]
