"""Every conversion method at every valid KV-head count on the real models in ../shared/fixtures
(and ``pydocs-neox``: a Pythia-style GPT-NeoX trained here on CPython's docs, converted through Phi).

For each model: calibrate on one text (``svd``), evaluate on held-out text with the disjoint
protocol (perplexity, ratio to the original, mean per-token KL, top-1 agreement) and time the
conversion (calibration included). With ``--refit``, the ``--refit-methods`` (contiguous grouping)
are converted again with ``--refit`` on the same calibration text, and both the plain and the
refitted conversion are also scored out of domain (``--ood``: a text of another kind than the
calibration text); ``closer`` is how many times nearer 1 the refitted ratio is. One table at the end.

    python benchmarks/methods.py [--fixtures ../shared/fixtures] [--eval-tokens 32768] [--refit]

``--real`` instead runs the recipes a user of a real model chooses between on SmolLM2-135M (30 layers,
9 query / 3 KV heads, head_dim 64; built from the fixtures' GGUF, see ``real_fixtures.py``), 3 -> 1 KV
head: ``mean``, ``svd``, ``aligned``, each without and with ``--refit`` at its default settings, and
per-layer counts at an average of 2 KV heads (``--per-layer auto`` against a blind half-and-half mix
of 3 and 1, each with ``svd`` and ``svd --refit``). Calibration: the first half of WikiText-2 test
(``--calibration-tokens``, default the conversion's own default); scored on the last
``--eval-tokens`` tokens of the second half (disjoint windows of 512) and out of domain on the start
of ``tinyshakespeare.txt`` (``--rescaled``: the same on SmolLM2 written differently, every layer's
``o_proj`` x 1/4 and ``v_proj`` x 4: the same function, so it must convert to the same quality); each
conversion runs as its own ``mha2gqa convert`` process, so its
wall time and peak resident memory are its own. The ``+kd`` recipes then run ``mha2gqa uptrain``
(``REAL_DISTILL``: a short distillation of the attention projections on the calibration text from
the original's cached top-64 distribution) as a second process; their time and peak are both
processes' together (the teacher pass included), and the conversion alone is scored first (its own
row, ``(before +kd)``). ``svd+refit+distill`` is the same two stages as one ``mha2gqa convert
--refit --distill`` at its defaults: what the README recommends for a real model.

    python benchmarks/methods.py --real [--recipes svd svd+refit ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from real_fixtures import DEFAULT_FIXTURES, Unavailable, smollm2, tail_text, wikitext_split

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


def _score(folder: Path, out: Path, settings, ood_settings, head: tuple, seconds: float, plain=None) -> tuple:
    """One table row: ``head`` (model, KV heads, label), the in-domain figures, the time, the
    out-of-domain ratio (with ``ood_settings``) and how many times closer to 1 than ``plain``."""
    from mha2gqa.eval.harness import evaluate

    r = evaluate(str(folder), str(out), settings).to_dict()
    d, agree = r["protocols"]["disjoint"], r["agreement"]
    ood = None
    if ood_settings is not None:
        ood = evaluate(str(folder), str(out), ood_settings).headline.ppl_ratio
    closer = (plain[5] - 1) / (d["ppl_ratio"] - 1) if plain and d["ppl_ratio"] != 1 else None
    row = (*head, d["original"]["ppl"], d["converted"]["ppl"], d["ppl_ratio"], agree["kl"]["mean"],
           agree["top1_agreement"], seconds, ood, closer)  # fmt: skip
    print("  ".join(map(str, row)), flush=True)
    return row


def main() -> None:
    from mha2gqa.convert import convert_checkpoint
    from mha2gqa.convert.settings import ConvertSettings
    from mha2gqa.core.architecture import dims_of
    from mha2gqa.core.checkpoint import read_config
    from mha2gqa.eval.settings import EvalSettings

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fixtures", type=Path, default=DEFAULT_FIXTURES)
    p.add_argument("--eval-tokens", type=int, default=32768)
    p.add_argument("--calibration-tokens", type=int, default=None, help="[default: 32768; --real: convert's]")
    p.add_argument("--models", nargs="*", default=None)
    p.add_argument("--methods", nargs="*", default=None, help="only these methods")
    p.add_argument("--refit", action="store_true", help="add a refitted row for each of --refit-methods")
    p.add_argument("--refit-methods", nargs="*", default=["mean", "svd"])
    p.add_argument("--refit-steps", type=int, default=None, help="[default: convert's]")
    p.add_argument("--ood", type=Path, default=None, help="out-of-domain text [default: wikitext2_test.txt]")
    p.add_argument("--real", action="store_true", help="the real-model recipes (see the module doc) instead")
    p.add_argument("--rescaled", action="store_true",
                   help="with --real: SmolLM2 written differently, the same function (every layer's o_proj x 1/4, "
                        "v_proj x 4: exact in bf16); its conversion must reach the same quality")  # fmt: skip
    p.add_argument("--recipes", nargs="*", default=None, help="with --real: only these (names as in REAL_RECIPES)")
    p.add_argument("--ood-tokens", type=int, default=8192, help="with --real: tokens scored out of domain")
    args = p.parse_args()
    if args.real:
        return real_model(args)
    args.calibration_tokens = args.calibration_tokens or 32768
    ood_text = str(args.ood or args.fixtures / "text" / "wikitext2_test.txt")
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
            ood = dataclasses.replace(settings, data=ood_text)

            for g in [g for g in range(dims.num_kv_heads - 1, 0, -1) if dims.num_kv_heads % g == 0]:
                for method, grouping in METHODS:
                    if args.methods and method not in args.methods:
                        continue
                    refit = args.refit and method in args.refit_methods and grouping == "contiguous"
                    calibrated = dict(
                        calibration=calib, calibration_tokens=args.calibration_tokens, calibration_seq_len=window
                    )
                    options = dict(progress=False, overwrite=True, grouping=grouping)
                    reads = ConvertSettings(num_kv_heads=g, method=method, grouping=grouping).reads_calibration
                    t = time.perf_counter()
                    out = convert_checkpoint(
                        folder, work / f"{name}-{method}-{g}", g, method, **options, **(calibrated if reads else {})
                    )
                    label = method if grouping == "contiguous" else f"{method} + similarity grouping"
                    head = (name, f"{dims.num_kv_heads}->{g}")
                    seconds = time.perf_counter() - t
                    plain = _score(folder, out.output, settings, ood if refit else None, (*head, label), seconds)
                    rows.append(plain)
                    if refit:
                        t = time.perf_counter()
                        out = convert_checkpoint(
                            folder, work / f"{name}-{method}-{g}-refit", g, method, refit=True,
                            **({"refit_steps": args.refit_steps} if args.refit_steps else {}), **options, **calibrated,
                        )  # fmt: skip
                        seconds = time.perf_counter() - t
                        label = f"{method} + refit"
                        rows.append(_score(folder, out.output, settings, ood, (*head, label), seconds, plain))
    print(
        f"\ndisjoint perplexity on held-out text ({args.eval_tokens:,} tokens), svd calibrated on "
        f"{args.calibration_tokens:,} tokens of separate text"
        + (f"; out of domain: {Path(ood_text).name}" if args.refit else "")
        + "\n"
    )
    print("| model | KV heads | method | original PPL | converted PPL | ratio | mean KL | top-1 | convert s |", end="")
    print(
        " out-of-domain ratio | closer |\n|---|---|---|---|---|---|---|---|---|---|---|"
        if args.refit
        else "\n|---|---|---|---|---|---|---|---|---|"
    )
    for name, g, method, po, pc, ratio, kl, top1, sec, ood_ratio, closer in rows:
        line = f"| {name} | {g} | {method} | {po:.3f} | {pc:.3f} | x{ratio:.3f} | {kl:.3f} | {top1:.1%} | {sec:.1f} |"
        if args.refit:
            line += f" {f'x{ood_ratio:.3f}' if ood_ratio else ''} | {f'{closer:.1f}x' if closer else ''} |"
        print(line)


#: recipe name -> ``mha2gqa convert`` options (SmolLM2-135M has 3 KV heads; 30 layers)
REAL_RECIPES: dict[str, list[str]] = {
    "mean": ["-g", "1", "--method", "mean"],
    "mean+refit": ["-g", "1", "--method", "mean", "--refit"],
    "svd": ["-g", "1", "--method", "svd"],
    "svd+refit": ["-g", "1", "--method", "svd", "--refit"],
    "aligned": ["-g", "1", "--method", "aligned"],
    "aligned+refit": ["-g", "1", "--method", "aligned", "--refit"],
    "svd/per-layer auto (avg 2)": ["-g", "2", "--per-layer", "auto", "--method", "svd"],
    "svd/blind 3,1 mix (avg 2)": ["--num-kv-heads-per-layer", ",".join(["3,1"] * 15), "--method", "svd"],
    "svd/per-layer auto, logits cost (avg 2)": ["-g", "2", "--per-layer", "auto", "--allocation-cost", "logits",
                                                "--method", "svd"],
    "svd/per-layer auto (avg 2)+refit": ["-g", "2", "--per-layer", "auto", "--method", "svd", "--refit"],
    "svd/blind 3,1 mix (avg 2)+refit": ["--num-kv-heads-per-layer", ",".join(["3,1"] * 15), "--method", "svd",
                                        "--refit"],
    "svd+refit 80x4": ["-g", "1", "--method", "svd", "--refit", "--refit-steps", "80", "--refit-batch", "4"],
    "svd+refit 80x4+kd 24x4": ["-g", "1", "--method", "svd", "--refit", "--refit-steps", "80", "--refit-batch", "4"],
    "svd+refit 40x4+kd 16x4": ["-g", "1", "--method", "svd", "--refit", "--refit-steps", "40", "--refit-batch", "4"],
    "svd+kd 24x4": ["-g", "1", "--method", "svd"],
    "svd+refit 40x4+kd 16x4 lr 3e-4": ["-g", "1", "--method", "svd", "--refit", "--refit-steps", "40",
                                       "--refit-batch", "4"],
    "svd+refit 80x4+kd 16x4 lr 3e-4": ["-g", "1", "--method", "svd", "--refit", "--refit-steps", "80",
                                       "--refit-batch", "4"],
    "svd+refit+distill": ["-g", "1", "--method", "svd", "--refit", "--distill"],  # one command, its defaults
    "recommended": ["-g", "1", "--recipe", "recommended"],  # the shipped recipe, as the README runs it
}  # fmt: skip

#: recipe name -> ``mha2gqa uptrain`` options of the distillation pass that follows its conversion:
#: the converted model's attention projections distilled from the original's top-64 next-token
#: distribution on the calibration text (the teacher pass, into a fresh cache, counts in its time)
REAL_DISTILL: dict[str, list[str]] = {
    name: ["--objective", "kd", "--train", "attention", "--teacher-top-k", "64", "--seq-len", "512",
           "--batch-size", "4", "--max-steps", steps, "--lr", lr, "--min-lr-ratio", "1", "--save-every", "100000"]
    for name, steps, lr in (("svd+refit 80x4+kd 24x4", "24", "1e-4"), ("svd+refit 40x4+kd 16x4", "16", "1e-4"),
                            ("svd+kd 24x4", "24", "1e-4"), ("svd+refit 40x4+kd 16x4 lr 3e-4", "16", "3e-4"),
                            ("svd+refit 80x4+kd 16x4 lr 3e-4", "16", "3e-4"))
}  # fmt: skip


def _real_row(name: str, model: Path, out: Path, domains: dict, seconds: float, peak: float) -> tuple:
    """One recipe's row: the converted model ``out`` scored in and out of domain against ``model``."""
    from mha2gqa.core.conversion_record import read_conversion_record
    from mha2gqa.eval.harness import evaluate

    facts = read_conversion_record(out).conversion
    for stage in facts.guard.stages if facts.guard else ():  # each stage's held-out KL, kept or undone
        print(f"{name}: guard: {stage.line()}", flush=True)
    if facts.num_kv_heads_per_layer:
        print(f"{name}: KV heads per layer {','.join(map(str, facts.num_kv_heads_per_layer))}", flush=True)
    d, o = (evaluate(str(model), str(out), settings) for settings in domains.values())
    p = d.protocols["disjoint"]
    row = (name, p.original.ppl, p.converted.ppl, p.ppl_ratio, d.agreement.kl.mean,
           d.agreement.top1_agreement, o.protocols["disjoint"].ppl_ratio, seconds, peak)  # fmt: skip
    print("  ".join(map(str, row)), flush=True)
    return row


def _mha2gqa_process(*args: str) -> tuple[float, float]:
    """Run ``mha2gqa ARGS`` as its own process: ``(seconds, peak resident MiB)``."""
    argv = [sys.executable, "-c", "from mha2gqa.cli import main; main()", *args]
    t = time.perf_counter()
    with tempfile.TemporaryFile() as log:  # a file, not a pipe: a full pipe would stall the child
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        err = log.read().decode(errors="replace").strip().splitlines()
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv[3:])}: exit {proc.returncode}: {err[-1:]}")
    return seconds, usage.ru_maxrss / 1024  # KiB on Linux


def rescaled(model: Path, out: Path, o: float = 0.25, v: float = 4.0) -> Path:
    """A copy of ``model`` in ``out`` computing the same function, written differently: every layer's
    ``o_proj`` times ``o`` and ``v_proj`` times ``v`` (``o * v == 1``; powers of two are exact)."""
    import torch
    from safetensors.torch import load_file, save_file

    assert o * v == 1.0
    shutil.copytree(model, out)
    tensors = load_file(model / "model.safetensors")
    for name, t in tensors.items():
        scale = o if ".o_proj." in name else v if ".v_proj." in name else None
        if scale is not None:
            tensors[name] = (t.to(torch.float32) * scale).to(t.dtype)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def real_model(args) -> None:
    """The SmolLM2-135M table (module doc)."""
    from mha2gqa.eval.settings import EvalSettings

    try:
        model, _ = smollm2(args.fixtures)
    except Unavailable as e:
        raise SystemExit(str(e)) from None
    chosen = args.recipes or list(REAL_RECIPES)
    unknown = [r for r in chosen if r not in REAL_RECIPES]
    if unknown:
        raise SystemExit(f"unknown recipes {unknown}: choose from {list(REAL_RECIPES)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.rescaled:
            model = rescaled(model, work / "rescaled")
        calib, held = wikitext_split(args.fixtures, work)
        held = tail_text(held, model, args.eval_tokens, work / "wikitext_heldout_tail.txt")
        ood = str(args.fixtures / "text" / "tinyshakespeare.txt")
        common = dict(seq_len=512, attention=False, samples=0, progress=False, reference_cache=str(work / "ref"))
        domains = {
            "wikitext": EvalSettings(data=str(held), max_tokens=args.eval_tokens, **common),
            "shakespeare": EvalSettings(data=ood, max_tokens=args.ood_tokens, **common),
        }
        calibration = ["--calibration", str(calib), "--calibration-seq-len", "512"]
        if args.calibration_tokens:
            calibration += ["--calibration-tokens", str(args.calibration_tokens)]
        for name in chosen:
            out = work / "out"
            options = [*REAL_RECIPES[name], "--overwrite"] + (calibration if name != "mean" else [])
            seconds, peak = _mha2gqa_process("convert", str(model), str(out), *options)
            if name in REAL_DISTILL:  # the conversion alone first, then the distillation pass into out-kd
                rows.append(_real_row(f"{name.split('+kd')[0]} (before +kd)", model, out, domains, seconds, peak))
                kd = [*REAL_DISTILL[name], "--data", str(calib), "--teacher", str(model), "--overwrite", "-q",
                      "--teacher-cache", str(work / "teacher"), "--output", str(work / "out-kd")]  # fmt: skip
                more, peak_kd = _mha2gqa_process("uptrain", str(out), *kd)
                shutil.rmtree(work / "teacher", ignore_errors=True)  # the next recipe pays its own teacher pass
                seconds, peak, out = seconds + more, max(peak, peak_kd), work / "out-kd"
            rows.append(_real_row(name, model, out, domains, seconds, peak))
    print(
        f"\nSmolLM2-135M{' rescaled (o x 1/4, v x 4)' if args.rescaled else ''} 3 -> 1 KV head (per-layer: 2 on "
        f"average); calibrated on the first half of WikiText-2 test; "
        f"in domain: its last {args.eval_tokens:,} tokens, disjoint windows of 512; out of domain: the first "
        f"{args.ood_tokens:,} tokens of tinyshakespeare.txt\n"
    )
    print("| recipe | original PPL | converted PPL | ratio | mean KL | top-1 | out-of-domain ratio |", end="")
    print(" convert s | peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, po, pc, ratio, kl, top1, ood_ratio, sec, peak in rows:
        print(f"| {name} | {po:.2f} | {pc:.2f} | x{ratio:.3f} | {kl:.3f} | {top1:.1%} | x{ood_ratio:.3f} | "
              f"{sec:.0f} | {peak:,.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
