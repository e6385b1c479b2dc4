"""A short human summary of evaluation results, for the terminal (the report's tables, as text)."""

from __future__ import annotations

from mha2gqa.eval.results import Results
from mha2gqa.eval.tables import perplexity_table, tasks_table


def summary_lines(results: Results) -> list[str]:
    """A few lines: data, perplexity per protocol, agreement, attention similarity, downstream tasks."""
    data, device = results.data, results.device
    lines = [
        f"data: {data.source} ({data.documents} documents, {data.stream_tokens:,} tokens); "
        f"device {device.type} {device.dtype}",
        *perplexity_table(results).text(),
    ]
    if results.overlap_warning:
        lines.insert(1, f"warning: {results.overlap_warning}: its numbers flatter the conversion")
    a = results.agreement
    if a is not None:
        kl = a.kl
        lines.append(
            f"agreement: KL mean {kl.mean:.4f} (median {kl.median:.4f}, q99 {kl.q99:.4f}) nats, "
            f"top-1 {a.top1_agreement:.2%}, NLL delta {a.nll_delta:+.4f}"
        )
        if (rest := a.reference_rest_mass) is not None:
            lines.append(
                f"  KLs against a top-k reference are lower bounds: mass outside the kept tokens mean "
                f"{rest.mean:.2%}, max {rest.max:.2%}"
            )
        if a.delta_p is not None and a.kl_reverse is not None:
            dp = a.delta_p
            lines.append(
                f"  llama.cpp-style: KL reverse {a.kl_reverse.mean:.4f}, "
                f"Δp {dp.mean:+.2%} ± {dp.std_error:.2%} "
                f"(RMS {dp.rms:.2%}), same top {a.top1_agreement:.2%} ± {a.top1_error:.2%}, "
                f"ln PPL ratio {a.nll_delta:+.4f} ± {a.nll_delta_error:.4f}, NLL correlation {a.nll_correlation:.4f}"
            )
    if results.greedy is not None:
        lines.append(results.greedy.line())
    for name, q in results.quantization.items():
        ratios = ", ".join(f"{p} x{r:.4f}" for p, r in q.ppl_ratio.items())
        lines.append(
            f"yardstick {name} ({q.description}): perplexity {ratios}, KL mean {q.agreement.kl.mean:.4g}, "
            f"top-1 {q.agreement.top1_agreement:.2%} ({q.seconds:.1f} s)"
        )
    attention = results.attention
    if attention:
        s = attention.summary
        lines.append(
            f"attention ({attention.seq_len} tokens): KL {s.mean_kl:.4f}, JS {s.mean_js:.4f}, "
            f"row cosine {s.mean_cosine:.4f}, entropy {s.mean_entropy_original:.3f} -> "
            f"{s.mean_entropy_converted:.3f} (uniform {s.entropy_uniform:.3f}), head contribution error "
            f"{s.head_error:.4f}, hidden cosine {s.mean_hidden_cosine:.4f}"
        )
        before, after = s.head_similarity_original_mean, s.head_similarity_converted_mean
        if before is not None and after is not None:
            within, across = s.head_similarity_converted_within_groups, s.head_similarity_converted_across_groups
            groups = f" (within KV groups {within:.3f}, across {across:.3f})" if within is not None and across else ""
            lines.append(f"head similarity: {before:.3f} -> {after:.3f}{groups}")
    if results.tasks is not None:
        lines += _tasks_lines(results)
    return lines


def _tasks_lines(results: Results) -> list[str]:
    """The downstream tasks: how they ran, then their table."""
    section = results.tasks
    shots = section.settings.get("num_fewshot")
    head = (
        f"downstream tasks (lm-evaluation-harness {section.lm_eval_version}, "
        f"{'each task’s own' if shots is None else shots} few-shot"
        + (f", first {section.settings['limit']} documents" if section.settings.get("limit") else "")
        + "; the difference tested on the paired examples):"
    )
    return [head, *tasks_table(results).text("  ")]
