"""A 7B-class model end to end on one CPU box: peak RSS and wall time of every command.

Writes (once, reused across runs) a random bf16 Llama-2-7B-shaped MHA checkpoint: 32 layers, hidden
4096, 32 heads, vocabulary 32,000, 5 GB shards (~12.6 GiB), with a BPE tokenizer trained on
CPython's help topics (ids below 4,096; the model's vocabulary stays 32,000) and that text. Then
runs, each command in its own process so its peak RSS is its own:

- ``copy``: ``shutil.copytree`` of the checkpoint, the floor for any tool that rewrites it;
- ``convert -g 8`` (mean pooling), against the copy (target: <= 1 GB peak RSS, <= 2x the copy);
- ``convert -g 8 --method svd`` with 512 calibration tokens (target: <= 4 GB; seconds per layer);
- ``refit``: the same svd conversion with ``--refit`` on 2,048 tokens (windows of 512), one Adam step
  per layer by default (``--refit-steps``; peak memory does not depend on the step count), target
  <= 2.5 GB peak RSS for the 4-layer checkpoint; seconds per step, and the seconds per layer a GPU
  needs for the default 200 steps, from the FLOPs (:func:`refit_flops_per_layer`);
- ``eval`` original vs converted on 2,048 tokens in bf16 with attention similarity, one model in
  memory at a time (two bf16 7B models, 27 GB, do not fit 24 GB; one does);
- ``inspect`` and ``plan``.

    python benchmarks/scale_7b.py --workdir /data/scale7b     # ~13 GB there, ~30 GB free needed

It prints one Markdown table and writes ``scale_7b.json`` in the workdir.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from convert_memory import measure, warm

TEXT = r"""
import sys
from pathlib import Path
from mha2gqa.demo import build_tokenizer, cpython_text
folder = Path(sys.argv[1])
train, heldout = cpython_text(0.1)
build_tokenizer(train, 4096).save_pretrained(folder)
(folder.parent / "calibration.txt").write_text(train)
(folder.parent / "heldout.txt").write_text(heldout)
"""


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "mha2gqa.cli", *args]


def prepare(workdir: Path, layers: int) -> Path:
    src = workdir / ("llama2-7b-shaped-mha" if layers == 32 else f"llama2-7b-shaped-mha-{layers}L")
    if not (src / "tokenizer.json").is_file():
        if not (src / "config.json").is_file():
            shutil.rmtree(src, ignore_errors=True)
            t = time.perf_counter()
            code = (
                "import sys; sys.path.insert(0, sys.argv[1]); import convert_memory as m; "
                "print(m.make_checkpoint(m.Path(sys.argv[2]), int(sys.argv[3]), '5GB'))"
            )
            here = str(Path(__file__).parent)
            size = int(subprocess.check_output([sys.executable, "-c", code, here, str(src), str(layers)]))
            print(f"wrote {src} ({size / 2**30:.2f} GiB) in {time.perf_counter() - t:.0f} s", flush=True)
        subprocess.check_call([sys.executable, "-c", TEXT, str(src)])
    return src


def refit_flops_per_layer(src: Path, seq_len: int = 512) -> float:
    """FLOPs of one layer's default refit (``convert``'s default steps and windows per step, without
    stopping early): forward + backward (3 x 2 x parameters per token, the attention scores
    3 x 4 x T x hidden per token) over ``steps x batch`` windows of ``seq_len``."""
    from mha2gqa.convert.settings import ConvertSettings, refit_windows

    steps, batch = ConvertSettings.refit_steps, refit_windows(ConvertSettings.refit_batch, seq_len)
    config = json.loads((src / "config.json").read_text())
    h, i = config["hidden_size"], config["intermediate_size"]
    params = 4 * h * h + 3 * h * i
    tokens = steps * batch * seq_len
    return 3 * tokens * (2 * params + 4 * seq_len * h)


def main() -> None:
    from mha2gqa.convert.settings import ConvertSettings, refit_windows

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("bench-7b"))
    parser.add_argument("--eval-tokens", type=int, default=2048)
    parser.add_argument("--calibration-tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=32, help="fewer for a quick trial of the script")
    parser.add_argument("--refit-tokens", type=int, default=2048)
    parser.add_argument("--refit-steps", type=int, default=1, help="Adam steps per layer of the refit step")
    parser.add_argument("--skip", nargs="*", default=[], help="steps to leave out (copy, mean, svd, eval, inspect)")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = prepare(args.workdir, args.layers)
    size = sum(f.stat().st_size for f in src.iterdir())
    work = args.workdir
    mean_dst, svd_dst = work / "gqa-g8-mean", work / "gqa-g8-svd"
    results_file = work / "eval.json"

    def svd(tokens: int, *extra: str) -> list[str]:
        """``convert -g 8 --method svd`` calibrated on ``tokens`` tokens (windows of up to 512), plus ``extra``."""
        calibration = ("--calibration", str(work / "calibration.txt"), "--calibration-tokens", str(tokens))
        window = ("--calibration-seq-len", str(min(512, tokens)))
        return _cli(
            "convert",
            str(src),
            str(svd_dst),
            "-g",
            "8",
            "--method",
            "svd",
            *calibration,
            *window,
            *extra,
            "-q",
            "--overwrite",
        )

    steps = {
        "copy": [
            sys.executable,
            "-c",
            "import shutil,sys; shutil.copytree(sys.argv[1], sys.argv[2])",
            str(src),
            str(work / "copy"),
        ],
        "mean": _cli("convert", str(src), str(mean_dst), "-g", "8", "-q", "--overwrite"),
        "svd": svd(args.calibration_tokens),
        "refit": svd(args.refit_tokens, "--refit", "--refit-steps", str(args.refit_steps)),
        "eval": _cli(
            "eval",
            "--original",
            str(src),
            "--converted",
            str(mean_dst),
            "--data",
            str(work / "heldout.txt"),
            "--max-tokens",
            str(args.eval_tokens),
            "--seq-len",
            str(args.eval_tokens),
            "--dtype",
            "bfloat16",
            "--samples",
            "1",
            "--sample-tokens",
            "8",
            "--output",
            str(results_file),
            "--overwrite",
            "-q",
        ),
        "inspect": _cli("inspect", str(src)),
        "plan": _cli("plan", str(src), "--gpu-memory", "80GB", "--seq-len", "4096"),
    }
    out: dict[str, dict[str, float]] = {}
    for name, cmd in steps.items():
        if name in args.skip or (name == "plan" and "inspect" in args.skip):
            continue
        if name in ("copy", "mean"):
            warm(src)  # both read from the page cache, as far as it holds the checkpoint
        wall, rss = measure(cmd)
        out[name] = {"seconds": wall, "peak_rss_mib": rss}
        print(f"{name:8s} wall {wall:8.1f} s   peak RSS {rss:8.0f} MiB", flush=True)
        if name == "copy":
            shutil.rmtree(work / "copy", ignore_errors=True)
        if name in ("svd", "refit"):
            out[name]["seconds_per_layer"] = wall / args.layers
        if name == "refit":
            record = json.loads((svd_dst / "mha2gqa_conversion.json").read_text())["conversion"]["refit"]
            out[name]["refit_seconds_per_layer"] = [r["seconds"] for r in record["layers"]]
            out[name]["refit_steps"] = args.refit_steps
        if name in ("svd", "refit"):
            shutil.rmtree(svd_dst, ignore_errors=True)
    if "eval" in out:
        r = json.loads(results_file.read_text())
        out["eval"].update(
            ppl_original=r["protocols"]["disjoint"]["original"]["ppl"],
            ppl_converted=r["protocols"]["disjoint"]["converted"]["ppl"],
            kl_mean=r["agreement"]["kl"]["mean"],
            attention_seconds=r["attention"]["seconds"],
            reference_bytes=r["reference"]["bytes"],
            model_bytes=size,
        )
    (work / "scale_7b.json").write_text(json.dumps({"checkpoint_bytes": size, "steps": out}, indent=2) + "\n")
    print(f"\ncheckpoint {size / 2**30:.2f} GiB, {sys.platform}\n")
    print("| step | wall | peak RSS | against |\n|---|---:|---:|---|")
    copy = out.get("copy", {}).get("seconds")
    for name, m in out.items():
        against = ""
        if name == "mean" and copy:
            against = f"{m['seconds'] / copy:.2f}x the copy's wall (target <= 2x); RSS target <= 1 GB"
        elif name == "svd":
            against = f"{m['seconds_per_layer']:.1f} s per layer; RSS target <= 4 GB"
        elif name == "refit":
            fit = sum(m["refit_seconds_per_layer"]) / len(m["refit_seconds_per_layer"])
            flops = refit_flops_per_layer(src)
            against = (
                f"{fit:.0f} s per layer for {m['refit_steps']} step(s) on this CPU; the default "
                f"{ConvertSettings.refit_steps} steps x {refit_windows(ConvertSettings.refit_batch, 512)} windows x "
                f"512 tokens are "
                f"{flops / 1e15:.2f} PFLOP a layer: ~{flops / 200e12:.0f} s a layer on a GPU at "
                f"200 TFLOP/s (TF32), ~{flops / 30e12:.0f} s at 30 TFLOP/s (FP32); RSS target <= 2.5 GB (4 layers)"
            )
        elif name == "eval":
            two = 2 * size / 2**30
            against = (
                f"one model at a time; both in memory would need > {two:.1f} GiB of weights alone; "
                f"reference cache {m['reference_bytes'] / 2**20:,.0f} MiB"
            )
        print(f"| {name} | {m['seconds']:.1f} s | {m['peak_rss_mib']:,.0f} MiB | {against} |")


if __name__ == "__main__":
    main()
