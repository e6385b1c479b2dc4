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


def png(plt: Any, fig: Any, tight: bool = True) -> bytes:
    """The figure as PNG bytes (closed afterwards), marked as ours (``--overwrite`` recognises it)."""
    buf = io.BytesIO()
    if tight:
        fig.tight_layout()
    fig.savefig(buf, format="png", metadata={"Software": "mha2gqa"})
    plt.close(fig)
    return buf.getvalue()
