"""Per-layer KV budgets (``convert --per-layer auto``): how many KV heads each layer keeps.

Each layer's cost of keeping ``G`` KV heads is measured on calibration text while the layer is
loaded (:func:`output_costs`, the default): the layer runs again on the windows it read with only
its own q/k/v/o merged by the conversion's method at ``G``, and the cost is its output error relative
to its output. :func:`layer_costs` is the cheaper statistic (``--allocation-cost residual``): the
mean over the layer's groups of
:func:`~mha2gqa.convert.calibration.grouping.merge_residual`, the share of the group's key and value
energy one shared head cannot hold. :class:`FinalKL` (``--allocation-cost logits``) follows the
same merge as the output cost through every later layer to the model's next-token distribution, so
it sees how a layer's error grows with depth. The groups are the ones the conversion will use
(contiguous, or the similarity grouping's). Then the allocation with the least total cost whose KV heads sum to at
most the budget is found exactly, by dynamic programming over layers and heads spent. Measured on
``pydocs-mha-8h`` (``benchmarks/per_layer.py``), the output cost never lost to uniform GQA; the
residual did, twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mha2gqa.convert.calibration.grouping import merge_residual
from mha2gqa.convert.calibration.stats import LayerStats
from mha2gqa.convert.methods import Method
from mha2gqa.convert.plan.groupings import Grouping
from mha2gqa.core.dims import AttentionDims
from mha2gqa.core.errors import SettingError
from mha2gqa.core.families import Family


def layer_costs(full: LayerStats, candidates: list[int], grouping: Grouping) -> dict[int, float]:
    """``{G: cost}`` of one layer from its single-group statistics (over all source KV heads), in the
    groups ``grouping`` chooses."""
    n = full.k_plane_gram.shape[-1]
    out = {}
    for g in candidates:
        if g == n:
            out[g] = 0.0
            continue
        out[g] = sum(merge_residual(full, grp) for grp in grouping.choose(full, g)) / g
    return out


@dataclass(frozen=True)
class Merger:
    """How the conversion merges a layer's heads (its checkpoint, family, dimensions, method and
    grouping): what the output-level costs replace a loaded layer's attention with."""

    ckpt: Any
    family: Family
    dims: AttentionDims
    method: Method
    grouping: Grouping

    @contextlib.contextmanager
    def merged_at(self, g: int, run: Any, layer: int, full: LayerStats) -> Iterator[None]:
        """While in the block, the loaded layer ``run.module`` (layer ``layer``, its single-group
        statistics ``full``) computes as the conversion would write it at ``g`` KV heads (the
        conversion's own tensor rules, with the groups it would use: fused projections, biases and
        per-head key norms included), seen through the source module
        (:func:`~mha2gqa.convert.engine.layer_view.source_view`); its own weights come back after."""
        from mha2gqa.convert.calibration.grouping import regroup
        from mha2gqa.convert.engine.layer_view import planned, source_view, swapped
        from mha2gqa.convert.methods import HeadShape
        from mha2gqa.convert.plan.layer_plan import layer_plans
        from mha2gqa.convert.write.tensor_sources import tensor_sources

        dims = self.dims
        n = dims.num_kv_heads
        stats = _OneLayer({layer: regroup(full, self.grouping.choose(full, g), dims.num_heads)})
        targets = tuple(g if i == layer else n for i in range(dims.num_layers))
        plans = layer_plans(dims, targets, self.method, stats)
        rules = {t.name: t for t in tensor_sources(self.ckpt, self.family, dims, plans, self.method, stats)}
        shape = HeadShape.of(dims, g)
        made = {name for name, rule in rules.items() if not rule.copy}  # the rest is the loaded layer's own
        params = source_view(planned(rules, self.ckpt), made, self.family, shape, run.module, layer, run.prefix)
        with swapped(run.module, params):
            yield


@dataclass(frozen=True)
class _OneLayer:
    """Calibration statistics holding one layer's (what the conversion's tensor rules read)."""

    layers: dict[int, LayerStats]


def output_costs(run: Any, layer: int, full: LayerStats, merger: Merger, candidates: list[int]) -> dict[int, float]:
    """``{G: cost}`` of one layer, measured on its output: the layer's q/k/v/o replaced by what
    ``method`` makes of them at ``G`` KV heads (the groups the conversion would use), run again on the
    calibration windows it read, and the squared error of its output relative to the original
    layer's output (the residual stream after it), ``sum |y_G - y|^2 / sum |y|^2``. Only this layer
    is merged, so the cost is the layer's own. (Relative to the layer's update ``y - x`` instead, the
    first layers' large updates hid their errors and the allocation starved them: measured on
    ``pydocs-mha-8h`` it did worse than uniform.) ``run``: the
    :class:`~mha2gqa.convert.engine.layers.LayerRun` of the loaded layer. ``random``
    (fresh K/V, nothing kept) costs 1 at every ``G`` below the current count."""
    out: dict[int, float] = {}
    for g in candidates:
        if g == merger.dims.num_kv_heads:
            out[g] = 0.0
        elif merger.method.fresh:
            out[g] = 1.0
        else:
            with merger.merged_at(g, run, layer, full):
                out[g] = _relative_output_error(run)
    return out


#: ``--allocation-cost logits``: calibration windows each layer's merged streams are followed on
LOGITS_WINDOWS = 4


class FinalKL:
    """``--allocation-cost logits``: each layer's cost of ``G`` KV heads measured at the model's end.
    The layer runs merged at ``G`` on the first ``windows`` calibration windows it read, and that
    stream goes on through every later layer as the source has it (one stream per layer and count,
    advanced while each later layer is loaded); at the end the model's head turns each stream into
    next-token distributions, and the cost is the mean KL(original || merged) per token. Unlike the
    layer-level costs it sees how a layer's error grows, or fades, through the layers after it.
    Memory: one ``[T, hidden]`` float32 stream per window, layer and count below the source's (the
    head's logits a block of tokens at a time: :func:`~mha2gqa.convert.engine.layers.next_token_kl`); time:
    the later layers run once more per stream, and the head once per stream and window."""

    def __init__(self, windows: int) -> None:
        self.windows = windows
        self.team = None  # the processes sharing the windows (LayerRun.team), from the first layer added
        self.streams: dict[tuple[int, int], list[Any]] = {}  # (layer, G) -> per window [1, T, hidden]
        self.original: list[Any] = []  # the source's own stream after the last layer seen
        self.as_tuple = False  # the family's decoder layers return tuples

    def add(self, run: Any, layer: int, full: LayerStats, merger: Merger, candidates: list[int]) -> None:
        """Advance the earlier layers' streams through the loaded layer ``run`` (as the source has
        it), then start this layer's: its inputs through it merged at each count in ``candidates``.
        Several processes each follow their own of the first ``windows`` calibration windows."""
        import torch

        self.team = run.team
        mine = len(run.team.own(range(self.windows)))  # this process's of the first windows: its first ones
        kws = [kw for _, kw in run.outputs[:mine]]

        def through(hidden: list[Any]) -> list[Any]:
            out = []
            for h, kw in zip(hidden, kws, strict=True):
                y = run.module(h, **kw)
                self.as_tuple = isinstance(y, tuple)
                out.append(y[0] if self.as_tuple else y)
            return out

        with torch.no_grad():
            for key, hidden in self.streams.items():
                self.streams[key] = through(hidden)
            for g in candidates:
                if g != merger.dims.num_kv_heads and not merger.method.fresh:
                    with merger.merged_at(g, run, layer, full):
                        self.streams[(layer, g)] = through(run.inputs[:mine])
        self.original = [y for y, _ in run.outputs[:mine]]

    def costs(self, logits: Any, num_layers: int, n: int, candidates: list[int]) -> list[dict[int, float]]:
        """``{G: cost}`` of every layer, once every layer has been added; ``logits``: the model's
        head (:func:`~mha2gqa.convert.engine.layers.model_head`). ``random`` (fresh K/V, nothing kept to
        follow) costs 1 at every count below ``n``, as with the output cost."""
        import torch

        from mha2gqa.convert.engine.layers import next_token_kl

        out = [{n: 0.0} | {g: 1.0 for g in candidates if g != n} for _ in range(num_layers)]  # 1: fresh K/V
        if not self.streams:  # nothing merged to follow (fresh K/V)
            return out
        sums = torch.zeros(len(self.streams), 2, dtype=torch.float64)  # (KL, tokens) per stream, summed over processes
        streams = list(self.streams.values())
        for w, original in enumerate(self.original):  # the original's log-probabilities once a block of tokens
            sums[:, 0] += next_token_kl(logits, self.as_tuple, original, [s[w] for s in streams])[:, 0]
            sums[:, 1] += original.shape[0] * original.shape[1]
        self.team.sum(sums)
        for ((layer, g), _), (kl, tokens) in zip(self.streams.items(), sums.tolist(), strict=True):
            out[layer][g] = max(kl / tokens, 0.0)
        return [dict(sorted(c.items())) for c in out]


def _relative_output_error(run: Any) -> float:
    """``sum |y' - y|^2 / sum |y|^2`` of the loaded layer ``run.module`` as it is now (``y'``) against
    its recorded outputs ``y``, over the calibration windows it read (every process its own, summed)."""
    import torch

    err = ref = 0.0
    with torch.no_grad():
        for x, (y, kw) in zip(run.inputs, run.outputs, strict=True):
            got = run.module(x, **kw)
            got = got[0] if isinstance(got, tuple) else got
            err += (got.double() - y.double()).pow(2).sum().item()
            ref += y.double().pow(2).sum().item()
    err, ref = run.team.total(err, ref)
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
