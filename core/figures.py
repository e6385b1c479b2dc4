"""Figure helpers shared by every plot (matplotlib, Agg backend, imported only when drawing):
PNG bytes carrying mha2gqa's mark, and the colour-blind-safe Okabe-Ito palette."""

from __future__ import annotations

import io
from typing import Any

OKABE_ITO = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#F0E442", "#000000"]


def figure(width: float, height: float) -> tuple[Any, Any]:
    """``(pyplot, a new figure)`` of ``width`` x ``height`` inches with the house style."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "axes.spines.top": False, "axes.spines.right": False})
    return plt, plt.figure(figsize=(width, height), dpi=110)


def fit_titles(fig: Any) -> None:
    """Wrap every axes title (and the figure's) onto as many lines as its width needs, so no title
    runs past its frame whatever the figure's size."""
    import textwrap

    fig.canvas.draw()  # lay out first: the titles' rendered widths
    renderer = fig.canvas.get_renderer()
    pieces = [(ax.title, ax.get_window_extent(renderer).width) for ax in fig.axes if ax.get_title()]
    if fig._suptitle is not None:
        pieces.append((fig._suptitle, fig.bbox.width))
    for text, room in pieces:
        width = text.get_window_extent(renderer).width
        if width > room * 0.98:
            chars = len(text.get_text())
            text.set_text(textwrap.fill(text.get_text(), max(12, int(chars * room * 0.95 / width))))


def png(plt: Any, fig: Any, tight: bool = True) -> bytes:
    """The figure as PNG bytes (closed afterwards), marked as ours (``--overwrite`` recognises it);
    titles wrapped to their frames (:func:`fit_titles`)."""
    buf = io.BytesIO()
    fit_titles(fig)
    if tight:
        fig.tight_layout()
    fig.savefig(buf, format="png", metadata={"Software": "mha2gqa"})
    plt.close(fig)
    return buf.getvalue()
