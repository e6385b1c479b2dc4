"""Per-layer KV budgets (``convert --per-layer auto``): how many KV heads each layer keeps.

Each layer's cost of keeping ``G`` KV heads is measured on calibration text, as what a merge
cannot keep: the mean over the layer's ``G`` groups of
:func:`~mha2gqa.convert.calibration.grouping.merge_residual` (the share of the group's key and value
energy outside what one shared head can hold, a subspace measure; 0 for heads that are already
alike). The same cost serves every method: measured on ``pydocs-mha-8h``, a method-specific cost
for mean pooling (the heads' distance to their mean) predicted its loss worse than this one. The
groups are the ones the conversion will use (contiguous, or the similarity grouping's). Then the
allocation with the least total cost whose KV heads sum to at most the budget is found exactly, by
dynamic programming over layers and heads spent.
"""

from __future__ import annotations

from mha2gqa.convert.calibration.grouping import least_residual_groups, merge_residual
from mha2gqa.convert.calibration.stats import LayerStats
from mha2gqa.core.errors import SettingError


def layer_costs(full: LayerStats, candidates: list[int], similarity: bool) -> dict[int, float]:
    """``{G: cost}`` of one layer from its single-group statistics (over all source KV heads)."""
    n = full.k_plane_gram.shape[-1]
    out = {}
    for g in candidates:
        if g == n:
            out[g] = 0.0
            continue
        size = n // g
        groups = least_residual_groups(full, g) if similarity else [list(range(j * size, (j + 1) * size))
                                                                    for j in range(g)]  # fmt: skip
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
