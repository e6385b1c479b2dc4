"""Uniform GQA against per-layer KV budgets (``--per-layer auto``) at the same KV-cache size.

On ``pydocs-mha-8h`` (a real MHA model, 6 layers x 8 heads, in ../shared/fixtures): for each method,
at three budgets -- the KV bytes of uniform G = 4, of uniform G = 2, and 1.5 KV heads per layer on
average (no uniform G has that size: it is compared with uniform G = 1, the best uniform that fits) --
convert uniformly and with ``--per-layer auto``, calibrated on the fixture's calibration text, and
evaluate both on its held-out text (disjoint protocol): perplexity ratio to the original, mean KL,
top-1 agreement, KV bytes per token, and what the allocation chose per layer.

    python benchmarks/per_layer.py [--fixtures ../shared/fixtures] [--eval-tokens 32768]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

BUDGETS = ((4.0, 4), (2.0, 2), (1.5, 1))  # (KV heads per layer on average, the uniform G compared)


def main() -> None:
    from mha2gqa.convert import convert_checkpoint
    from mha2gqa.convert.settings import COST_MEASURES, ConvertSettings
    from mha2gqa.eval.harness import evaluate
    from mha2gqa.eval.settings import EvalSettings

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fixtures", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "fixtures")
    p.add_argument("--eval-tokens", type=int, default=32768)
    p.add_argument("--calibration-tokens", type=int, default=32768)
    p.add_argument("--methods", nargs="*", default=["svd", "mean"])
    p.add_argument("--allocation-cost", choices=tuple(COST_MEASURES), default=None, help="[default: convert's]")
    args = p.parse_args()
    folder = args.fixtures / "pydocs-mha-8h"
    if not folder.is_dir():
        raise SystemExit(f"{folder}: fixture not found (pass --fixtures)")
    calib = str(args.fixtures / "text" / "pydocs_calibration.txt")
    held = str(args.fixtures / "text" / "pydocs_heldout.txt")
    settings = EvalSettings(
        data=held, seq_len=256, max_tokens=args.eval_tokens, attention=False, samples=0, progress=False
    )
    kw = dict(
        calibration=calib,
        calibration_tokens=args.calibration_tokens,
        calibration_seq_len=256,
        progress=False,
        overwrite=True,
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cache = work / "reference"
        for method in args.methods:
            for average, uniform_g in BUDGETS:
                plain = ConvertSettings(num_kv_heads=uniform_g, method=method).reads_calibration
                uniform_kw = kw if plain else {k: v for k, v in kw.items() if not k.startswith("calibration")}
                uniform = convert_checkpoint(folder, work / f"{method}-u{uniform_g}", uniform_g, method, **uniform_kw)
                cost = {"allocation_cost": args.allocation_cost} if args.allocation_cost else {}
                auto = convert_checkpoint(
                    folder,
                    work / f"{method}-a{average}",
                    None,
                    method,
                    per_layer="auto",
                    kv_budget=average,
                    **kw,
                    **cost,
                )
                for label, out in (("uniform", uniform), ("auto", auto)):
                    r = evaluate(
                        str(folder),
                        str(out.output),
                        EvalSettings(**{**settings.__dict__, "reference_cache": str(cache)}),
                    )
                    heads = out.kv_heads_per_layer
                    row = (
                        method,
                        average,
                        label,
                        ",".join(map(str, heads)),
                        out.facts.kv_cache_bytes_per_token_after,
                        r.protocols["disjoint"].ppl_ratio,
                        r.agreement.kl.mean,
                        r.agreement.top1_agreement,
                    )
                    rows.append(row)
                    print("  ".join(map(str, row)), flush=True)
    print(
        f"\npydocs-mha-8h, disjoint perplexity on held-out text ({args.eval_tokens:,} tokens); calibration "
        f"{args.calibration_tokens:,} tokens of separate text; allocation cost "
        f"{args.allocation_cost or ConvertSettings().allocation_cost}\n"
    )
    print(
        "| method | budget (KV heads/layer) | allocation | KV heads per layer | KV B/token | PPL ratio | "
        "mean KL | top-1 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for method, avg, label, heads, kv, ratio, kl, top1 in rows:
        print(f"| {method} | {avg:g} | {label} | {heads} | {kv:,} | x{ratio:.4f} | {kl:.4f} | {top1:.1%} |")
    print("\n(ratio - 1), auto against uniform:")
    for i in range(0, len(rows), 2):
        u, a = rows[i], rows[i + 1]
        change = (a[5] - 1) / (u[5] - 1) - 1 if u[5] != 1 else 0.0
        print(f"  {u[0]} at {u[1]:g}/layer: uniform {u[5] - 1:+.4f}, auto {a[5] - 1:+.4f} ({change:+.1%})")


if __name__ == "__main__":
    main()
