"""Every conversion method at every valid KV-head count on the real models in ../shared/fixtures
(and ``pydocs-neox``: a Pythia-style GPT-NeoX trained here on CPython's docs, converted through Phi).

For each model: calibrate on one text (``svd``), evaluate on held-out text with the disjoint
protocol (perplexity, ratio to the original, mean per-token KL, top-1 agreement) and time the
conversion (calibration included). One table at the end.

    python benchmarks/methods.py [--fixtures ../shared/fixtures] [--eval-tokens 32768]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

#: (method, grouping) pairs; similarity grouping needs calibration, like svd
METHODS = (
    ("mean", "contiguous"),
    ("first", "contiguous"),
    ("random", "contiguous"),
    ("aligned", "contiguous"),
    ("svd", "contiguous"),
    ("mean", "similarity"),
    ("aligned", "similarity"),
    ("svd", "similarity"),
)


def _neox() -> tuple[Path, str, str, int]:
    """The demo's GPT-NeoX (trained once, ~1 min, cached): calibrated on its training topics,
    evaluated on the held-out ones."""
    from mha2gqa.demo import DemoSettings, demo_model, heldout_file, train_file

    settings = DemoSettings(architecture="gpt_neox")
    return demo_model(settings), str(train_file(settings)), str(heldout_file(settings)), 256


def splits(fixtures: Path, work: Path) -> dict[str, tuple[Path, str, str, int]]:
    """model -> (folder, calibration file, evaluation file, window); ``pydocs-neox`` -> None (built on use)."""
    text = (fixtures / "text" / "tinystories_train_head.txt").read_text(encoding="utf-8")
    calib, held = work / "tinystories_calib.txt", work / "tinystories_heldout.txt"
    calib.write_text(text[: len(text) // 2], encoding="utf-8")  # calibrate on the start ...
    held.write_text(text[int(len(text) * 0.85) :], encoding="utf-8")  # ... evaluate on the end
    return {
        "stories260K": (fixtures / "stories260K", str(calib), str(held), 512),
        "babyllama105": (fixtures / "babyllama105", str(calib), str(held), 256),
        "pydocs-mha-8h": (
            fixtures / "pydocs-mha-8h",
            str(fixtures / "text" / "pydocs_calibration.txt"),
            str(fixtures / "text" / "pydocs_heldout.txt"),
            256,
        ),
        "pydocs-neox": None,
    }


def main() -> None:
    from mha2gqa.convert import convert_checkpoint
    from mha2gqa.core.architecture import dims_of
    from mha2gqa.core.checkpoint import read_config
    from mha2gqa.eval.harness import evaluate
    from mha2gqa.eval.settings import EvalSettings

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fixtures", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "fixtures")
    p.add_argument("--eval-tokens", type=int, default=32768)
    p.add_argument("--calibration-tokens", type=int, default=32768)
    p.add_argument("--models", nargs="*", default=None)
    args = p.parse_args()
    if not args.fixtures.is_dir():
        raise SystemExit(f"{args.fixtures}: fixtures not found (pass --fixtures)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name, split in splits(args.fixtures, work).items():
            if args.models and name not in args.models:
                continue
            folder, calib, held, window = split or _neox()
            dims = dims_of(read_config(folder))
            settings = EvalSettings(
                data=held, seq_len=window, max_tokens=args.eval_tokens, attention=False, progress=False
            )
            for g in [g for g in range(dims.num_kv_heads - 1, 0, -1) if dims.num_kv_heads % g == 0]:
                for method, grouping in METHODS:
                    t = time.perf_counter()
                    out = convert_checkpoint(
                        folder,
                        work / f"{name}-{method}-{g}",
                        g,
                        method,
                        calibration=calib,
                        calibration_tokens=args.calibration_tokens,
                        calibration_seq_len=window,
                        progress=False,
                        overwrite=True,
                        grouping=grouping,
                    )
                    seconds = time.perf_counter() - t
                    r = evaluate(str(folder), str(out.output), settings)
                    d = r["protocols"]["disjoint"]
                    agree = r["agreement"]
                    label = method if grouping == "contiguous" else f"{method} + similarity grouping"
                    row = (
                        name,
                        f"{dims.num_kv_heads}->{g}",
                        label,
                        d["original"]["ppl"],
                        d["converted"]["ppl"],
                        d["ppl_ratio"],
                        agree["kl"]["mean"],
                        agree["top1_agreement"],
                        seconds,
                    )
                    rows.append(row)
                    print("  ".join(map(str, row)), flush=True)
    print(
        f"\ndisjoint perplexity on held-out text ({args.eval_tokens:,} tokens), svd calibrated on "
        f"{args.calibration_tokens:,} tokens of separate text\n"
    )
    print("| model | KV heads | method | original PPL | converted PPL | ratio | mean KL | top-1 | convert s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, g, method, po, pc, ratio, kl, top1, sec in rows:
        print(f"| {name} | {g} | {method} | {po:.3f} | {pc:.3f} | x{ratio:.2f} | {kl:.3f} | {top1:.1%} | {sec:.1f} |")


if __name__ == "__main__":
    main()
