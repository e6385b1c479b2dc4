"""Per-layer KV budgets (``convert --per-layer auto``): how many KV heads each layer keeps.

Each layer's cost of keeping ``G`` KV heads is measured on calibration text while the layer is
loaded (:func:`output_costs`, the default): the layer runs again on the windows it read with only
its own q/k/v/o merged by the conversion's method at ``G``, and the cost is its output error relative
to its output. :func:`layer_costs` is the cheaper statistic (``--allocation-cost residual``): the
mean over the layer's groups of
:func:`~mha2gqa.convert.calibration.grouping.merge_residual`, the share of the group's key and value
energy one shared head cannot hold. The groups are the ones the conversion will use (contiguous, or
the similarity grouping's). Then the allocation with the least total cost whose KV heads sum to at
most the budget is found exactly, by dynamic programming over layers and heads spent. Measured on
``pydocs-mha-8h`` (``benchmarks/per_layer.py``), the output cost never lost to uniform GQA; the
residual did, twice.
"""

from __future__ import annotations

from typing import Any

from mha2gqa.convert.calibration.grouping import least_residual_groups, merge_residual
from mha2gqa.convert.calibration.stats import LayerStats
from mha2gqa.convert.methods import Method
from mha2gqa.core.dims import AttentionDims, contiguous_groups
from mha2gqa.core.errors import SettingError
from mha2gqa.core.families import Family


def layer_costs(full: LayerStats, candidates: list[int], similarity: bool) -> dict[int, float]:
    """``{G: cost}`` of one layer from its single-group statistics (over all source KV heads)."""
    n = full.k_plane_gram.shape[-1]
    out = {}
    for g in candidates:
        if g == n:
            out[g] = 0.0
            continue
        groups = least_residual_groups(full, g) if similarity else contiguous_groups(n, g)
        out[g] = sum(merge_residual(full, grp) for grp in groups) / g
    return out


def output_costs(
    run: Any,
    layer: int,
    full: LayerStats,
    family: Family,
    dims: AttentionDims,
    method: Method,
    candidates: list[int],
    similarity: bool,
) -> dict[int, float]:
    """``{G: cost}`` of one layer, measured on its output: the layer's q/k/v/o replaced by what
    ``method`` makes of them at ``G`` KV heads (the groups the conversion would use), run again on the
    calibration windows it read, and the squared error of its output relative to the original
    layer's output (the residual stream after it), ``sum |y_G - y|^2 / sum |y|^2``. Only this layer
    is merged, so the cost is the layer's own. (Relative to the layer's update ``y - x`` instead, the
    first layers' large updates hid their errors and the allocation starved them: measured on
    ``pydocs-mha-8h`` it did worse than uniform.) ``run``: the
    :class:`~mha2gqa.convert.layers.LayerRun` of the loaded layer. ``random``
    (fresh K/V, nothing kept) costs 1 at every ``G`` below the current count."""
    import torch

    from mha2gqa.convert.calibration.grouping import regroup
    from mha2gqa.convert.methods import HeadShape
    from mha2gqa.convert.methods.layer import permute_heads

    n, h, d = dims.num_kv_heads, dims.num_heads, dims.head_dim
    names = {r: getattr(family, f"{r}_proj").format(layer=layer).removeprefix(run.prefix) for r in "qkvo"}
    mods = {r: run.module.get_submodule(name) for r, name in names.items()}
    attn = run.module.get_submodule(names["k"].rsplit(".", 1)[0])
    saved = {r: (m.weight, m.bias) for r, m in mods.items()}
    groups_before = attn.num_key_value_groups
    w = {r: m.weight.detach().float() for r, m in mods.items()}
    w |= {f"{r}_bias": mods[r].bias.detach().float() for r in "qkv" if mods[r].bias is not None}
    out: dict[int, float] = {}
    try:
        for g in candidates:
            if g == n:
                out[g] = 0.0
                continue
            if method.fresh:
                out[g] = 1.0
                continue
            chosen = least_residual_groups(full, g) if similarity else contiguous_groups(n, g)
            st = regroup(full, chosen, h)
            ww = permute_heads(w, st.perm, h, d) if st.perm != sorted(st.perm) else w
            merged = method.merge_layer(ww, st, shape=HeadShape(h, n, g, d, dims.rotary))
            for r, m in mods.items():
                m.weight = torch.nn.Parameter(merged[r], requires_grad=False)
                if f"{r}_bias" in merged:
                    m.bias = torch.nn.Parameter(merged[f"{r}_bias"], requires_grad=False)
            attn.num_key_value_groups = h // g
            out[g] = _relative_output_error(run)
    finally:
        for r, m in mods.items():
            m.weight, m.bias = saved[r]
        attn.num_key_value_groups = groups_before
    return out


def _relative_output_error(run: Any) -> float:
    """``sum |y' - y|^2 / sum |y|^2`` of the loaded layer ``run.module`` as it is now (``y'``) against
    its recorded outputs ``y``, over the calibration windows it read."""
    import torch

    err = ref = 0.0
    with torch.no_grad():
        for x, (y, kw) in zip(run.inputs, run.outputs, strict=True):
            got = run.module(x, **kw)
            got = got[0] if isinstance(got, tuple) else got
            err += (got.double() - y.double()).pow(2).sum().item()
            ref += y.double().pow(2).sum().item()
    return err / max(ref, 1e-300)


def allocate(costs: list[dict[int, float]], budget: int) -> tuple[int, ...]:
    """The KV heads of each layer that minimise the summed cost with at most ``budget`` heads in all
    (exact: dynamic programming over layers x heads spent; ties go to more heads, then to earlier
    layers). ``costs[l]``: ``{G: cost}`` of layer ``l``."""
    least = sum(min(c) for c in costs)
    if budget < least:
        raise SettingError(
            "kv_budget",
            f"{{name}}: {budget} KV heads in all cannot give each of the {len(costs)} "
            f"layers its fewest ({least}); raise the budget",
        )
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
