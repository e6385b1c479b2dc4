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
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from mha2gqa.core.cards import guard_summary
from mha2gqa.core.dims import contiguous_groups
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.output import check_destination, write_text
from mha2gqa.core.records import FILE_MARK
from mha2gqa.core.runlog import RunHistory
from mha2gqa.eval import plots
from mha2gqa.eval.results import HeadScore, Results
from mha2gqa.eval.tables import (
    gate_cell,
    overview_table,
    recovery_table,
    shared_original,
    tables,
    verdict_cell,
    worst,
)
from mha2gqa.eval.verdict import SHOWN, SOURCE, THRESHOLDS


def load_results(paths: list[Path]) -> list[Results]:
    return [Results.load(p) for p in paths]


#: the heat maps of each comparison: name -> (the cell of a head, title, colour-bar unit)
HEATMAPS: dict[str, tuple[Callable[[HeadScore], float], str, str]] = {
    "attention_kl": (lambda h: h.kl, "Attention KL(original ‖ converted) per head", "KL (nats)"),
    "head_output_error": (
        lambda h: h.error,
        "Head contribution error (output through o_proj)",
        "‖Δ(o·W_o)‖ / ‖o·W_o‖",
    ),
}


def _cells(r: Results, cell: Callable[[HeadScore], float]) -> list[list[float]]:
    """``[layer][head]`` values of one heat map (none without attention figures)."""
    return [[cell(h) for h in x.heads] for x in r.attention.layers] if r.attention else []


def shared_scales(results: list[Results]) -> dict[str, tuple[float, float]]:
    """One colour scale per heat map over every comparison of the report."""
    values = {
        name: [v for r in results for row in _cells(r, cell) for v in row] for name, (cell, _, _) in HEATMAPS.items()
    }
    return {k: (min(v), max(v)) for k, v in values.items() if v}


def figures(r: Results, scales: dict[str, tuple[float, float]] | None = None) -> dict[str, bytes]:
    """Figure name -> PNG bytes for one results file (pairs only), heat maps on ``scales``."""
    att, scales = r.attention, scales or {}
    out: dict[str, bytes] = {}
    if att is not None:
        layers = att.layers
        for name, (cell, title, unit) in HEATMAPS.items():
            out[name] = plots.heatmap(_cells(r, cell), title, unit, scales.get(name))
        out["entropy"] = plots.entropy_curves(layers)
        out["hidden_cosine"] = plots.hidden_cosine_curve(layers)
        if all(x.head_similarity is not None for x in layers):
            out["head_similarity_curve"] = plots.head_similarity_curve(layers)
            out["head_similarity"] = plots.head_similarity_maps(layers)
    conv = r.converted
    if conv and conv.kv_heads_per_layer:
        out["per_layer_heads"] = plots.per_layer_heads(conv.kv_heads_per_layer, att.layers if att else None)
    elif conv:  # one count for every layer: which query heads share each KV head
        h, g = conv.num_heads, conv.num_kv_heads
        groups = (conv.conversion.query_heads_per_kv_head if conv.conversion else None) or contiguous_groups(h, g)
        out["head_sharing"] = plots.head_sharing(groups, h)
    return out


def quality_chart(results: list[Results]) -> bytes | None:
    """Perplexity ratio against KV share, one line per recipe (pairs only): :func:`quality_points`."""
    points = quality_points(results)
    return plots.quality_vs_kv(points) if points else None


def quality_points(results: list[Results]) -> list[tuple[str, float, float]]:
    """``(series, KV share, perplexity ratio)`` of each pair; results against different originals or
    texts are drawn apart (each series named with its basis), never joined in one line."""
    bases = list(dict.fromkeys(r.basis for r in results))
    return [
        (
            r.converted.recipe + (f" [{r.basis_line}]" if len(bases) > 1 else ""),
            r.converted.kv_cache_bytes_per_token / r.original.kv_cache_bytes_per_token,
            r.headline.ppl_ratio,
        )
        for r in results
        if r.converted is not None and r.headline.ppl_ratio is not None
    ]


def bases_lines(results: list[Results]) -> list[str]:
    """What the report joins: one line per basis (original, text, tokens) and the results on it; a
    warning first where there is more than one (their figures are not comparable)."""
    groups: dict[tuple, list[Results]] = {}
    for r in results:
        groups.setdefault(r.basis, []).append(r)
    if len(groups) == 1:
        return [f"every result: {results[0].basis_line}"]
    lines = [f"these {len(results)} results are measured on {len(groups)} different bases: compare within one"]
    lines += [f"{rs[0].basis_line}: {', '.join(r.title for r in rs)}" for rs in groups.values()]
    return lines


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#222;line-height:1.45}h1{font-size:1.6em}h2{border-bottom:2px solid #0072B2;padding-bottom:.2em;margin-top:2em}
table{border-collapse:collapse;margin:.6em 0;font-size:.92em}
th,td{border:1px solid #ccc;padding:.3em .6em;text-align:right}th{background:#eef4fa}
td:first-child,th:first-child,td.text,th.text{text-align:left}img{max-width:100%;margin:.4em 0;border:1px solid #eee}
.meta{color:#555;font-size:.9em}.pass{color:#0B6E2E;font-weight:bold}.borderline{color:#7A5A00;font-weight:bold}
.fail{color:#A3142E;font-weight:bold}.not-valid{color:#333;font-weight:bold}
.verdict{padding:.6em 1em;border-radius:6px;font-weight:bold;margin:1em 0;border-left:8px solid}
.verdict.pass{background:#DDF2E3;border-color:#117733}.verdict.borderline{background:#FFF1C7;border-color:#DDAA33}
.verdict.fail{background:#F9DDE3;border-color:#BB2244}.verdict.mixed{background:#EEF4FA;border-color:#0072B2}.verdict.not-valid{background:#E6E6E6;border-color:#555;
border-left-style:dashed}
.wide{overflow-x:auto}details{border:1px solid #ddd;border-radius:6px;padding:.3em .8em;margin:.8em 0}
summary{cursor:pointer;font-size:1.15em;font-weight:600;padding:.3em 0}nav a{margin-right:1em}ul.worst{font-size:.92em}
"""


def _meta(r: Results) -> str:
    dev = r.device
    return (
        f"device {dev.type} {dev.dtype} · "
        f"mha2gqa {r.versions.get('mha2gqa', '?')}, transformers {r.versions.get('transformers', '?')} · "
        f"{r.created}"
    )


FIGURE_CAPTIONS = {
    "attention_kl": "Where attention changed: KL divergence of each head's attention rows (darker = closer).",
    "quality": "What the KV-cache saving cost: perplexity ratio against KV bytes per token, one line per recipe.",
    "head_output_error": "What each head now adds to the residual stream: the relative error of its output "
    "through its columns of the output projection (comparable across methods that rewrite q_proj/o_proj).",
    "entropy": "Attention entropy per layer; converted rows drifting toward the uniform line have lost focus.",
    "hidden_cosine": "How far the residual stream drifts, layer by layer.",
    "head_sharing": "Which query heads share each KV head.",
    "per_layer_heads": "The per-layer budget: how many KV heads each layer kept, beside its attention KL.",
    "head_similarity_curve": "Did the heads lose their diversity? Mean cosine between the heads' attention "
    "patterns per layer; sharing K/V makes the heads of a group alike.",
    "head_similarity": "Head diversity per layer: the cosine of every pair of heads' attention patterns, "
    "original | converted (bright off the diagonal = heads that attend alike).",
    "recovery": "Held-out perplexity and KL to the MHA parent as uptraining proceeds (log scale).",
}


def load_runs(paths: list[Path]) -> list[RunHistory]:
    """Uptraining logs (``uptrain_log.jsonl`` or the ``--output`` folder holding one), each read
    whole and checked (:class:`~mha2gqa.core.runlog.RunHistory`), labelled by its run folder."""
    return [RunHistory.read(Path(p)) for p in paths]


def _figure(
    name: str,
    png: bytes,
    stem: str,
    fig_dir: Path | None,
    parts_html: list[str],
    parts_md: list[str],
    element_id: str | None = None,
) -> None:
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


def _css(shown: str) -> str:
    """The CSS class of a verdict as shown (``not valid`` -> ``not-valid``)."""
    return shown.replace(" ", "-")


def _verdict(results: list[Results]) -> list[tuple[str, str]]:
    """The first lines of the report, ``(css class, sentence)``: the verdict over every comparison
    (one: its sentence; several: how many in each tier and the worst), then the gates' result."""
    lines: list[tuple[str, str]] = []
    judged = [(r, v) for r in results if (v := r.judge()) is not None]
    if len(judged) == 1:
        sentence = judged[0][1].sentence()
        lines.append((_css(judged[0][1].shown), sentence[0].upper() + sentence[1:]))
    elif judged:
        counts = Counter(v.shown for _, v in judged)
        worst_tier = max(counts, key=SHOWN.index)
        tally = ", ".join(f"{counts[t]} {t}" for t in SHOWN if counts[t])
        best = min(judged, key=lambda rv: (SHOWN.index(rv[1].shown), rv[0].headline.ppl_ratio or 1))[0]
        if len(counts) == 1:  # every comparison in one tier: the page is that colour
            lines.append((_css(worst_tier), f"Verdicts: {tally}"))
        else:  # a sweep: its best result first, the tally after, in no tier's colour
            lines.append(("mixed", f"Best: {best.title}, {verdict_cell(best)}. Verdicts: {tally}"))
    gated = [r for r in results if r.gates]
    if gated:
        failed = [f"{r.title} ({gate_cell(r).removeprefix('FAIL: ')})" for r in gated if not r.gates.passed]
        if failed:
            lines.append(("fail", f"GATES FAILED in {len(failed)} of {len(gated)}: " + "; ".join(failed)))
        else:
            lines.append(("pass", f"All gates passed ({len(gated)} comparison{'s' if len(gated) > 1 else ''})"))
    return lines


def render(
    results: list[Results],
    html_path: Path | None = None,
    md_path: Path | None = None,
    runs: list[RunHistory] | None = None,
    overwrite: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict[str, Path]:
    """Write the HTML page and/or the Markdown summary (its figures in ``<stem>_files/``);
    ``runs`` (from :func:`load_runs`) add the uptraining recovery curves. Both destinations are
    checked first: neither may be an input, and an existing one is replaced only with ``overwrite``
    and only when mha2gqa wrote it.

    The first screen decides: the gates' verdict, one overview table of every comparison (linked to
    its section), the quality-vs-KV-cache chart and the worst layers and heads; the sections below
    are collapsed, and heat maps share one colour scale per metric across them."""
    inputs = {f"the input {r.path}": r.path for r in results if r.path}
    for path, what in ((html_path, "--html"), (md_path, "--md")):
        if path is not None:
            check_destination(path, overwrite, inputs, what, folder=False)
    page = _Page(md_path.with_name(md_path.stem + "_files") if md_path else None)
    page.overview(results, runs)
    if runs:
        page.recovery(runs)
    scales = shared_scales(results)
    for i, r in enumerate(results):
        if log is not None:
            log(f"  report: {r.title} ({i + 1}/{len(results)})")
        page.comparison(i, r, scales)
    written: dict[str, Path] = {}
    if html_path is not None:
        head = f"<meta charset='utf-8'><title>mha2gqa report</title><style>{CSS}</style>"
        body = "\n".join(page.html)
        write_text(
            html_path, f"<!doctype html>{FILE_MARK}<html><head>{head}</head><body>{body}</body></html>\n", "--html"
        )
        written["html"] = html_path
    if md_path is not None:
        write_text(md_path, FILE_MARK + "\n" + "\n".join(page.md) + "\n", "--md")
        written["md"] = md_path
    return written


def render_files(
    results: list[Path],
    runs: list[Path],
    html_path: Path | None = None,
    md_path: Path | None = None,
    overwrite: bool = False,
) -> dict[str, Path]:
    """``mha2gqa report``: read eval ``results`` files and uptraining ``runs`` (every file validated
    before anything is written) and :func:`render` them; without a destination the page goes beside
    the first input, with ``.html``."""
    if not results and not runs:
        raise Mha2GqaError("nothing to report: give eval RESULTS files and/or --uptrain RUN")
    loaded, logs = load_results(results), load_runs(runs)
    if html_path is None and md_path is None:
        first = results[0] if results else (runs[0] / "report" if runs[0].is_dir() else runs[0])
        html_path = first.with_suffix(".html")
    return render(loaded, html_path, md_path, logs, overwrite=overwrite)


class _Page:
    """The report's HTML and Markdown, built side by side."""

    def __init__(self, fig_dir: Path | None) -> None:
        self.fig_dir = fig_dir
        self.html = ["<h1>mha2gqa conversion report</h1>"]
        self.md = ["# mha2gqa conversion report", ""]

    def figure(self, name: str, png: bytes, stem: str, element_id: str | None = None) -> None:
        _figure(name, png, stem, self.fig_dir, self.html, self.md, element_id)

    def table(self, title: str, anchor: str, table) -> None:
        self.html += [f'<h3 id="{anchor}">{html.escape(title)}</h3>', table.html()]
        self.md += [f"### {title}", "", table.markdown(), ""]

    def overview(self, results: list[Results], runs) -> None:
        if results:
            self.html.append(f'<p class="meta">{html.escape(_meta(results[0]))}</p>')
            joined = bases_lines(results)
            css = "meta" if len(joined) == 1 else "verdict borderline"
            self.html += [f'<p class="{css}">{html.escape(line)}</p>' for line in joined]
            self.md += [f"_{line}_" for line in joined] + [""]
        flagged: dict[str, list[str]] = {}
        for r in results:
            if r.overlap_warning:
                flagged.setdefault(r.overlap_warning, []).append(r.title)
        warnings = [("borderline", f"Warning, {', '.join(titles)}: {w}") for w, titles in flagged.items()]
        for css, sentence in [*_verdict(results), *warnings]:
            self.html.append(f'<div class="verdict {css}">{html.escape(sentence)}</div>')
            self.md += [f"**{sentence}**", ""]
        if results and any(r.converted for r in results):
            limits = [
                f"{t.figure} pass {t.sign} {t.passing:g}, borderline {t.sign} {t.borderline:g}" for t in THRESHOLDS
            ]
            how = f"verdict thresholds (why: mha2gqa's {SOURCE}): " + "; ".join(limits)
            self.html.append(f'<p class="meta">{html.escape(how)}</p>')
            self.md += [f"_{how}_", ""]
        original = shared_original(results)
        if original and len(results) > 1:
            self.html.append(f'<p class="meta">every comparison against {html.escape(original)}</p>')
        links = [("#overview", "Overview")] + ([("#uptraining", "Uptraining")] if runs else [])
        links += [(f"#result-{i}", r.title) for i, r in enumerate(results)]
        self.html.append("<nav>" + "".join(f'<a href="{h}">{html.escape(t)}</a>' for h, t in links) + "</nav>")
        table = overview_table(results, runs)
        self.html += ['<h2 id="overview">Overview</h2>', f'<div class="wide">{table.html()}</div>']
        self.md += ["## Overview", "", table.markdown(), ""]
        chart = quality_chart(results)
        if chart is not None:
            self.figure("quality", chart, "quality")
        notes = [(r.title, worst(r)) for r in results if worst(r)]
        if notes:
            self.html.append(
                '<ul class="worst">'
                + "".join(f"<li><b>{html.escape(t)}</b>: {html.escape(n)}</li>" for t, n in notes)
                + "</ul>"
            )
            self.md += [f"- **{t}**: {n}" for t, n in notes] + [""]

    def recovery(self, runs) -> None:
        table = recovery_table(runs)
        self.html += ['<details id="uptraining"><summary>Uptraining recovery</summary>', table.html()]
        self.md += ["## Uptraining recovery", "", table.markdown(), ""]
        if any(run.evals for run in runs):
            self.figure("recovery", plots.recovery_curves([run for run in runs if run.evals]), "recovery")
        self.html.append("</details>")

    def comparison(self, i: int, r: Results, scales: dict[str, tuple[float, float]]) -> None:
        self.html += [
            f'<details id="result-{i}"><summary>{html.escape(r.title)}</summary>',
            f'<p class="meta">{html.escape(_meta(r))}</p>',
        ]
        self.md += [f"## {r.title}", "", f"_{_meta(r)}_", ""]
        if worst(r):
            self.html.append(f'<p class="meta">{html.escape(worst(r))}</p>')
        guard = r.converted.conversion.guard if r.converted and r.converted.conversion else None
        if guard is not None:  # what the conversion's stage guard kept and undid
            line = f"Stage guard: {guard_summary(guard)}"
            self.html.append(f'<p class="meta">{html.escape(line)}</p>')
            self.md += [f"_{line}_", ""]
        for name, table in tables(r).items():
            self.table(name, f"{re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')}-{i}", table)
        for name, png in figures(r, scales).items():
            self.figure(name, png, f"{i}_{name}", element_id=f"{name}-{i}")
        self.html.append("</details>")
