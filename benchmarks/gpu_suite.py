"""Every GPU path proven, and the speed figures taken, in one command.

    python benchmarks/gpu_suite.py --out gpu-out                  # on a CUDA machine (~10 min on an H100)
    python benchmarks/gpu_suite.py --out gpu-out --wheels wheels  # a bare machine: install what it lacks
    python benchmarks/gpu_suite.py --out smoke --device cpu --tiny   # CPU smoke mode (in the test suite)

1. Installs what the machine lacks of mha2gqa's dependencies from ``--wheels`` (no network: ``pip
   install --no-index --find-links``), and mha2gqa itself (editable, no build isolation).
2. Runs ``pytest -m gpu`` (tests/test_gpu.py: CUDA eval vs CPU in fp32 and bf16, one model at a time
   vs both, ``--device-map auto``, calibration and ``svd`` on CUDA vs CPU, bf16-autocast uptraining
   vs CPU, ``bench`` cache bytes vs the planner). Not in ``--tiny`` mode (CPU has no GPU tests).
3. Speed figures on a random ~1.2B-parameter Llama (22 layers, hidden 2048, 32 heads, vocabulary
   32,000; ``--tiny``: 2 layers, hidden 64) in bf16 (fp32 on CPU):
   - perplexity tokens/s of mha2gqa's pass vs a plain ``model(x, labels=x)`` loop (target >= 1.0x);
   - attention similarity vs the eager ``output_attentions`` route: wall time and peak memory;
   - decode tokens/s and KV cache bytes with H, H/4 and 1 KV heads at batch 1, 8, 32, 64 with a
     2,048-token context (prompt + new tokens), and where a batch runs out of memory;
   - calibration seconds per layer (``svd`` with 512 calibration tokens on the device);
   - the refit's seconds per layer and per step at its defaults (200 steps of 8 windows at most) on a
     random model of SmolLM2-135M's shape (30 layers, hidden 576, 9 heads of 64; ``--tiny``: 2 layers),
     9 -> 1 KV head with ``svd --refit`` on 16,384 calibration tokens, as issue 33's real-model runs;
   - what ``--per-layer auto`` (its default logits cost) adds to an ``svd`` conversion at 2 KV heads per
     layer on average, on the same random model and tokens.
   ``--figures`` picks some of them (``tests,perplexity,attention,decode,calibration,refit,allocation``).
4. Writes ``gpu_suite.md`` (one table) and ``gpu_suite.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: import name -> distribution of what mha2gqa needs at run time (pyproject.toml's dependencies).
NEEDED = {
    "torch": "torch",
    "transformers": "transformers",
    "accelerate": "accelerate",
    "safetensors": "safetensors",
    "datasets": "datasets",
    "click": "click",
    "yaml": "pyyaml",
    "tqdm": "tqdm",
    "matplotlib": "matplotlib",
    "huggingface_hub": "huggingface_hub",
    "psutil": "psutil",
    "pytest": "pytest",
}

#: set when the script runs itself again after installing: what the first run installed.
INSTALLED_ENV = "MHA2GQA_GPU_SUITE_INSTALLED"

FULL = {
    "layers": 22,
    "hidden": 2048,
    "heads": 32,
    "vocab": 32000,
    "context": 2048,
    "new_tokens": 64,
    "batches": (1, 8, 32, 64),
    "ppl_tokens": 32768,
    "seq_len": 2048,
    "ppl_batch": 4,
    "attn_seq_len": 1024,
    "calibration_tokens": 512,
    "refit": {"layers": 30, "hidden": 576, "heads": 9, "intermediate": 1536, "vocab": 8192, "tokens": 16384},
}
TINY = {
    "layers": 2,
    "hidden": 64,
    "heads": 8,
    "vocab": 512,
    "context": 64,
    "new_tokens": 8,
    "batches": (1, 4),
    "ppl_tokens": 1024,
    "seq_len": 128,
    "ppl_batch": 2,
    "attn_seq_len": 64,
    "calibration_tokens": 128,
    "refit": {"layers": 2, "hidden": 64, "heads": 8, "intermediate": 128, "vocab": 512, "tokens": 1024},
}
#: what the suite can measure, in the order it runs them (``--figures``)
FIGURES = ("tests", "perplexity", "attention", "decode", "calibration", "refit", "allocation")


def ensure_installed(wheels: Path | None) -> list[str]:
    """Install the missing dependencies from ``wheels`` (offline) and mha2gqa; returns what it installed."""
    missing = [dist for mod, dist in NEEDED.items() if importlib.util.find_spec(mod) is None]
    installed = []
    if missing:
        if wheels is None:
            raise SystemExit(
                f"missing {', '.join(missing)}: pass --wheels DIR holding their wheels "
                "(pip download -d DIR ... on a machine with network)"
            )
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels)]
        subprocess.check_call([*pip, *missing])
        installed += missing
    if importlib.util.find_spec("mha2gqa") is None:
        subprocess.check_call(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "--no-index",
                "-e",
                str(ROOT),
            ]
        )
        installed.append("mha2gqa")
    if installed and INSTALLED_ENV in os.environ:
        raise SystemExit(f"installed {', '.join(installed)}, but a fresh interpreter lacks them: check pip's target")
    if installed:
        # What was installed (an editable install's import hook above all) is seen only by a fresh
        # interpreter: run this script again, telling it what this one installed.
        env = {**os.environ, INSTALLED_ENV: ",".join(installed)}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    return [name for name in os.environ.get(INSTALLED_ENV, "").split(",") if name]


def run_gpu_tests(out: Path) -> dict:
    """``pytest -m gpu``: counts of passed/failed/skipped and the tail of its output."""
    t = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "gpu",
            str(ROOT / "tests" / "test_gpu.py"),
            f"--junitxml={out / 'gpu_tests.xml'}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    (out / "gpu_tests.log").write_text(proc.stdout + proc.stderr)
    import xml.etree.ElementTree as ET

    counts = {"passed": 0, "failed": 0, "skipped": 0}
    try:
        suite = ET.parse(out / "gpu_tests.xml").getroot().find("testsuite")
        total, fail = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped = int(suite.get("skipped", 0))
        counts = {"passed": total - fail - skipped, "failed": fail, "skipped": skipped}
    except (OSError, ET.ParseError, AttributeError):
        counts["failed"] = 1
    return {**counts, "seconds": time.perf_counter() - t, "tail": proc.stdout.strip().splitlines()[-1:]}


def _config(size: dict, kv_heads: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=size["vocab"],
        hidden_size=size["hidden"],
        intermediate_size=size["hidden"] * 11 // 4,
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=kv_heads,
        max_position_embeddings=max(4096, size["context"]),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _model(size: dict, kv_heads: int, device, dtype):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(_config(size, kv_heads))
    return model.to(dtype).eval()


def decode_figures(size: dict, device, dtype) -> list[dict]:
    """Decode tokens/s and KV bytes for H, H/4 and 1 KV heads at each batch size (OOM recorded)."""
    import torch

    from mha2gqa.eval.bench import bench_model

    rows = []
    heads = size["heads"]
    for kv in (heads, heads // 4, 1):
        model = _model(size, kv, device, dtype)
        params = sum(p.numel() for p in model.parameters())
        for batch in size["batches"]:
            row = {"kv_heads": kv, "batch": batch, "parameters": params}
            try:
                out = bench_model(
                    model,
                    size["context"] - size["new_tokens"],
                    size["new_tokens"],
                    repeats=3,
                    warmup=1,
                    batch_size=batch,
                )
                kv_bytes = out.kv_cache.measured_bytes
                row.update(
                    decode_tokens_per_second=out.decode_tokens_per_second.median,
                    prefill_seconds=out.prefill_seconds.median,
                    kv_cache_bytes=kv_bytes,
                    kv_matches_plan=kv_bytes == out.kv_cache.planned_bytes,
                )
            except torch.OutOfMemoryError:
                row["oom"] = True
            if device.type == "cuda":
                row["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            rows.append(row)
            print(f"  decode kv={kv:3d} batch={batch:3d}: {_decode_cell(row)}", flush=True)
        del model
    return rows


def speed_figures(size: dict, device_name: str, dtype_name: str, figures: set[str]) -> dict:
    import torch

    sys.path.insert(0, str(HERE))
    import eval_speed

    device = torch.device(device_name)
    dtype = getattr(torch, dtype_name)
    args = {
        "device": device_name,
        "dtype": dtype_name,
        "hidden": size["hidden"],
        "layers": size["layers"],
        "heads": size["heads"],
        "kv": size["heads"] // 4,
        "vocab": size["vocab"],
        "seq_len": size["seq_len"],
        "ppl_tokens": size["ppl_tokens"],
        "batch_size": size["ppl_batch"],
        "attn_seq_len": size["attn_seq_len"],
        "repeats": 3,
    }
    out: dict = {}
    if "perplexity" in figures:
        t = time.perf_counter()
        out["perplexity"] = eval_speed.perplexity_bench(args)
        print(f"  perplexity: {out['perplexity']} ({time.perf_counter() - t:.0f} s)", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "attention" in figures:
        out["attention"] = {
            k: {"wall": v["wall"], "peak_bytes": v["peak_bytes"]} for k, v in eval_speed.attention_bench(args).items()
        }
        print(f"  attention: {out['attention']}", flush=True)
    if "decode" in figures:
        out["decode"] = decode_figures(size, device, dtype)
    if "calibration" in figures:
        out["calibration"] = calibration_figure(size, device_name)
    if "refit" in figures:
        if device.type == "cuda":  # the baseline: one calibration window a call
            from mha2gqa.convert import refit
            from mha2gqa.convert.settings import CALIBRATION_WINDOW

            default = dict(refit.CALL_TOKENS)
            refit.CALL_TOKENS["cuda"] = CALIBRATION_WINDOW
            try:
                out["refit_one_window_a_call"] = refit_figure(size["refit"], device_name)
            finally:
                refit.CALL_TOKENS.update(default)
        out["refit"] = refit_figure(size["refit"], device_name)
    if "allocation" in figures:
        out["allocation"] = allocation_figure(size["refit"], device_name)
    return out


def calibration_figure(size: dict, device_name: str) -> dict:
    """Seconds per layer of an ``svd`` conversion to H/4 KV heads with calibration on the device."""
    import tempfile

    import torch

    from mha2gqa.convert import convert_checkpoint
    from mha2gqa.demo import build_tokenizer, cpython_text

    with tempfile.TemporaryDirectory(prefix="mha2gqa-gpu-suite-") as tmp:
        src = Path(tmp) / "mha"
        _model(size, size["heads"], "cpu", torch.bfloat16).save_pretrained(src)
        train, _ = cpython_text(0.1)
        build_tokenizer(train, min(size["vocab"], 4096)).save_pretrained(src)
        (Path(tmp) / "calibration.txt").write_text(train)
        t = time.perf_counter()
        convert_checkpoint(
            src,
            Path(tmp) / "svd",
            size["heads"] // 4,
            method="svd",
            device=device_name,
            calibration=str(Path(tmp) / "calibration.txt"),
            calibration_tokens=size["calibration_tokens"],
            calibration_seq_len=min(512, size["calibration_tokens"]),
            progress=False,
        )
        seconds = time.perf_counter() - t
    print(f"  calibration: {seconds / size['layers']:.2f} s per layer", flush=True)
    return {"seconds": seconds, "seconds_per_layer": seconds / size["layers"], "tokens": size["calibration_tokens"]}


def _smollm2_shaped(tmp: Path, shape: dict) -> tuple[Path, Path]:
    """A random MHA Llama of ``shape`` (SmolLM2-135M's in the full suite) with a tokenizer, saved in
    ``tmp``; returns its folder and a calibration text beside it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mha2gqa.demo import build_tokenizer, cpython_text

    config = LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["heads"],
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    src = tmp / "mha"
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(src)
    train, _ = cpython_text(0.1)
    build_tokenizer(train, min(shape["vocab"], 4096)).save_pretrained(src)
    (tmp / "calibration.txt").write_text(train)
    return src, tmp / "calibration.txt"


def refit_figure(shape: dict, device_name: str) -> dict:
    """Seconds per layer and per step of ``svd --refit`` at its default steps and batch, H -> 1 KV head,
    on a random Llama of ``shape`` (float32 on the device, as the refit runs)."""
    import statistics
    import tempfile

    from mha2gqa.convert import convert_checkpoint

    with tempfile.TemporaryDirectory(prefix="mha2gqa-gpu-suite-") as tmp:
        src, calibration = _smollm2_shaped(Path(tmp), shape)
        t = time.perf_counter()
        result = convert_checkpoint(
            src,
            Path(tmp) / "refit",
            1,
            method="svd",
            device=device_name,
            calibration=str(calibration),
            calibration_tokens=shape["tokens"],
            refit=True,
            progress=False,
        )
        seconds = time.perf_counter() - t
    layers = result.facts.refit.layers
    per_layer = [r.seconds for r in layers]
    per_step = [r.seconds / r.steps for r in layers if r.steps]
    figure = {
        "shape": shape,
        "seconds": seconds,
        "refit_seconds": sum(per_layer),
        "seconds_per_layer": statistics.median(per_layer),
        "seconds_per_step": statistics.median(per_step),
        "steps": [r.steps for r in layers],
        "max_steps": result.facts.refit.steps,
        "batch": result.facts.refit.batch,
    }
    print(
        f"  refit: {figure['seconds_per_layer']:.2f} s per layer, {figure['seconds_per_step'] * 1e3:.1f} ms per step "
        f"(median; {statistics.mean(figure['steps']):.0f} of {figure['max_steps']} steps on average), "
        f"{seconds:.0f} s for the conversion",
        flush=True,
    )
    return figure


def allocation_figure(shape: dict, device_name: str) -> dict:
    """Seconds of ``svd --per-layer auto`` (the default logits cost) at 2 KV heads per layer on average
    against the same ``svd`` at uniform counts, on a random Llama of ``shape``: the difference is what
    the allocation costs (every layer merged at every count and carried through the later layers)."""
    import tempfile

    from mha2gqa.convert import convert_checkpoint
    from mha2gqa.convert.settings import ConvertSettings

    with tempfile.TemporaryDirectory(prefix="mha2gqa-gpu-suite-") as tmp:
        src, calibration = _smollm2_shaped(Path(tmp), shape)
        common = {
            "method": "svd",
            "device": device_name,
            "calibration": str(calibration),
            "calibration_tokens": shape["tokens"],
            "progress": False,
        }
        seconds = {}
        # uniform first as a warm-up (the device's start-up), then the two timed runs
        for name in ("warm-up", "auto", "uniform"):
            options = {"per_layer": "auto", "kv_budget": 2.0} if name == "auto" else {}
            t = time.perf_counter()
            result = convert_checkpoint(src, Path(tmp) / name, None if options else 1, **common, **options)
            seconds[name] = time.perf_counter() - t
            if name == "auto":
                allocation = result.facts.per_layer_allocation
    figure = {
        "shape": shape,
        "uniform_seconds": seconds["uniform"],
        "auto_seconds": seconds["auto"],
        "allocation_seconds": seconds["auto"] - seconds["uniform"],
        "chosen": allocation.chosen,
        "cost": ConvertSettings.allocation_cost,
        "cost_measure": allocation.cost_measure,
    }
    print(
        f"  allocation: {figure['allocation_seconds']:.0f} s ({seconds['auto']:.0f} s per-layer auto against "
        f"{seconds['uniform']:.0f} s uniform), chose {allocation.chosen}",
        flush=True,
    )
    return figure


def _decode_cell(row: dict) -> str:
    from mha2gqa.core.units import format_bytes

    if row.get("oom"):
        return "out of memory"
    plan = "" if row["kv_matches_plan"] else " (differs from the planner's)"
    return f"{row['decode_tokens_per_second']:,.0f} tok/s, KV cache {format_bytes(row['kv_cache_bytes'])}{plan}"


def markdown(results: dict) -> str:
    s, sp = results["size"], results["speed"]
    lines = [
        f"GPU suite, {results['date']}, {results['device']} ({results['dtype']}); random Llama "
        f"{s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads, vocabulary {s['vocab']}.",
        "",
        "| figure | value |",
        "|---|---|",
    ]
    t = results.get("tests")
    if t:
        lines.append(
            f"| `pytest -m gpu` | {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped "
            f"({t['seconds']:.0f} s) |"
        )
    p = sp.get("perplexity")
    if p:
        ratio = p["mha2gqa"]["tokens_per_s"] / p["plain"]["tokens_per_s"]
        lines.append(
            f"| perplexity tok/s, mha2gqa vs plain loop | {p['mha2gqa']['tokens_per_s']:,.0f} vs "
            f"{p['plain']['tokens_per_s']:,.0f} ({ratio:.2f}x; ppl {p['mha2gqa']['ppl']:.4f} vs "
            f"{p['plain']['ppl']:.4f}) |"
        )
    a = sp.get("attention")
    if a:
        lines.append(
            f"| attention similarity at {s['attn_seq_len']} tokens, mha2gqa vs eager | {a['ours']['wall']:.2f} s "
            f"vs {a['eager']['wall']:.2f} s; {a['ours']['peak_bytes'] / 2**20:,.0f} vs "
            f"{a['eager']['peak_bytes'] / 2**20:,.0f} MiB |"
        )
    for row in sp.get("decode", []):
        lines.append(
            f"| decode, {row['kv_heads']} KV heads, batch {row['batch']}, context {s['context']} | "
            f"{_decode_cell(row)} |"
        )
    c = sp.get("calibration")
    if c:
        lines.append(f"| svd calibration ({c['tokens']} tokens) | {c['seconds_per_layer']:.2f} s per layer |")
    for key, how in (("refit_one_window_a_call", ", one window a call (a CPU's)"), ("refit", "")):
        r = sp.get(key)
        if not r:
            continue
        sh = r["shape"]
        lines.append(
            f"| `svd --refit` {sh['heads']} -> 1 KV head, {sh['layers']} layers of hidden {sh['hidden']}, "
            f"{sh['tokens']:,} tokens, at most {r['max_steps']} steps x {r['batch']} windows{how} | "
            f"{r['seconds_per_layer']:.2f} s per layer, {r['seconds_per_step'] * 1e3:.1f} ms per step (medians; "
            f"{sum(r['steps']) / len(r['steps']):.0f} steps a layer on average); {r['seconds']:.0f} s in all |"
        )
    al = sp.get("allocation")
    if al:
        sh = al["shape"]
        lines.append(
            f"| `svd --per-layer auto` ({al['cost']} cost), {sh['heads']} KV heads -> 2 per layer on average, "
            f"{sh['layers']} layers of hidden {sh['hidden']}, {sh['tokens']:,} tokens | "
            f"{al['allocation_seconds']:.0f} s for the allocation ({al['auto_seconds']:.0f} s in all against "
            f"{al['uniform_seconds']:.0f} s for uniform 1) |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny model and batches: the CPU smoke mode")
    parser.add_argument("--wheels", type=Path, default=None, help="wheels of missing dependencies (offline)")
    parser.add_argument("--skip-tests", action="store_true", help="the same as --figures without tests")
    parser.add_argument(
        "--figures", default=",".join(FIGURES), help=f"what to measure, comma-separated from {','.join(FIGURES)}"
    )
    args = parser.parse_args(argv)
    figures = {f.strip() for f in args.figures.split(",") if f.strip()}
    if not figures or figures - set(FIGURES):
        parser.error(f"--figures {args.figures!r}: give some of {','.join(FIGURES)}, comma-separated")
    if args.skip_tests:
        figures.discard("tests")
    args.out.mkdir(parents=True, exist_ok=True)
    installed = ensure_installed(args.wheels)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run on a GPU machine, or --device cpu --tiny for the smoke mode")
    size = TINY if args.tiny else FULL
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    results: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "device": name,
        "dtype": dtype,
        "installed": installed,
        "size": size,
        "versions": {"torch": torch.__version__},
    }
    if not args.tiny and "tests" in figures:
        results["tests"] = run_gpu_tests(args.out)
        print(f"pytest -m gpu: {results['tests']}", flush=True)
    results["speed"] = speed_figures(size, args.device, dtype, figures)
    (args.out / "gpu_suite.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    table = markdown(results)
    (args.out / "gpu_suite.md").write_text(table)
    print(table)
    return results


if __name__ == "__main__":
    main()
