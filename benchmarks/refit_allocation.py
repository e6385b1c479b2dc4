"""Per-layer KV budgets chosen from refitted costs against the default (merge) costs, both refitted.

On ``pydocs-mha-8h`` with ``svd``: ``--per-layer auto`` chooses each layer's KV heads from the cost
of the merge alone (each layer's output error relative to its output, measured on calibration text),
and ``--refit`` then fits every layer. Whether the allocation should see what refitting recovers is
measured here: uniform ``svd --refit`` conversions at G = 4, 2, 1 give every layer's held-out output
error before and after its refit; a layer's refitted cost at G is its merge cost times the share
the refit left (``loss_after / loss_before``). The same exact allocation (dynamic programming under
the same KV-head budget) runs on those costs; when it picks other counts, that conversion is made
with ``--num-kv-heads-per-layer`` and refitted too. All are evaluated on held-out text (disjoint).

(The refitted cost of a layer at G is measured in a uniform conversion, where the layers before it
have G heads too; in a mixed allocation they have their own counts. The approximation costs
|G| refitted conversions instead of layers x |G|.)

    python benchmarks/refit_allocation.py [--fixtures ../shared/fixtures] [--eval-tokens 32768]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

BUDGETS = (2.0, 1.5)  # KV heads per layer on average
UNIFORM = (4, 2, 1)


def main() -> None:
    from mha2gqa.convert import convert_checkpoint
    from mha2gqa.convert.plan.allocation import allocate
    from mha2gqa.eval.harness import evaluate
    from mha2gqa.eval.settings import EvalSettings

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fixtures", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "fixtures")
    p.add_argument("--eval-tokens", type=int, default=32768)
    p.add_argument("--calibration-tokens", type=int, default=16384)
    args = p.parse_args()
    folder = args.fixtures / "pydocs-mha-8h"
    if not folder.is_dir():
        raise SystemExit(f"{folder}: fixture not found (pass --fixtures)")
    calib = str(args.fixtures / "text" / "pydocs_calibration.txt")
    held = str(args.fixtures / "text" / "pydocs_heldout.txt")
    kw = dict(calibration=calib, calibration_tokens=args.calibration_tokens, calibration_seq_len=256,
              method="svd", refit=True, progress=False, overwrite=True)  # fmt: skip
    rows: list[tuple[str, str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        settings = EvalSettings(data=held, seq_len=256, max_tokens=args.eval_tokens, attention=False, samples=0,
                                progress=False, reference_cache=str(work / "reference"))  # fmt: skip

        def ratio(out) -> float:
            return evaluate(str(folder), str(out.output), settings)["protocols"]["disjoint"]["ppl_ratio"]

        kept: dict[int, list[float]] = {}  # G -> per layer loss_after / loss_before
        for g in UNIFORM:
            out = convert_checkpoint(folder, work / f"u{g}", g, **kw)
            kept[g] = [x.loss_after / x.loss_before if x.loss_before > 0 else 0.0 for x in out.facts.refit.layers]
            rows.append((f"uniform G={g}", ",".join([str(g)] * out.facts.num_layers), ratio(out)))
            print(rows[-1], [f"{k:.3f}" for k in kept[g]], flush=True)
        for average in BUDGETS:
            auto = convert_checkpoint(folder, work / f"a{average}", None, per_layer="auto", kv_budget=average, **kw)
            alloc = auto.facts.per_layer_allocation
            merge_costs = [
                {int(g): c for g, c in alloc.costs[str(layer)].items()} for layer in range(len(alloc.chosen))
            ]
            refitted = [
                {g: c * (kept[g][layer] if g in kept else 0.0) for g, c in costs.items()}
                for layer, costs in enumerate(merge_costs)
            ]
            chosen = list(allocate(refitted, alloc.budget_kv_heads))
            rows.append((f"{average:g}/layer, merge costs", ",".join(map(str, alloc.chosen)), ratio(auto)))
            print(rows[-1], flush=True)
            if chosen == list(alloc.chosen):
                rows.append((f"{average:g}/layer, refitted costs", ",".join(map(str, chosen)) + " (same)", rows[-1][2]))
            else:
                counts = ",".join(map(str, chosen))
                other = convert_checkpoint(folder, work / f"r{average}", None, num_kv_heads_per_layer=counts, **kw)
                rows.append((f"{average:g}/layer, refitted costs", counts, ratio(other)))
            print(rows[-1], flush=True)
    print(f"\npydocs-mha-8h, svd + refit, held-out disjoint perplexity ({args.eval_tokens:,} tokens)\n")
    print("| allocation | KV heads per layer | PPL ratio |")
    print("|---|---|---:|")
    for label, heads, r in rows:
        print(f"| {label} | {heads} | x{r:.4f} |")


if __name__ == "__main__":
    main()
