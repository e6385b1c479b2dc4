"""Uptraining recovery on the real stories260K model regrouped to one KV head (the uptraining
issue's acceptance run).

stories260K (8 query / 4 KV heads) -> 1 KV head by ``mean`` and by ``svd`` (calibrated on the first
half of tinystories_train_head.txt), then ``mha2gqa uptrain``: 300 steps of 8 x 256 tokens on the
first 85% of the text (``svd+refit``: the svd conversion refitted first, ``--refit`` on the same
calibration text), AdamW lr 1e-3 (cosine to 10%, no warm-up), CPU, held-out perplexity on the
last 15% every 25 steps. Prints the curves as ratios to the original model, at the training
window (256) and, after training, at the model's full 512 positions; writes an HTML report.

    python benchmarks/uptrain_recovery.py [--fixtures ../shared/fixtures] [--out DIR] [--objectives ce kd]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def main() -> None:
    from mha2gqa.convert import convert_checkpoint
    from mha2gqa.convert.settings import ConvertSettings
    from mha2gqa.eval.harness import evaluate
    from mha2gqa.eval.report import load_runs, render
    from mha2gqa.eval.settings import EvalSettings
    from mha2gqa.uptrain import UptrainSettings, uptrain

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fixtures", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "fixtures")
    p.add_argument("--out", type=Path, default=None, help="Keep runs and the report here [default: a temp folder].")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--methods", nargs="*", default=["svd", "mean"], help="methods; METHOD+refit refits first")
    p.add_argument("--objectives", nargs="*", default=["ce"])
    args = p.parse_args()
    model = args.fixtures / "stories260K"
    if not model.is_dir():
        raise SystemExit(f"{model}: fixtures not found (pass --fixtures)")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.out or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        text = (args.fixtures / "text" / "tinystories_train_head.txt").read_text(encoding="utf-8")
        cut = int(len(text) * 0.85)
        files = {"calib": text[: len(text) // 2], "train": text[:cut], "held": text[cut:]}
        for name, body in files.items():
            (work / f"{name}.txt").write_text(body, encoding="utf-8")
        curves, finals = {}, {}
        calibrated = dict(calibration=str(work / "calib.txt"), calibration_tokens=32768, calibration_seq_len=512)
        for method in args.methods:
            base, _, extra = method.partition("+")
            student = convert_checkpoint(
                model,
                work / f"{method}-1kv",
                1,
                base,
                refit=extra == "refit",
                progress=False,
                overwrite=True,
                **(
                    calibrated
                    if ConvertSettings(num_kv_heads=1, method=base, refit=extra == "refit").reads_calibration
                    else {}
                ),
            ).output
            for objective in args.objectives:
                name = f"{method}-{objective}"
                settings = UptrainSettings(
                    data=str(work / "train.txt"),
                    output=str(work / name),
                    objective=objective,
                    teacher=str(model),
                    seq_len=256,
                    batch_size=8,
                    lr=1e-3,
                    max_steps=args.steps,
                    eval_every=25,
                    eval_data=str(work / "held.txt"),
                    eval_tokens=None,
                    overwrite=True,
                    progress=False,
                )
                t = time.perf_counter()
                result = uptrain(str(student), settings, log=lambda m: None)
                seconds = time.perf_counter() - t
                curves[name] = {e.step: e.ppl_ratio for e in result.evals}
                at_512 = EvalSettings(data=str(work / "held.txt"), seq_len=512, attention=False, progress=False)
                full = evaluate(str(model), str(work / name), at_512)
                finals[name] = (full.headline.ppl_ratio, full.agreement.kl.mean, seconds)
                print(
                    f"{name}: step 0 x{curves[name][0]:.3f} -> step {args.steps} x{curves[name][args.steps]:.3f} "
                    f"(window 256); x{finals[name][0]:.3f} at 512; {seconds:.0f} s",
                    flush=True,
                )
        steps = sorted(next(iter(curves.values())))
        print("\nheld-out perplexity / original's (disjoint windows of 256 = the training length)\n")
        print("| step | tokens | " + " | ".join(curves) + " |")
        print("|---|---|" + "---|" * len(curves))
        for s in steps:
            print(f"| {s} | {s * 8 * 256:,} | " + " | ".join(f"x{c[s]:.3f}" for c in curves.values()) + " |")
        print("\nafter training, at the model's full 512 positions (windows of 512, same text)\n")
        print("| run | PPL ratio | mean KL | uptrain s |")
        print("|---|---|---|---|")
        for name, (ratio, kl, sec) in finals.items():
            print(f"| {name} | x{ratio:.3f} | {kl:.4f} | {sec:.0f} |")
        if "svd+refit-ce" in curves and "svd-ce" in curves:
            target = curves["svd-ce"][args.steps]
            passed = next((s for s in steps if curves["svd+refit-ce"][s] <= target), None)
            print(f"\nsvd+refit reaches svd's step-{args.steps} perplexity (x{target:.3f}) at step {passed}")
        if "svd-ce" in curves and "mean-ce" in curves:
            mean_final = curves["mean-ce"][args.steps]
            passed = next((s for s in steps if curves["svd-ce"][s] <= mean_final), None)
            print(f"\nsvd passes mean's step-{args.steps} perplexity (x{mean_final:.3f}) at step {passed}")
        html = render([], work / "recovery.html", work / "recovery.md", load_runs([work / n for n in curves]))
        print(f"report: {html['html']}" + ("" if args.out else " (temporary: pass --out to keep it)"))


if __name__ == "__main__":
    main()
