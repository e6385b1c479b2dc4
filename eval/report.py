"""The quality-regression report: a self-contained HTML page (figures embedded) and Markdown.

One or more results files (``mha2gqa eval --output``) go in; each pair gets perplexity per
protocol, output agreement, attention heat maps (KL and head-output error, layer x head), entropy
and hidden-state curves, a head-sharing diagram and the KV-cache trade, and an overview table
compares them when there are several.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from mha2gqa.convert.planning import format_bytes
from mha2gqa.errors import Mha2GqaError
from mha2gqa.eval import plots

SEQ_LENS = (2048, 8192, 32768)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def load_results(paths: list[Path]) -> list[dict[str, Any]]:
    out = []
    for p in paths:
        try:
            r = json.loads(Path(p).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise Mha2GqaError(f"{p}: cannot read results JSON ({e})") from None
        if not isinstance(r, dict) or not str(r.get("schema", "")).startswith("mha2gqa.eval/"):
            raise Mha2GqaError(f"{p}: not a results file of `mha2gqa eval --output`")
        r["_path"] = str(p)
        out.append(r)
    return out


def _title(r: dict[str, Any]) -> str:
    m = r["models"]
    if "converted" not in m:
        return Path(m["original"]["path"]).name
    return f"{Path(m['converted']['path']).name} vs {Path(m['original']['path']).name}"


def kv_rows(r: dict[str, Any]) -> list[list[str]]:
    """KV cache per token and per sequence for each model, in the dtype it was evaluated in."""
    rows = []
    for name, m in r["models"].items():
        b = _DTYPE_BYTES.get(m["dtype"], 4)
        per_token = 2 * m["num_layers"] * m["num_kv_heads"] * m["head_dim"] * b
        rows.append(
            [name, str(m["num_kv_heads"]), m["dtype"], f"{per_token:,}"]
            + [format_bytes(per_token * t) for t in SEQ_LENS]
        )
    if len(rows) == 2:
        a, c = (int(x[3].replace(",", "")) for x in rows)
        rows.append(["saving", "", "", f"{1 - c / a:.1%}"] + [f"{1 - c / a:.1%}"] * len(SEQ_LENS))
    return rows


def tables(r: dict[str, Any]) -> dict[str, tuple[list[str], list[list[str]]]]:
    """Every table of one results file: title -> (header, rows)."""
    pair = "converted" in r["models"]
    out: dict[str, tuple[list[str], list[list[str]]]] = {}
    head = ["protocol", "original PPL"] + (["converted PPL", "ratio"] if pair else []) + ["tokens", "settings"]
    rows = []
    for name, p in r["protocols"].items():
        row = [name, f"{p['original']['ppl']:.4f}"]
        if pair:
            row += [f"{p['converted']['ppl']:.4f}", f"{p['ppl_ratio']:.3f}x"]
        s = p["settings"]
        detail = f"seq_len {s['seq_len']}" + (f", stride {s['stride']}" if "stride" in s else "")
        if name == "rolling":
            detail += ", bits/byte " + " → ".join(
                f"{p[m]['bits_per_byte']:.4f}" for m in ("original", "converted") if m in p
            )
        rows.append([*row, f"{p['original']['tokens']:,}", detail])
    out["Perplexity"] = (head, rows)
    a = r.get("agreement")
    if a and a.get("kl"):
        kl = a["kl"]
        out["Output agreement"] = (
            ["KL mean", "median", "q90", "q95", "q99", "q99.9", "max", "top-1 agreement", "NLL delta", "tokens"],
            [[f"{kl['mean']:.4f}", f"{kl['median']:.4f}", f"{kl['q90']:.4f}", f"{kl['q95']:.4f}", f"{kl['q99']:.4f}",
              f"{kl['q99_9']:.4f}", f"{kl['max']:.4f}", f"{a['top1_agreement']:.2%}", f"{a['nll_delta']:+.4f}",
              f"{a['tokens']:,}"]],
        )  # fmt: skip
    att = r.get("attention")
    if att:
        out["Attention per layer"] = (
            ["layer", "KL", "JS", "row cosine", "entropy orig.", "entropy conv.", "uniform", "head output error",
             "hidden cosine"],
            [[str(x["layer"]), f"{x['mean_kl']:.4f}", f"{x['mean_js']:.4f}", f"{x['mean_cosine']:.4f}",
              f"{x['mean_entropy_original']:.3f}", f"{x['mean_entropy_converted']:.3f}", f"{x['entropy_uniform']:.3f}",
              f"{x['mean_output_rel_error']:.4f}", f"{x['hidden_cosine']:.4f}"] for x in att["layers"]],
        )  # fmt: skip
    out["KV cache"] = (
        ["model", "KV heads", "dtype", "bytes/token"] + [f"at {t:,} tokens" for t in SEQ_LENS],
        kv_rows(r),
    )
    if r.get("gates"):
        out["Gates"] = (["gate", "value", "limit", "result"],
                        [[g["name"], f"{g['value']:.4g}", f"{g['op']} {g['limit']:.4g}",
                          "pass" if g["passed"] else "FAIL"]
                         for g in r["gates"]["checks"]])  # fmt: skip
    return out


def figures(r: dict[str, Any]) -> dict[str, bytes]:
    """Figure name -> PNG bytes for one results file (pairs only)."""
    att = r.get("attention")
    out: dict[str, bytes] = {}
    if att and att.get("layers"):
        layers = att["layers"]
        out["attention_kl"] = plots.heatmap(layers, "kl", "Attention KL(original ‖ converted) per head", "KL (nats)")
        out["head_output_error"] = plots.heatmap(layers, "output_rel_error", "Head output relative error", "‖Δo‖ / ‖o‖")
        out["entropy"] = plots.entropy_curves(layers)
        out["hidden_cosine"] = plots.hidden_cosine_curve(layers)
    conv = r["models"].get("converted")
    if conv:
        h, g = conv["num_heads"], conv["num_kv_heads"]
        groups = (conv.get("conversion") or {}).get("query_heads_per_kv_head") or [
            list(range(j * h // g, (j + 1) * h // g)) for j in range(g)
        ]
        out["head_sharing"] = plots.head_sharing(groups, h)
    return out


def overview(results: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    rows = []
    for r in results:
        conv = r["models"].get("converted", {})
        p = r["protocols"].get("disjoint") or next(iter(r["protocols"].values()))
        a = r.get("agreement") or {}
        rows.append([
            _title(r), str(conv.get("num_kv_heads", "")), (conv.get("conversion") or {}).get("method", ""),
            f"{p.get('ppl_ratio', 1):.3f}x", f"{a['kl']['mean']:.4f}" if a.get("kl") else "",
            f"{a['top1_agreement']:.2%}" if a else "",
        ])  # fmt: skip
    return ["comparison", "KV heads", "method", "PPL ratio", "KL mean", "top-1"], rows


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#222;line-height:1.45}h1{font-size:1.6em}h2{border-bottom:2px solid #0072B2;padding-bottom:.2em;margin-top:2em}
table{border-collapse:collapse;margin:.6em 0;font-size:.92em}
th,td{border:1px solid #ccc;padding:.3em .6em;text-align:right}th{background:#eef4fa}
td:first-child,th:first-child{text-align:left}img{max-width:100%;margin:.4em 0;border:1px solid #eee}
.meta{color:#555;font-size:.9em}.fail{color:#D55E00;font-weight:bold}.pass{color:#009E73;font-weight:bold}
"""


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    def cell(c: str) -> str:
        cls = ' class="fail"' if c == "FAIL" else (' class="pass"' if c == "pass" else "")
        return f"<td{cls}>{html.escape(c)}</td>"

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(cell(c) for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _meta(r: dict[str, Any]) -> str:
    d, dev = r["data"], r["device"]
    return (f"data {d['source']} ({d['stream_tokens']:,} tokens) · device {dev['type']} {dev['dtype']} · "
            f"mha2gqa {r['versions'].get('mha2gqa', '?')}, transformers {r['versions'].get('transformers', '?')} · "
            f"{r['created']}")  # fmt: skip


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
    from mha2gqa.uptrain.trainer import read_log

    out = []
    for p in paths:
        records = read_log(Path(p))
        if not records or records[0].get("type") != "start":
            raise Mha2GqaError(f"{p}: not a log of `mha2gqa uptrain` (no start record)")
        folder = Path(p) if Path(p).is_dir() else Path(p).parent
        out.append((folder.resolve().name, records))
    return out


def recovery_table(runs: list[tuple[str, list[dict[str, Any]]]]) -> tuple[list[str], list[list[str]]]:
    """One row per uptraining run: what trained, how long, and held-out quality before -> after."""
    rows = []
    for label, records in runs:
        s = records[0]["settings"]
        evals = [r for r in records if r.get("type") == "eval"]
        steps = max((r.get("step", 0) for r in records), default=0)
        row = [label, s["objective"], s["train"], f"{steps:,} / {s['max_steps']:,}",
               f"{steps * records[0]['tokens_per_step']:,}"]  # fmt: skip
        if evals:
            a, b = evals[0], evals[-1]
            row.append(f"{a['ppl']:.3f} → {b['ppl']:.3f}")
            row.append(f"{a['ppl_ratio']:.3f}x → {b['ppl_ratio']:.3f}x" if "ppl_ratio" in b else "")
            row.append(f"{a['kl_mean']:.4f} → {b['kl_mean']:.4f}" if "kl_mean" in b else "")
        else:
            row += ["(no --eval-data)", "", ""]
        rows.append(row)
    return ["run", "objective", "trains", "steps", "tokens", "held-out PPL", "vs teacher", "KL"], rows


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
        (fig_dir / f"{stem}.png").write_bytes(png)
        parts_md += [f"![{caption}]({fig_dir.name}/{stem}.png)", ""]


def render(
    results: list[dict[str, Any]],
    html_path: Path | None = None,
    md_path: Path | None = None,
    runs: list[tuple[str, list[dict[str, Any]]]] | None = None,
) -> dict[str, Path]:
    """Write the HTML page and/or the Markdown summary (its figures in ``<stem>_files/``);
    ``runs`` (from :func:`load_runs`) add the uptraining recovery curves."""
    written: dict[str, Path] = {}
    parts_html = ["<h1>mha2gqa conversion report</h1>"]
    parts_md = ["# mha2gqa conversion report", ""]
    fig_dir = md_path.with_name(md_path.stem + "_files") if md_path else None
    if runs:
        header, rows = recovery_table(runs)
        curves = [(label, [r for r in recs if r.get("type") == "eval"]) for label, recs in runs]
        parts_html += ['<h2 id="uptraining">Uptraining recovery</h2>', _html_table(header, rows)]
        parts_md += ["## Uptraining recovery", "", _md_table(header, rows), ""]
        if any(evals for _, evals in curves):
            png = plots.recovery_curves([c for c in curves if c[1]])
            _figure("recovery", png, "recovery", fig_dir, parts_html, parts_md)
    if len(results) > 1:
        header, rows = overview(results)
        parts_html += ['<h2 id="overview">Overview</h2>', _html_table(header, rows)]
        parts_md += ["## Overview", "", _md_table(header, rows), ""]
    for i, r in enumerate(results):
        title = _title(r)
        parts_html += [f'<h2 id="result-{i}">{html.escape(title)}</h2>', f'<p class="meta">{html.escape(_meta(r))}</p>']
        parts_md += [f"## {title}", "", f"_{_meta(r)}_", ""]
        for name, (header, rows) in tables(r).items():
            anchor = name.lower().replace(" ", "-")
            parts_html += [f'<h3 id="{anchor}-{i}">{html.escape(name)}</h3>', _html_table(header, rows)]
            parts_md += [f"### {name}", "", _md_table(header, rows), ""]
        for name, png in figures(r).items():
            _figure(name, png, f"{i}_{name}", fig_dir, parts_html, parts_md, element_id=f"{name}-{i}")
    if html_path is not None:
        head = f"<meta charset='utf-8'><title>mha2gqa report</title><style>{CSS}</style>"
        page = f"<!doctype html><html><head>{head}</head><body>"
        html_path.write_text(page + "\n".join(parts_html) + "</body></html>\n", encoding="utf-8")
        written["html"] = html_path
    if md_path is not None:
        md_path.write_text("\n".join(parts_md) + "\n", encoding="utf-8")
        written["md"] = md_path
    return written
