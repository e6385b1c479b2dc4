"""A short human summary of evaluation results, for the terminal."""

from __future__ import annotations

from typing import Any


def summary_lines(results: dict[str, Any]) -> list[str]:
    """A few lines: data, perplexity per protocol, agreement, attention similarity."""
    data = results["data"]
    models = results["models"]
    pair = "converted" in models
    lines = [
        f"data: {data['source']} ({data['documents']} documents, {data['stream_tokens']:,} tokens); "
        f"device {results['device']['type']} {results['device']['dtype']}",
    ]
    header = f"{'protocol':<9} {'original':>10}" + (f" {'converted':>10} {'ratio':>7}" if pair else "") + "  tokens"
    lines.append(header)
    for name, p in results["protocols"].items():
        row = f"{name:<9} {p['original']['ppl']:>10.4f}"
        if pair:
            row += f" {p['converted']['ppl']:>10.4f} {p['ppl_ratio']:>6.3f}x"
        row += f"  {p['original']['tokens']:,} ({p['tokens_per_second']:,.0f} tok/s)"
        if name == "rolling":
            bpb = "  bits/byte " + " -> ".join(
                f"{p[m]['bits_per_byte']:.4f}" for m in ("original", "converted") if m in p
            )
            row += bpb
        lines.append(row)
    agreement = results.get("agreement")
    if agreement and agreement.get("kl"):
        kl = agreement["kl"]
        lines.append(
            f"agreement: KL mean {kl['mean']:.4f} (median {kl['median']:.4f}, q99 {kl['q99']:.4f}) nats, "
            f"top-1 {agreement['top1_agreement']:.2%}, NLL delta {agreement['nll_delta']:+.4f}"
        )
    attention = results.get("attention")
    if attention:
        s = attention["summary"]
        lines.append(
            f"attention ({attention['seq_len']} tokens): KL {s['mean_kl']:.4f}, JS {s['mean_js']:.4f}, "
            f"row cosine {s['mean_cosine']:.4f}, entropy {s['mean_entropy_original']:.3f} -> "
            f"{s['mean_entropy_converted']:.3f} (uniform {s['entropy_uniform']:.3f}), head output error "
            f"{s['mean_output_rel_error']:.4f}, hidden cosine {s['mean_hidden_cosine']:.4f}"
        )
    return lines
