"""The refit's cost per layer and what it buys, recipe against recipe, on the small real fixtures.

    python benchmarks/refit_speed.py [--models pydocs-mha-8h] [--counts 2 1] [--recipes ...]

Each recipe is ``svd --refit`` with some refit settings; the first (``layer 200x8``: the fit of the
whole layer's output, 200 steps of 8 windows, the defaults before the attention target) is the
baseline every other row is timed against, in the same run. Per row: the refit's seconds per layer
(its own clock, from the conversion record: the fit of the changed layers, not the calibration or the
writing), steps per layer, the whole conversion's seconds, and the perplexity ratio on held-out text
(disjoint windows; calibration and held-out text as in ``benchmarks/methods.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from methods import splits
from real_fixtures import DEFAULT_FIXTURES

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

#: recipe -> refit settings (the first is the baseline)
RECIPES: dict[str, dict] = {
    "layer 200x8": {"refit_target": "layer", "refit_steps": 200, "refit_batch": 8},
    "attention 200x8": {"refit_target": "attention", "refit_steps": 200, "refit_batch": 8},
    "attention 80x4": {"refit_target": "attention", "refit_steps": 80, "refit_batch": 4},
    "defaults": {},
}


def main() -> None:
    from mha2gqa.convert import convert_checkpoint
    from mha2gqa.eval.harness import evaluate
    from mha2gqa.eval.settings import EvalSettings

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fixtures", type=Path, default=DEFAULT_FIXTURES)
    p.add_argument("--models", nargs="*", default=["pydocs-mha-8h"])
    p.add_argument("--counts", nargs="*", type=int, default=[2, 1], help="KV heads after conversion")
    p.add_argument("--recipes", nargs="*", default=list(RECIPES), help=f"from {list(RECIPES)}; the first: baseline")
    p.add_argument("--eval-tokens", type=int, default=32768)
    args = p.parse_args()
    if not args.fixtures.is_dir():
        raise SystemExit(f"{args.fixtures}: fixtures not found (pass --fixtures)")
    unknown = [r for r in args.recipes if r not in RECIPES]
    if unknown:
        raise SystemExit(f"unknown recipes {unknown}: choose from {list(RECIPES)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name, split in splits(args.fixtures, work).items():
            if name not in args.models or split is None:
                continue
            folder, calib, held, window = split
            settings = EvalSettings(
                data=held, seq_len=window, max_tokens=args.eval_tokens, attention=False, progress=False
            )
            for g in args.counts:
                base = None
                for recipe in args.recipes:
                    t = time.perf_counter()
                    out = convert_checkpoint(
                        folder, work / "out", g, "svd", calibration=calib, calibration_seq_len=window, refit=True,
                        overwrite=True, progress=False, **RECIPES[recipe],
                    )  # fmt: skip
                    seconds = time.perf_counter() - t
                    layers = out.facts.refit.layers
                    per_layer = statistics.mean(r.seconds for r in layers)
                    steps = statistics.mean(r.steps for r in layers)
                    ratio = evaluate(str(folder), str(out.output), settings).headline.ppl_ratio
                    base = base or per_layer
                    row = (name, g, recipe, per_layer, base / per_layer, steps, seconds, ratio)
                    rates = " ".join(f"x{r.lr / out.facts.refit.lr:g}" for r in layers if r.lr is not None)
                    print("  ".join(map(str, row)), f" rates: {rates}", flush=True)
                    rows.append(row)
    print(f"\n`svd --refit`, disjoint perplexity on {args.eval_tokens:,} held-out tokens; speed against the first\n")
    print("| model | KV heads | recipe | refit s per layer | faster | steps per layer | convert s | ratio |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for name, g, recipe, per_layer, faster, steps, seconds, ratio in rows:
        cells = f"{per_layer:.2f} | {faster:.1f}x | {steps:.0f} | {seconds:.0f} | x{ratio:.4f}"
        print(f"| {name} | {g} | {recipe} | {cells} |")


if __name__ == "__main__":
    main()
