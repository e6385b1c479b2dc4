"""The quality-regression report: a self-contained HTML page (figures embedded) and Markdown.

One or more results files (``mha2gqa eval --output``) go in; each pair gets perplexity per
protocol, output agreement, attention heat maps (KL and head-output error, layer x head), entropy
and hidden-state curves, a head-sharing diagram and the KV-cache trade, and an overview table
compares them when there are several. Every number comes from the results files as recorded
(:mod:`mha2gqa.eval.results`); the tables are built in :mod:`mha2gqa.eval.tables`.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.output import check_destination, write_text
from mha2gqa.core.records import FILE_MARK
from mha2gqa.core.runlog import read_log
from mha2gqa.eval import plots
from mha2gqa.eval.results import Results
from mha2gqa.eval.tables import overview_table, recovery_table, tables


def load_results(paths: list[Path]) -> list[Results]:
    return [Results.load(p) for p in paths]


def figures(r: Results) -> dict[str, bytes]:
    """Figure name -> PNG bytes for one results file (pairs only)."""
    att = r.attention
    out: dict[str, bytes] = {}
    if att and att.get("layers"):
        layers = att["layers"]
        out["attention_kl"] = plots.heatmap(layers, "kl", "Attention KL(original ‖ converted) per head", "KL (nats)")
        out["head_output_error"] = plots.heatmap(layers, "output_rel_error", "Head output relative error", "‖Δo‖ / ‖o‖")
        out["entropy"] = plots.entropy_curves(layers)
        out["hidden_cosine"] = plots.hidden_cosine_curve(layers)
    conv = r.converted
    if conv:
        h, g = conv.num_heads, conv.num_kv_heads
        groups = (conv.conversion or {}).get("query_heads_per_kv_head") or [
            list(range(j * h // g, (j + 1) * h // g)) for j in range(g)
        ]
        out["head_sharing"] = plots.head_sharing(groups, h)
    return out


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#222;line-height:1.45}h1{font-size:1.6em}h2{border-bottom:2px solid #0072B2;padding-bottom:.2em;margin-top:2em}
table{border-collapse:collapse;margin:.6em 0;font-size:.92em}
th,td{border:1px solid #ccc;padding:.3em .6em;text-align:right}th{background:#eef4fa}
td:first-child,th:first-child{text-align:left}img{max-width:100%;margin:.4em 0;border:1px solid #eee}
.meta{color:#555;font-size:.9em}.fail{color:#D55E00;font-weight:bold}.pass{color:#009E73;font-weight:bold}
"""


def _meta(r: Results) -> str:
    d, dev = r.data, r.device
    return (f"data {d['source']} ({d['stream_tokens']:,} tokens) · device {dev['type']} {dev['dtype']} · "
            f"mha2gqa {r.versions.get('mha2gqa', '?')}, transformers {r.versions.get('transformers', '?')} · "
            f"{r.created}")  # fmt: skip


FIGURE_CAPTIONS = {
    "attention_kl": "Where attention changed: KL divergence of each head's attention rows (darker = closer).",
    "head_output_error": "What each head now returns: relative error of its output.",
    "entropy": "Attention entropy per layer; converted rows drifting toward the uniform line have lost focus.",
    "hidden_cosine": "How far the residual stream drifts, layer by layer.",
    "head_sharing": "Which query heads share each KV head.",
    "recovery": "Held-out perplexity and KL to the MHA parent as uptraining proceeds (log scale).",
}


def load_runs(paths: list[Path]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Uptraining logs (``uptrain_log.jsonl`` or the ``--output`` folder holding one) as
    ``(label, records)``; the label is the run folder's name."""
    out = []
    for p in paths:
        records = read_log(Path(p))
        if not records or records[0].get("type") != "start":
            raise Mha2GqaError(f"{p}: not a log of `mha2gqa uptrain` (no start record)")
        folder = Path(p) if Path(p).is_dir() else Path(p).parent
        out.append((folder.resolve().name, records))
    return out


def _figure(name: str, png: bytes, stem: str, fig_dir: Path | None, parts_html: list[str], parts_md: list[str],
            element_id: str | None = None) -> None:  # fmt: skip
    """Append figure ``name`` (captioned): embedded in the HTML, and as ``fig_dir/<stem>.png`` linked
    from the Markdown when there is a Markdown file."""
    caption = FIGURE_CAPTIONS[name]
    parts_html.append(
        f'<figure id="{element_id or name}"><img alt="{name}" src="data:image/png;base64,'
        f'{base64.b64encode(png).decode()}"><figcaption>{html.escape(caption)}</figcaption></figure>'
    )
    if fig_dir is not None:
        fig_dir.mkdir(parents=True, exist_ok=True)
        write_text(fig_dir / f"{stem}.png", png, "--md")
        parts_md += [f"![{caption}]({fig_dir.name}/{stem}.png)", ""]


def render(
    results: list[Results],
    html_path: Path | None = None,
    md_path: Path | None = None,
    runs: list[tuple[str, list[dict[str, Any]]]] | None = None,
    overwrite: bool = True,
) -> dict[str, Path]:
    """Write the HTML page and/or the Markdown summary (its figures in ``<stem>_files/``);
    ``runs`` (from :func:`load_runs`) add the uptraining recovery curves. Both destinations are
    checked first: neither may be an input, and an existing one is replaced only with ``overwrite``
    and only when mha2gqa wrote it."""
    inputs = {f"the input {r.path}": r.path for r in results if r.path}
    for path, what in ((html_path, "--html"), (md_path, "--md")):
        if path is not None:
            check_destination(path, overwrite, inputs, what, folder=False)
    written: dict[str, Path] = {}
    parts_html = ["<h1>mha2gqa conversion report</h1>"]
    parts_md = ["# mha2gqa conversion report", ""]
    fig_dir = md_path.with_name(md_path.stem + "_files") if md_path else None
    if runs:
        table = recovery_table(runs)
        curves = [(label, [r for r in recs if r.get("type") == "eval"]) for label, recs in runs]
        parts_html += ['<h2 id="uptraining">Uptraining recovery</h2>', table.html()]
        parts_md += ["## Uptraining recovery", "", table.markdown(), ""]
        if any(evals for _, evals in curves):
            png = plots.recovery_curves([c for c in curves if c[1]])
            _figure("recovery", png, "recovery", fig_dir, parts_html, parts_md)
    if len(results) > 1:
        table = overview_table(results)
        parts_html += ['<h2 id="overview">Overview</h2>', table.html()]
        parts_md += ["## Overview", "", table.markdown(), ""]
    for i, r in enumerate(results):
        parts_html += [
            f'<h2 id="result-{i}">{html.escape(r.title)}</h2>',
            f'<p class="meta">{html.escape(_meta(r))}</p>',
        ]
        parts_md += [f"## {r.title}", "", f"_{_meta(r)}_", ""]
        for name, table in tables(r).items():
            anchor = name.lower().replace(" ", "-")
            parts_html += [f'<h3 id="{anchor}-{i}">{html.escape(name)}</h3>', table.html()]
            parts_md += [f"### {name}", "", table.markdown(), ""]
        for name, png in figures(r).items():
            _figure(name, png, f"{i}_{name}", fig_dir, parts_html, parts_md, element_id=f"{name}-{i}")
    if html_path is not None:
        head = f"<meta charset='utf-8'><title>mha2gqa report</title><style>{CSS}</style>"
        page = f"<!doctype html>{FILE_MARK}<html><head>{head}</head><body>"
        write_text(html_path, page + "\n".join(parts_html) + "</body></html>\n", "--html")
        written["html"] = html_path
    if md_path is not None:
        write_text(md_path, FILE_MARK + "\n" + "\n".join(parts_md) + "\n", "--md")
        written["md"] = md_path
    return written
