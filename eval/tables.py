"""Every table of evaluation results, built once as :class:`~mha2gqa.core.text_table.Table` and shown by
the terminal summary, the report (HTML and Markdown), the demo and job summaries."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mha2gqa.core.dims import kv_bytes_per_token
from mha2gqa.core.dtypes import by_name
from mha2gqa.core.model_info import ModelInfo
from mha2gqa.core.runlog import RunHistory
from mha2gqa.core.text_table import Table
from mha2gqa.core.units import format_bytes
from mha2gqa.eval.results import Results, Stats
from mha2gqa.eval.verdict import Verdict, figures_of, judge

#: Sequence lengths of the KV-cache table (those past the model's positions are left out).
SEQ_LENS = (2048, 8192, 32768)


def perplexity_table(r: Results) -> Table:
    """One row per protocol: perplexities, ratio, tokens scored, speed and settings."""
    pair = r.converted is not None
    t = Table(
        ["protocol", "original PPL"] + (["converted PPL", "ratio"] if pair else []) + ["tokens", "tok/s", "settings"]
    )
    for name, p in r.protocols.items():
        row = [name, f"{p.original.ppl:.4f}"]
        if pair:
            row += [f"{p.converted.ppl:.4f}", f"{p.ppl_ratio:.3f}x"]
        s = p.settings
        detail = f"seq_len {s['seq_len']}" + (f", stride {s['stride']}" if "stride" in s else "")
        if p.original.bits_per_byte is not None:
            scores = [x for x in (p.original, p.converted) if x is not None]
            detail += ", bits/byte " + " → ".join(f"{x.bits_per_byte:.4f}" for x in scores)
        t.add(*row, f"{p.original.tokens:,}", f"{p.tokens_per_second:,.0f}", detail)
    return t


def agreement_table(r: Results) -> Table | None:
    a = r.agreement
    if a is None:
        return None
    kl = a.kl
    t = Table(["KL mean", "median", "q90", "q95", "q99", "q99.9", "max", "top-1 agreement", "NLL delta", "tokens"])
    t.add(
        *(f"{x:.4f}" for x in (kl.mean, kl.median, kl.q90, kl.q95, kl.q99, kl.q99_9, kl.max)),
        f"{a.top1_agreement:.2%}",
        f"{a.nll_delta:+.4f}",
        f"{a.tokens:,}",
    )
    return t


#: The rows of llama.cpp's KL report: (label, the statistic).
KL_REPORT_ROWS: tuple[tuple[str, Callable[[Stats], float | None]], ...] = (
    ("max", lambda s: s.max),
    ("99.9%", lambda s: s.q99_9),
    ("99%", lambda s: s.q99),
    ("95%", lambda s: s.q95),
    ("90%", lambda s: s.q90),
    ("median", lambda s: s.median),
    ("10%", lambda s: s.q10),
    ("5%", lambda s: s.q5),
    ("1%", lambda s: s.q1),
    ("0.1%", lambda s: s.q0_1),
    ("min", lambda s: s.min),
)


def kl_report_table(r: Results) -> Table | None:
    """llama.cpp's KL-divergence report: KL both ways and Δp of the correct token, mean ± error and
    percentiles, then the same-top rate, RMS Δp, mean ln(PPL ratio) and the NLL correlation."""
    a = r.agreement
    if a is None or a.kl_reverse is None or a.delta_p is None:
        return None
    t = Table(["statistic", "KL(original ‖ converted)", "KL(converted ‖ original)", "Δp (correct token)"])
    kl, rev, dp = a.kl, a.kl_reverse, a.delta_p
    t.add(
        "mean ± error",
        f"{kl.mean:.5f} ± {kl.std_error:.5f}",
        f"{rev.mean:.5f} ± {rev.std_error:.5f}",
        f"{dp.mean:+.3%} ± {dp.std_error:.3%}",
    )
    for label, stat in KL_REPORT_ROWS:
        t.add(label, f"{stat(kl):.5f}", f"{stat(rev):.5f}", f"{stat(dp):+.3%}")
    t.add("RMS Δp", "", "", f"{dp.rms:.3%} ± {dp.rms_error:.3%}")
    t.add("same top token", f"{a.top1_agreement:.3%} ± {a.top1_error:.3%}", "", "")
    t.add("mean ln(PPL(converted) / PPL(original))", f"{a.nll_delta:.5f} ± {a.nll_delta_error:.5f}", "", "")
    t.add("correlation of per-token NLLs", f"{a.nll_correlation:.4f}", "", "")
    return t


def attention_table(r: Results) -> Table | None:
    att = r.attention
    if att is None:
        return None
    conv = r.converted
    per_layer = conv.kv_heads_per_layer if conv else None  # a per-layer budget: each layer's KV heads and bytes
    extra = ["KV heads", "KV B/token"] if per_layer else []
    t = Table(
        [
            "layer",
            *extra,
            "KL",
            "JS",
            "row cosine",
            "entropy orig.",
            "entropy conv.",
            "uniform",
            "head contribution error",
            "hidden cosine",
        ]
    )
    element = by_name(conv.dtype).bytes
    for x in att.layers:
        heads = per_layer[x.layer] if per_layer else None
        cells = [str(heads), f"{kv_bytes_per_token([heads], conv.head_dim, element):,}"] if per_layer else []
        t.add(
            str(x.layer),
            *cells,
            f"{x.mean_kl:.4f}",
            f"{x.mean_js:.4f}",
            f"{x.mean_cosine:.4f}",
            f"{x.mean_entropy_original:.3f}",
            f"{x.mean_entropy_converted:.3f}",
            f"{x.entropy_uniform:.3f}",
            f"{x.head_error:.4f}",
            f"{x.hidden_cosine:.4f}",
        )
    return t


def kv_rows(r: Results) -> list[list[str]]:
    """KV cache per token and per sequence for each model in its checkpoint's dtype (the one ``convert``
    reports; the evaluated dtype named where it differs; sliding layers counted at their window), and
    the saving."""
    lens = _seq_lens(r)
    rows = []
    for name, m in r.models.items():
        stored = m.kv_cache_dtype or m.dtype
        dtype = stored if stored == m.dtype else f"{stored} (evaluated in {m.dtype})"
        sizes = [format_bytes(m.kv_cache_bytes(n)) for n in lens]
        rows.append([name, kv_heads(m), dtype, f"{m.kv_cache_bytes_per_token:,}", *sizes])
    if r.converted is not None:
        a, c = r.original, r.converted
        saving = [f"{1 - c.kv_cache_bytes(n) / a.kv_cache_bytes(n):.1%}" for n in lens]
        rows.append(["saving", "", "", f"{1 - c.kv_cache_bytes_per_token / a.kv_cache_bytes_per_token:.1%}", *saving])
    return rows


def _seq_lens(r: Results) -> list[int]:
    limits = [m.max_positions for m in r.models.values() if m.max_positions]
    top = min(limits) if limits else None
    lens = [n for n in SEQ_LENS if top is None or n <= top]
    return lens if top is None or top in lens else [*lens, top]


def kv_table(r: Results) -> Table:
    header = ["model", "KV heads", "dtype", "bytes/token"] + [f"at {n:,} tokens" for n in _seq_lens(r)]
    return Table(header, kv_rows(r))


def gates_table(r: Results) -> Table | None:
    if not r.gates:
        return None
    t = Table(["gate", "value", "limit", "result"])
    for g in r.gates.checks:
        t.add(g.name, f"{g.value:.4g}", f"{g.op} {g.limit:.4g}", "pass" if g.passed else "FAIL")
    return t


def _shift(m: Any, value: float, digits: int = 2) -> str:
    """A task metric's difference: percentage points for a 0-1 metric (``-7.67 pt``), else as is."""
    fraction = all(0 <= x.value <= 1 for x in (m.original, m.converted) if x is not None)
    return f"{value * 100:+.{digits}f} pt" if fraction else f"{value:+.{digits + 2}g}"


def _task_score(score: Any) -> str:
    return f"{score.value:.4f}" + (f" ± {score.stderr:.4f}" if score.stderr is not None else "")


def significance(m: Any) -> str:
    """A paired test in words: ``significant drop (McNemar p 0.00019)``, ``not significant (...)``."""
    t = m.paired
    if t is None:
        return m.note or ""
    test = "McNemar" if t.test == "mcnemar-exact" else "bootstrap"
    what = ("drop" if t.drop > 0 else "gain") if t.significant else "not significant"
    return f"{'significant ' if t.significant else ''}{what} ({test} p {t.p_value:.2g})"


def tasks_table(r: Results) -> Table | None:
    """One row per task (group, tag member) and metric: both models' value ± stderr, the difference
    with its 95% paired-bootstrap interval, and the paired test in words."""
    if r.tasks is None:
        return None
    pair = r.converted is not None
    header = ["task", "metric", "n", "original"] + (["converted", "difference [95% CI]", "paired test"] if pair else [])
    t = Table(header)
    for row in r.tasks.rows:
        name = row.task + (" (group, pooled)" if row.group and pair else "")
        for m in row.metrics:
            cells = [name, m.metric, f"{row.n:,}", _task_score(m.original)]
            if pair and m.converted is not None:
                p = m.paired
                ci = f" [{_shift(m, p.ci_low)}, {_shift(m, p.ci_high)}]" if p else ""
                diff = _shift(m, m.converted.value - m.original.value)
                cells += [_task_score(m.converted), diff + ci, significance(m)]
            t.add(*cells)
    return t


def task_cell(r: Results) -> str:
    """The overview's tasks cell: the named tasks' most significant drop (``drop: arc_easy acc -2.1 pt,
    p 0.003``), else the largest drop, not significant (``n.s.: ... p 0.15``)."""
    if r.tasks is None or r.converted is None:
        return ""
    tested = [(row, m) for row in r.tasks.rows if row.top_level for m in row.metrics if m.paired is not None]
    if not tested:
        return "no paired test"
    drops = [(row, m) for row, m in tested if m.paired.significant and m.paired.drop > 0]
    row, m = min(drops, key=lambda rm: rm[1].paired.p_value) if drops else max(tested, key=lambda rm: rm[1].paired.drop)
    shift = _shift(m, -m.paired.drop, digits=1)
    return f"{'drop' if drops else 'n.s.'}: {row.task} {m.metric} {shift}, p {m.paired.p_value:.2g}"


def tables(r: Results) -> dict[str, Table]:
    """Every table of one results file: title -> table."""
    out = {
        "Perplexity": perplexity_table(r),
        "Downstream tasks": tasks_table(r),
        "Output agreement": agreement_table(r),
        "Generative probe": greedy_table(r),
        "KL report (llama.cpp style)": kl_report_table(r),
        "Attention per layer": attention_table(r),
        "KV cache": kv_table(r),
        "Gates": gates_table(r),
        "Sample generations": samples_table(r),
    }
    return {k: v for k, v in out.items() if v is not None}


#: The overview's columns (``tasks`` follows when tasks ran, ``gates`` when a gate was asked for).
OVERVIEW_COLUMNS = ("comparison", "method", "KV heads", "calibration", "PPL original → converted", "tokens",
                    "ratio", "KL mean", "top-1", "KV B/token (saving)", "verdict")  # fmt: skip


def kv_heads(model: ModelInfo) -> str:
    """A model's KV heads: ``4``, or each layer's count for a per-layer checkpoint (``4,1,1,4,1,1``;
    past 8 layers the average and the first 6, ``avg 2.3: 4,1,1,4,1,1,…``)."""
    counts = model.kv_heads_per_layer
    if not counts:
        return str(model.num_kv_heads)
    if len(counts) <= 8:
        return ",".join(map(str, counts))
    return f"avg {sum(counts) / len(counts):.3g}: " + ",".join(map(str, counts[:6])) + ",…"


def verdict_cell(r: Results) -> str:
    """``pass``, or ``borderline``/``fail`` with the figure that decided it; empty for one model."""
    return verdict_text(r.judge())


def verdict_text(v: Verdict | None) -> str:
    """A verdict in a table cell (empty for none)."""
    if v is None:
        return ""
    if v.invalid:
        return f"NOT VALID ({v.invalid}): would be {verdict_text(replace(v, invalid=None))}"
    if v.tier == "pass":
        return "pass"
    name = v.decided_by.replace("ppl_ratio", "ratio").replace("kl_mean", "KL").replace("top1_agreement", "top-1")
    value = f"{v.value:.1%}" if name == "top-1" else f"{v.value:.3g}x" if name.startswith("ratio") else f"{v.value:.3g}"
    return f"{v.tier}: {name} {value}"


def shared_original(results: list[Results]) -> str | None:
    """The original every comparison was scored against, when they share one."""
    paths = {r.original.path for r in results}
    return paths.pop() if len(paths) == 1 else None


def overview_table(results: list[Results], runs: list[RunHistory] | None = None) -> Table:
    """The first screen: one row per comparison with everything that decides it (perplexities on
    how many tokens, ratio, KL, top-1, KV bytes and the saving, calibration, the verdict and each
    gate's result), its first cell linking to the comparison's section (named by the converted model
    alone when every comparison shares one original)."""
    gated = any(r.gates for r in results)
    tasked = any(r.tasks is not None for r in results)
    short = shared_original(results) is not None
    t = Table([*OVERVIEW_COLUMNS, *(["tasks"] if tasked else []), *(["gates"] if gated else [])])
    for i, r in enumerate(results):
        p, a, conv = r.headline, r.agreement, r.converted
        kv = conv.kv_cache_bytes_per_token if conv else r.original.kv_cache_bytes_per_token
        saving = f" ({1 - kv / r.original.kv_cache_bytes_per_token:.1%})" if conv else ""
        t.add(
            Path(conv.path).name if short and conv else r.title,
            conv.recipe if conv else "",
            kv_heads(conv) if conv else "",
            calibration(conv),
            f"{p.original.ppl:.3f}" + (f" → {p.converted.ppl:.3f}" if p.converted else ""),
            f"{p.original.tokens:,}",
            f"{p.ppl_ratio or 1:.3f}x",
            f"{a.kl.mean:.4f}" if a else "",
            f"{a.top1_agreement:.1%}" if a else "",
            f"{kv:,}{saving}",
            verdict_cell(r),
            *([task_cell(r)] if tasked else []),
            *([gate_cell(r)] if gated else []),
            link=f"#result-{i}",
        )
    evaluated = {Path(r.converted.path).name for r in results if r.converted}
    for run in runs or []:
        if run.label not in evaluated:  # an uptraining run only seen through its log: its last evaluation
            t.add(*_run_row(run), *([""] * (tasked + gated)), link="#uptraining")
    return t


def _run_row(run: RunHistory) -> list[str]:
    """An overview row for an uptraining run from its log's last held-out evaluation (vs its teacher)."""
    last = run.evals[-1] if run.evals else None
    ratio, kl = (last.ppl_ratio, last.kl_mean) if last else (None, None)
    verdict = judge(figures_of({"held-out": ratio} if ratio else {}, kl, None))
    return [
        run.label,
        "uptrain",
        str(run.start.num_kv_heads),
        "-",
        f"{last.teacher_ppl:.3f} → {last.ppl:.3f}" if last and last.teacher_ppl is not None else "",
        f"{last.eval_tokens:,}" if last else "",
        f"{ratio:.3f}x" if ratio else "",
        f"{kl:.4f}" if kl is not None else "",
        "",
        "",
        verdict_text(verdict),
    ]


def calibration(model: ModelInfo | None) -> str:
    """What a conversion was calibrated on: ``file (N tokens)``, ``weights only``, or ``-``."""
    cal = model.conversion.calibration if model and model.conversion else None
    if cal and cal.data:
        return f"{Path(cal.data).name} ({cal.tokens:,} tok)"
    return "weights only" if cal and cal.weights_only else "-"


def gate_cell(r: Results) -> str:
    """``pass``, ``FAIL: <failed gates>`` or empty when no gate was asked for."""
    if not r.gates:
        return ""
    failed = [g.name for g in r.gates.checks if not g.passed]
    return "FAIL: " + ", ".join(failed) if failed else "pass"


def worst(r: Results, count: int = 3) -> str:
    """The layers with the highest attention KL and the heads with the highest contribution error."""
    att = r.attention
    if att is None:
        return ""
    layers = sorted(att.layers, key=lambda x: -x.mean_kl)[:count]
    heads = sorted(((h.error, x.layer, i) for x in att.layers for i, h in enumerate(x.heads)), reverse=True)
    return (
        "worst layers by attention KL: "
        + ", ".join(f"{x.layer} ({x.mean_kl:.3g})" for x in layers)
        + "; worst heads by contribution error: "
        + ", ".join(f"layer {layer} head {h} ({v:.3g})" for v, layer, h in heads[:count])
    )


def greedy_table(r: Results) -> Table | None:
    """The generative probe: how many greedy continuations are the original's, and how far they agree."""
    g = r.greedy
    if g is None:
        return None
    t = Table(
        ["continuations", "prompt tokens", "tokens each", "identical to the original's", "tokens before a divergence"]
    )
    t.add(f"{g.prompts:,}", f"{g.prompt_tokens}", f"{g.tokens}", f"{g.identical:.1%}", f"{g.mean_agreeing_tokens:.1f}")
    return t


def samples_table(r: Results) -> Table | None:
    """Greedy continuations of the same prompts by both models."""
    if not r.samples:
        return None
    t = Table(["prompt", "original", "converted"])
    for s in r.samples:
        t.add(s.prompt, s.original, s.converted)
    return t


@dataclass(frozen=True)
class SweepRow:
    """One evaluated model of a job or the demo (a conversion, or an uptrained one), as the summary
    table shows it; ``num_kv_heads`` as written (``2`` or per layer ``4,2,2,1``)."""

    tag: str
    method: str
    num_kv_heads: str
    original_ppl: float
    converted_ppl: float
    ppl_ratio: float
    kl_mean: float
    top1: float
    kv_bytes_per_token: int
    kv_bytes_per_token_before: int
    verdict: str = ""
    tasks: str | None = None


def sweep_table(rows: list[SweepRow]) -> Table:
    """The summary of a job or the demo: the original, then every conversion (and uptrained model);
    a ``tasks`` column when the rows carry one."""
    tasked = any(r.tasks for r in rows)
    header = ["model", "KV heads", "KV cache B/token", "perplexity", "ratio", "KL", "top-1", "verdict"]
    t = Table(header + (["tasks"] if tasked else []))
    if rows:
        first = rows[0]
        before = f"{first.kv_bytes_per_token_before:,}"
        t.add("original", "", before, f"{first.original_ppl:.3f}", "1.00x", "", "", "", *([""] if tasked else []))
    for r in rows:
        t.add(
            f"{r.method} -> {r.num_kv_heads} KV heads",
            r.num_kv_heads,
            f"{r.kv_bytes_per_token:,}",
            f"{r.converted_ppl:.3f}",
            f"{r.ppl_ratio:.2f}x",
            f"{r.kl_mean:.3f}",
            f"{r.top1:.1%}",
            r.verdict,
            *([r.tasks or ""] if tasked else []),
        )
    return t


def recovery_table(runs: list[RunHistory]) -> Table:
    """One row per uptraining run: what trained, how long, and held-out quality before -> after."""
    t = Table(["run", "objective", "trains", "steps", "tokens", "held-out PPL", "vs teacher", "KL", "published"])
    for run in runs:
        start, steps = run.start, run.steps
        row = [
            run.label,
            start.objective,
            start.train,
            f"{steps:,} / {start.max_steps:,}",
            f"{steps * start.tokens_per_step:,}",
        ]
        if run.evals:
            a, b = run.evals[0], run.evals[-1]
            row.append(f"{a.ppl:.3f} → {b.ppl:.3f} ({b.eval_tokens:,} tok)")
            ratios, kls = (a.ppl_ratio, b.ppl_ratio), (a.kl_mean, b.kl_mean)
            row.append(f"{ratios[0]:.3f}x → {ratios[1]:.3f}x" if None not in ratios else "")
            row.append(f"{kls[0]:.4f} → {kls[1]:.4f}" if None not in kls else "")
        else:
            row += ["(no --eval-data)", "", ""]
        t.add(*row, _published(run))
    return t


def _published(run: RunHistory) -> str:
    """Which step's model the run published as the guard chose: ``step 30: kept``, ``step 10 of 30:
    the best``, ``step 0: undone`` (the student as given), or ``step 30`` unguarded."""
    end = run.end
    if end is None:
        return "(not finished)"
    if end.published is None:
        return f"step {end.step:,}"
    if end.published == 0:
        return "step 0: undone (the student)"
    return f"step {end.published:,}" + (": kept" if end.published == end.step else f" of {end.step:,}: the best")
