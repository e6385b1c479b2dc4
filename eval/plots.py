"""Figures for the report (matplotlib, Agg backend), returned as PNG bytes.

Colour-blind-safe choices: the cividis colour map for heat maps and the Okabe-Ito palette for lines.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from mha2gqa.core.figures import OKABE_ITO
from mha2gqa.core.figures import figure as _figure
from mha2gqa.core.figures import png as _png
from mha2gqa.core.runlog import RunEval, RunHistory

if TYPE_CHECKING:
    from mha2gqa.eval.results import AttentionLayer


def heatmap(cells: list[list[float]], title: str, unit: str, scale: tuple[float, float] | None = None) -> bytes:
    """Layer x query-head heat map of ``cells`` ``[layer][head]``; ``scale`` ``(vmin, vmax)`` shared
    across the report's sections so that a bad conversion looks worse than a good one at a glance."""
    import numpy as np

    values = np.array(cells)
    plt, fig = _figure(1.8 + 0.45 * values.shape[1], 1.4 + 0.32 * values.shape[0])
    ax = fig.add_subplot()
    vmin, vmax = scale or (None, None)
    im = ax.imshow(values, cmap="cividis", aspect="auto", interpolation="nearest", vmin=vmin, vmax=vmax)
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(values.shape[1]))
    ax.set_yticks(range(values.shape[0]))
    ax.set_title(title)
    if values.size <= 256:
        mid = ((vmax if vmax is not None else values.max()) + (vmin if vmin is not None else values.min())) / 2
        for (i, j), v in np.ndenumerate(values):
            ax.text(j, i, f"{v:.2g}", ha="center", va="center", fontsize=7, color="black" if v > mid else "white")
    fig.colorbar(im, ax=ax, label=unit)
    return _png(plt, fig)


def entropy_curves(layers: list[AttentionLayer]) -> bytes:
    """Per-layer mean attention entropy of both models and of the uniform distribution."""
    x = [layer.layer for layer in layers]
    plt, fig = _figure(6, 3.2)
    ax = fig.add_subplot()
    ax.plot(x, [layer.mean_entropy_original for layer in layers], "o-", color=OKABE_ITO[0], label="original")
    ax.plot(x, [layer.mean_entropy_converted for layer in layers], "s-", color=OKABE_ITO[1], label="converted")
    ax.plot(x, [layer.entropy_uniform for layer in layers], "--", color=OKABE_ITO[7], label="uniform (no information)")
    ax.set_xlabel("layer")
    ax.set_ylabel("attention entropy (nats)")
    ax.set_xticks(x)
    ax.set_title("Attention entropy per layer (closer to uniform = blurrier attention)")
    ax.legend(frameon=False)
    return _png(plt, fig)


def hidden_cosine_curve(layers: list[AttentionLayer]) -> bytes:
    x = [layer.layer for layer in layers]
    plt, fig = _figure(6, 3.0)
    ax = fig.add_subplot()
    ax.plot(x, [layer.hidden_cosine for layer in layers], "o-", color=OKABE_ITO[2])
    ax.set_xlabel("layer")
    ax.set_ylabel("cosine (original, converted)")
    ax.set_xticks(x)
    ax.set_ylim(min(0.0, min(layer.hidden_cosine for layer in layers)), 1.02)
    ax.set_title("Hidden-state cosine after each layer (1 = unchanged)")
    return _png(plt, fig)


def head_similarity_maps(layers: list[AttentionLayer], per_row: int = 4) -> bytes:
    """Per layer, the heads' H x H attention-pattern cosine: original | converted side by side,
    ``per_row`` layers to a row, one colour scale (0 to 1) for every panel."""
    import numpy as np

    n = len(layers)
    rows, cols = -(-n // per_row), 2 * min(per_row, n)
    plt, fig = _figure(1.5 * cols + 1.2, 1.7 * rows + 0.6)
    im = None
    for i, layer in enumerate(layers):
        pair = layer.head_similarity
        for j, similarity in enumerate((pair.original, pair.converted)):
            ax = fig.add_subplot(rows, cols, (i // per_row) * cols + 2 * (i % per_row) + j + 1)
            im = ax.imshow(np.array(similarity.matrix), cmap="cividis", vmin=0, vmax=1, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(f"L{layer.layer} {'orig' if j == 0 else 'conv'}", fontsize=8)
    fig.suptitle("Head diversity: cosine of the heads' attention patterns (1 = identical)", fontsize=10)
    fig.colorbar(im, ax=fig.axes, shrink=0.8, label="cosine")
    return _png(plt, fig, tight=False)  # tight_layout would fight the colour bar that spans every panel


def head_similarity_curve(layers: list[AttentionLayer]) -> bytes:
    """Mean head similarity per layer: original, converted, and the converted within / across KV groups."""
    x = [layer.layer for layer in layers]
    plt, fig = _figure(6, 3.2)
    ax = fig.add_subplot()
    sim = [layer.head_similarity for layer in layers]
    ax.plot(x, [s.original.mean for s in sim], "o-", color=OKABE_ITO[0], label="original")
    ax.plot(x, [s.converted.mean for s in sim], "s-", color=OKABE_ITO[1], label="converted")
    within, across = [s.converted.within_groups for s in sim], [s.converted.across_groups for s in sim]
    for values, style, colour, where in ((within, "^--", 2, "within"), (across, "v:", 3, "across")):
        if None not in values:
            ax.plot(x, values, style, color=OKABE_ITO[colour], label=f"converted, {where} KV groups")
    ax.set_xlabel("layer")
    ax.set_ylabel("mean cosine between heads")
    ax.set_xticks(x)
    ax.set_ylim(0, 1.02)
    ax.set_title("Head similarity per layer (higher = heads more alike)")
    ax.legend(frameon=False, fontsize=8)
    return _png(plt, fig)


def per_layer_heads(heads: list[int], layers: list[AttentionLayer] | None) -> bytes:
    """A per-layer budget: each layer's KV heads (bars) beside its mean attention KL (line)."""
    plt, fig = _figure(6, 3.2)
    ax = fig.add_subplot()
    x = list(range(len(heads)))
    ax.bar(x, heads, color=OKABE_ITO[5], label="KV heads")
    ax.set_xlabel("layer")
    ax.set_ylabel("KV heads")
    ax.set_xticks(x)
    if layers:
        ax2 = ax.twinx()
        ax2.plot(
            [layer.layer for layer in layers],
            [layer.mean_kl for layer in layers],
            "o-",
            color=OKABE_ITO[1],
            label="attention KL",
        )
        ax2.set_ylabel("attention KL (nats)")
        ax2.spines["right"].set_visible(True)
    ax.set_title("Per-layer KV budget: KV heads kept and what each layer's attention lost")
    return _png(plt, fig)


def head_sharing(groups: list[list[int]], num_heads: int) -> bytes:
    """Which query heads read each KV head: query heads on top, KV heads below, same colour."""
    plt, fig = _figure(max(5.5, 0.55 * num_heads + 1), 2.4)
    ax = fig.add_subplot()
    g = len(groups)
    for j, members in enumerate(groups):
        colour = OKABE_ITO[j % len(OKABE_ITO)]
        kv_x = (members[0] + members[-1]) / 2
        ax.add_patch(plt.Rectangle((kv_x - 0.4, 0), 0.8, 0.6, color=colour))
        ax.text(kv_x, 0.3, f"KV {j}", ha="center", va="center", color="white", fontsize=8)
        for h in members:
            ax.add_patch(plt.Rectangle((h - 0.4, 2), 0.8, 0.6, color=colour, alpha=0.85))
            ax.text(h, 2.3, f"q{h}", ha="center", va="center", color="white", fontsize=8)
            ax.plot([h, kv_x], [2, 0.6], color=colour, lw=1)
    ax.set_xlim(-0.7, num_heads - 0.3)
    ax.set_ylim(-0.2, 2.8)
    ax.axis("off")
    ax.set_title(f"{num_heads} query heads share {g} KV head{'s' if g > 1 else ''}", fontsize=10)
    return _png(plt, fig)


#: Tick ladders for log axes, finest first: mantissas repeated every decade.
LADDERS = ((1, 1.01, 1.02, 1.05, 1.1, 1.2, 1.5, 2, 3, 5), (1, 1.2, 1.5, 2, 3, 5), (1, 2, 5), (1,))


def log_ticks(values: list[float], most: int = 6) -> list[float]:
    """Labelled ticks for a log axis over ``values`` (positive): one at or below the smallest, one at
    or above the largest, the steps between from the finest ladder that needs at most ``most``."""
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    if not positive:
        return [1.0]
    low, high = min(positive), max(positive)
    decades = range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 2)
    for ladder in LADDERS:
        steps = sorted({float(f"{m * 10.0**d:.6g}") for d in decades for m in ladder})
        below = max(t for t in steps if t <= low * (1 + 1e-9))
        above = min(t for t in steps if t >= high * (1 - 1e-9))
        ticks = [t for t in steps if below <= t <= above]
        if len(ticks) <= most:
            return ticks if len(ticks) > 1 else [ticks[0], next(t for t in steps if t > ticks[0])]
    return ticks  # more than ``most`` decades: one tick each


def log_axis(ax: Any, values: list[float]) -> list[float]:
    """Put ``ax``'s y axis on a log scale whose labelled ticks cover ``values``; returns the ticks."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ticks = log_ticks(values)
    ax.set_yscale("log")
    ax.set_ylim(ticks[0] / 1.005, ticks[-1] * 1.005)
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(NullLocator())
    return ticks


def recovery_curves(runs: list[RunHistory]) -> bytes:
    """Held-out perplexity (ratio to the teacher when the log has one) and KL to the teacher
    against training tokens seen, one line per uptraining run."""
    evals = [e for run in runs for e in run.evals]
    with_kl = any(e.kl_mean is not None for e in evals)
    ratio = all(e.ppl_ratio is not None for e in evals)

    def shown(e: RunEval) -> float:
        return e.ppl_ratio if ratio else e.ppl  # type: ignore[return-value]

    plt, fig = _figure(10 if with_kl else 6, 3.4)
    axes = fig.subplots(1, 2 if with_kl else 1, squeeze=False)[0]
    for i, run in enumerate(runs):
        colour, marker = OKABE_ITO[i % len(OKABE_ITO)], "osD^v<>p"[i % 8]
        x = [e.tokens for e in run.evals]
        axes[0].plot(x, [shown(e) for e in run.evals], marker + "-", ms=3, color=colour, label=run.label)
        if with_kl:
            axes[1].plot(x, [e.kl_mean for e in run.evals], marker + "-", ms=3, color=colour, label=run.label)
    axes[0].set_ylabel("perplexity / teacher's" if ratio else "held-out perplexity")
    axes[0].set_title("Held-out perplexity during uptraining")
    if ratio:
        axes[0].axhline(1.0, ls="--", color=OKABE_ITO[7], lw=1, label="teacher (MHA)")
    if with_kl:
        axes[1].set_ylabel("mean KL(teacher ‖ student), nats")
        axes[1].set_title("Distance to the MHA parent")
    log_axis(axes[0], [shown(e) for e in evals] + ([1.0] if ratio else []))
    if with_kl:
        log_axis(axes[1], [e.kl_mean for e in evals if e.kl_mean])
    for ax in axes:
        ax.set_xlabel("training tokens seen")
    axes[0].legend(frameon=False, fontsize=8)
    return _png(plt, fig)


def quality_vs_kv(points: list[tuple[str, float, float]]) -> bytes:
    """Perplexity ratio against KV-cache bytes per token (share of the original's), one line per
    method: ``points`` are ``(method, KV share, ratio)``. The trade a conversion buys, at a glance."""
    plt, fig = _figure(8.0, 3.6)
    ax = fig.add_subplot()
    methods = sorted({m for m, _, _ in points}, key=lambda m: (m.endswith("+uptrain"), m))
    series: dict[tuple, list[str]] = {}  # recipes with the very same points share one line, named together
    for method in methods:
        series.setdefault(tuple(sorted((x, y) for m, x, y in points if m == method)), []).append(method)
    for i, (line, names) in enumerate(series.items()):
        xs, ys = zip(*line, strict=True)
        dashed = all(n.endswith("+uptrain") for n in names)
        ax.plot(
            [x * 100 for x in xs],
            ys,
            "osD^v<>p"[i % 8] + ("--" if dashed else "-"),
            color=OKABE_ITO[i % len(OKABE_ITO)],
            label=" = ".join(n or "(unknown)" for n in names),
        )
    ax.axhline(1.0, ls=":", color=OKABE_ITO[7], lw=1, label="original (MHA)")
    ax.set_xlabel("KV cache per token, % of the original")
    ax.set_ylabel("perplexity / original's")
    log_axis(ax, [y for _, _, y in points] + [1.0])
    if len({x for _, x, _ in points}) == 1:  # one KV share: show it on the whole 0-100% scale
        ax.set_xlim(0, 100)
    ax.set_title("Quality against KV-cache size (lower left is better)")
    # beside the axes, never over the lines: a sweep of several recipes has a long legend
    ax.legend(frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _png(plt, fig)
