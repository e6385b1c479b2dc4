"""Each decoder layer's plan (:class:`~mha2gqa.core.conversion_record.LayerPlan`): made once, after the
calibration statistics (which hold a similarity grouping's order of the heads) and before any tensor is
written; the writer (:mod:`~mha2gqa.convert.write.tensor_sources`), the refit and the record read it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mha2gqa.convert.methods import Method
from mha2gqa.core.conversion_record import COPY, FRESH, POOL, REWRITE, LayerPlan
from mha2gqa.core.dims import AttentionDims


def layer_plans(
    dims: AttentionDims,
    targets: tuple[int, ...],
    method: Method,
    stats: Any = None,
    refit: tuple[str, ...] = (),
    refit_target: str | None = None,
) -> tuple[LayerPlan, ...]:
    """One plan a layer: ``targets`` its KV heads after; ``stats`` the calibration statistics (None:
    none, a weights-only method or a pooling without them); ``refit`` the projections ``--refit`` fits
    in every changed layer (empty: no refit) and ``refit_target`` what it reproduces."""
    plans = []
    for layer, after in enumerate(targets):
        perm = stats.layers[layer].perm if stats is not None and after != dims.num_kv_heads else None
        plan = LayerPlan(layer, dims.num_kv_heads, after, COPY, None if perm is None else tuple(perm))
        if plan.changed:
            how = REWRITE if method.layerwise or plan.regrouped else FRESH if method.fresh else POOL
            fits = tuple(refit)
            target = refit_target if fits else None
            plan = replace(plan, how=how, refit=fits, refit_target=target, solve_output="o" in fits)
        plans.append(plan)
    return tuple(plans)
