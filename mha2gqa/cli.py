"""The ``mha2gqa`` command line: one click group, user errors as one line and a non-zero exit."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from mha2gqa.errors import Mha2GqaError

CONTEXT = {"auto_envvar_prefix": "MHA2GQA", "show_default": True, "help_option_names": ["-h", "--help"]}


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn :class:`Mha2GqaError` into click's one-line ``Error: ...`` and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Mha2GqaError as e:
            raise click.ClickException(str(e)) from None

    return wrapper


def text_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--text-field`` and ``--doc-split``: how a text source is read (eval, uptrain)."""
    fn = click.option(
        "--doc-split",
        type=click.Choice(["file", "paragraph", "line"]),
        default="file",
        help="How a .txt file is cut into documents (the rolling protocol's unit).",
    )(fn)
    return click.option(
        "--text-field", default="text", help="Field holding the text in .jsonl/.parquet/datasets sources."
    )(fn)


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="mha2gqa")
def main() -> None:
    """Convert multi-head-attention checkpoints to grouped-query attention, and measure the cost."""


@main.command()
@click.argument("src")
@click.argument("dst", type=click.Path(path_type=Path))
@click.option(
    "-g", "--num-kv-heads", type=int, required=True, help="KV heads after conversion (a divisor of the current count)."
)
@click.option(
    "--method",
    type=click.Choice(["mean", "first", "random", "svd", "aligned"]),
    default="mean",
    help="mean/first: pool or pick each group's heads (GQA paper); random: fresh K/V; "
    "svd: activation-aware merge absorbed into q/o (needs --calibration); aligned: RoPE-compatible "
    "rotations/Procrustes, then mean (weights only, or with --calibration).",
)
@click.option("--calibration", default=None, help="Calibration text for svd/aligned (same sources as eval --data).")
@click.option("--calibration-tokens", type=int, default=16384, help="Calibration tokens (the first N of the text).")
@click.option("--device", default="auto", help="Device for calibration: auto, cpu, cuda.")
@click.option("--seed", type=int, default=0, help="Seed for --method random.")
@click.option(
    "--grouping",
    type=click.Choice(["contiguous", "similarity"]),
    default="contiguous",
    help="Which heads share a KV head: repeat_kv blocks, or the most similar heads per layer (needs --calibration).",
)
@click.option("--max-shard-size", default="5GB", help="Largest output shard, HF style ('5GB', '500MB').")
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit) when SRC is a hub id.")
@click.option("--overwrite", is_flag=True, help="Replace DST if it exists and is not empty.")
@click.option("--allow-pickle", is_flag=True, help="Read PyTorch .bin checkpoints (with weights_only=True).")
@click.option("--fsync", is_flag=True, help="Flush every shard to disk before renaming the output into place.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or summary.")
@user_errors
def convert(
    src: str,
    dst: Path,
    num_kv_heads: int,
    method: str,
    max_shard_size: str,
    revision: str | None,
    overwrite: bool,
    allow_pickle: bool,
    fsync: bool,
    quiet: bool,
    calibration: str | None = None,
    calibration_tokens: int = 16384,
    device: str = "auto",
    seed: int = 0,
    grouping: str = "contiguous",
) -> None:
    """Convert the checkpoint SRC (local folder or hub id) into DST with fewer KV heads."""
    from mha2gqa.convert import convert_checkpoint

    result = convert_checkpoint(
        src, dst, num_kv_heads, method,
        max_shard_size=max_shard_size, overwrite=overwrite, allow_pickle=allow_pickle,
        revision=revision, progress=not quiet, fsync=fsync, calibration=calibration,
        calibration_tokens=calibration_tokens, device=device, seed=seed, grouping=grouping,
    )  # fmt: skip
    if not quiet:
        click.echo(result.summary())


def _run_and_print(job, output_dir: Path | None, quiet: bool) -> None:
    from mha2gqa.eval.gates import GATE_EXIT_CODE
    from mha2gqa.jobs import run_job

    result = run_job(job, output_dir, log=(lambda m: None) if quiet else click.echo, progress=False)
    if quiet:
        return
    first = result.rows[0] if result.rows else None
    click.echo(
        f"{'model':<30} {'KV heads':>8} {'KV cache B/token':>16} {'perplexity':>11} {'ratio':>8} {'KL':>8} {'top-1':>7}"
    )
    if first:
        kv0 = first["kv_bytes_per_token_before"]
        click.echo(f"{'original':<30} {'':>8} {kv0:>16,} {first['original_ppl']:>11.3f} {'1.00x':>8}")
    for r in result.rows:
        label = f"{r['method']} -> {r['num_kv_heads']} KV heads"
        click.echo(f"{label:<30} {r['num_kv_heads']:>8} {r['kv_bytes_per_token']:>16,} {r['converted_ppl']:>11.3f} "
                   f"{r['ppl_ratio']:>7.2f}x {r['kl_mean']:>8.3f} {r['top1']:>7.1%}")  # fmt: skip
    click.echo(f"results: {result.output_dir / 'results'}")
    if result.report:
        click.echo(f"report: {result.report}")
    if not result.gates_passed:
        sys.exit(GATE_EXIT_CODE)


@main.command()
@click.argument("job_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--output-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where models, results and the report go [default: the job's output_dir].",
)
@click.option("-q", "--quiet", is_flag=True, help="No summary.")
@user_errors
def run(job_file: Path, output_dir: Path | None, quiet: bool) -> None:
    """Run a job file: convert a model to every KV-head count and method it lists, evaluate each
    against the original, render one report and check the gates (exit 3 if one fails)."""
    from mha2gqa.jobs import load_job

    _run_and_print(load_job(job_file), output_dir, quiet)


@main.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Job file [default: the shipped configs/demo.yaml].",
)
@click.option(
    "-g",
    "--num-kv-heads",
    "kv_heads",
    type=int,
    multiple=True,
    help="KV-head counts (repeatable) [default: the job's].",
)
@click.option(
    "--method",
    "methods",
    type=click.Choice(["mean", "first", "random", "svd", "aligned"]),
    multiple=True,
    help="Methods (repeatable) [default: the job's].",
)
@click.option(
    "--steps", type=int, default=None, help="Training steps of the demo model [default: the job's, ~1 min on 2 cores]."
)
@click.option(
    "--output-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where models, results and the report go [default: the cache].",
)
@click.option(
    "--uptrain-steps", type=int, default=None, help="Uptraining steps per conversion [default: the job's]; 0: none."
)
@click.option("--rebuild", is_flag=True, help="Retrain the cached demo model.")
@user_errors
def demo(
    config_file: Path | None,
    kv_heads: tuple[int, ...],
    methods: tuple[str, ...],
    steps: int | None,
    output_dir: Path | None,
    uptrain_steps: int | None,
    rebuild: bool,
) -> None:
    """The whole pipeline offline: train (once, cached) a small MHA Llama on CPython's docs, convert
    it to fewer KV heads, evaluate, and write an HTML report."""
    import dataclasses

    from mha2gqa.demo import demo_model
    from mha2gqa.jobs import load_job, shipped_jobs

    job = load_job(config_file or shipped_jobs()["demo"])
    if steps is not None:
        job.demo = dataclasses.replace(job.demo, steps=steps)
    job.num_kv_heads = kv_heads or job.num_kv_heads
    job.methods = methods or job.methods
    if uptrain_steps == 0:
        job.uptrain = {}
    elif uptrain_steps is not None:
        job.uptrain = {**job.uptrain, "max_steps": uptrain_steps}
    if rebuild and job.source == "demo":
        demo_model(job.demo, rebuild=True, log=click.echo)
    _run_and_print(job, output_dir, quiet=False)


@main.command(name="eval")
@click.option(
    "--original",
    "--model",
    "original",
    required=True,
    help="The original model (folder or hub id); alone, it is evaluated by itself.",
)
@click.option("--converted", default=None, help="Its conversion, compared with it on the same tokens.")
@click.option(
    "--data", required=True, help="Text: a .txt/.jsonl/.json/.parquet file or a datasets name 'name[:config]:split'."
)
@text_options
@click.option(
    "--protocol",
    "protocols",
    type=click.Choice(["disjoint", "stride", "rolling"]),
    multiple=True,
    default=("disjoint",),
    help="Perplexity protocols (repeatable).",
)
@click.option("--seq-len", type=int, default=None, help="Window length [default: min(2048, the model's positions)].")
@click.option("--stride", type=int, default=None, help="Stride of the 'stride' protocol [default: seq_len // 2].")
@click.option("--max-tokens", type=int, default=None, help="Token budget (the first N tokens of the text).")
@click.option("--batch-size", type=int, default=1, help="Windows per forward pass.")
@click.option("--device", default="auto", help="auto, cpu, cuda or cuda:N.")
@click.option("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16 or float16.")
@click.option("--device-map", default=None, help="'auto' to spread a model too large for one GPU across devices.")
@click.option("--attention/--no-attention", default=True, help="Per-layer, per-head attention similarity (pairs only).")
@click.option(
    "--attention-seq-len", type=int, default=None, help="Window for attention similarity [default: min(seq_len, 1024)]."
)
@click.option(
    "--output", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the results JSON here."
)
@click.option("--max-ppl-ratio", type=float, default=None, help="Gate: converted/original perplexity at most this.")
@click.option("--max-kl", type=float, default=None, help="Gate: mean per-token KL (nats) at most this.")
@click.option("--min-top1", type=float, default=None, help="Gate: top-1 agreement (0-1) at least this.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars or summary.")
@user_errors
def eval_cmd(
    original: str,
    converted: str | None,
    data: str,
    text_field: str,
    doc_split: str,
    protocols: tuple[str, ...],
    seq_len: int | None,
    stride: int | None,
    max_tokens: int | None,
    batch_size: int,
    device: str,
    dtype: str,
    device_map: str | None,
    attention: bool,
    attention_seq_len: int | None,
    output: Path | None,
    max_ppl_ratio: float | None,
    max_kl: float | None,
    min_top1: float | None,
    quiet: bool,
) -> None:
    """Perplexity, output agreement and attention similarity: ORIGINAL vs CONVERTED.

    Gates (--max-ppl-ratio applies to every protocol run, --max-kl, --min-top1) print a one-line
    verdict; when one fails the exit code is 3 (1: bad input, 2: bad usage)."""
    from mha2gqa.eval.gates import GATE_EXIT_CODE, check_gates, gates_record, verdict
    from mha2gqa.eval.harness import EvalSettings, evaluate, is_main_process, write_results
    from mha2gqa.eval.summary import summary_lines

    if converted is None and any(x is not None for x in (max_ppl_ratio, max_kl, min_top1)):
        raise Mha2GqaError("gates compare a conversion with its original: pass --converted")

    settings = EvalSettings(
        data=data, text_field=text_field, doc_split=doc_split, protocols=protocols, seq_len=seq_len, stride=stride,
        max_tokens=max_tokens, batch_size=batch_size, device=device, dtype=dtype, device_map=device_map,
        attention=attention, attention_seq_len=attention_seq_len, progress=not quiet,
    )  # fmt: skip
    results = evaluate(original, converted, settings)
    if not is_main_process():
        return
    gates = check_gates(results, max_ppl_ratio, max_kl, min_top1)
    if gates:
        results["gates"] = gates_record(gates)
    if output is not None:
        write_results(results, output)
    if not quiet:
        for line in summary_lines(results):
            click.echo(line)
        if output is not None:
            click.echo(f"results: {output}")
    if gates:
        click.echo(verdict(gates))
        if not results["gates"]["passed"]:
            sys.exit(GATE_EXIT_CODE)


@main.command(context_settings={"show_default": True})
@click.argument("converted")
@click.option(
    "--data", required=True, help="Training text (same sources as eval --data); packed into --seq-len windows."
)
@click.option(
    "--output", required=True, type=click.Path(file_okay=False), help="Run folder: final model, checkpoints/, log."
)
@click.option(
    "--objective",
    type=click.Choice(["ce", "kd", "mix"]),
    default="ce",
    help="ce: next-token cross-entropy; kd: KL to --teacher's next-token distribution; mix: both.",
)
@click.option(
    "--teacher", default=None, help="The MHA parent (folder or hub id): kd/mix target, and KL in evaluations."
)
@click.option("--kd-weight", type=float, default=0.5, help="mix: loss = (1 - w) * ce + w * kd.")
@click.option("--temperature", type=float, default=1.0, help="Distillation temperature (loss scaled by T^2).")
@click.option(
    "--train",
    type=click.Choice(["all", "attention", "kv"]),
    default="all",
    help="What trains: every parameter, the attention projections, or only the K/V projections.",
)
@click.option(
    "--lora-rank", type=int, default=0, help="LoRA adapters of this rank (peft) on what --train names; 0: off."
)
@click.option("--lora-alpha", type=float, default=None, help="LoRA alpha [default: 2 x rank].")
@click.option("--lora-dropout", type=float, default=0.0, help="LoRA dropout.")
@click.option("--max-steps", type=int, default=None, help="Optimizer steps [default: --max-tokens, else one epoch].")
@click.option("--max-tokens", type=int, default=None, help="Training tokens (steps = tokens / (batch x seq_len)).")
@click.option("--batch-size", type=int, default=8, help="Sequences per optimizer step, over all processes.")
@click.option("--grad-accum", type=int, default=1, help="Micro-batches per step (gradient accumulation).")
@click.option("--seq-len", type=int, default=None, help="Window length [default: min(1024, the model's positions)].")
@click.option("--lr", type=float, default=1e-4, help="Peak AdamW learning rate.")
@click.option("--min-lr-ratio", type=float, default=0.1, help="Cosine decay ends at lr x this.")
@click.option("--warmup-steps", type=int, default=0, help="Linear warm-up steps.")
@click.option("--weight-decay", type=float, default=0.0, help="AdamW weight decay (matrices only).")
@click.option("--adam-beta2", type=float, default=0.999, help="AdamW beta2.")
@click.option("--max-grad-norm", type=float, default=1.0, help="Gradient clipping (0: off).")
@click.option("--seed", type=int, default=0, help="Seed for data order and any randomness.")
@text_options
@click.option("--eval-data", default=None, help="Held-out text evaluated periodically (perplexity; KL with --teacher).")
@click.option("--eval-every", type=int, default=None, help="Steps between evaluations [default: a tenth of the run].")
@click.option("--eval-tokens", type=int, default=65536, help="Held-out tokens per evaluation.")
@click.option("--eval-seq-len", type=int, default=None, help="Evaluation window [default: --seq-len].")
@click.option(
    "--eval-batch-size", type=int, default=None, help="Windows per evaluation forward [default: the micro-batch]."
)
@click.option("--save-every", type=int, default=None, help="Steps between checkpoints [default: --eval-every].")
@click.option("--save-total-limit", type=int, default=2, help="Checkpoints kept (the newest).")
@click.option("--log-every", type=int, default=10, help="Steps between train records in the log.")
@click.option(
    "--stop-after",
    type=int,
    default=None,
    help="Stop after this many steps (checkpointed), e.g. for a time slot; continue with --resume.",
)
@click.option("--resume", is_flag=True, help="Continue the run in --output from its last checkpoint (same settings).")
@click.option("--overwrite", is_flag=True, help="Delete a previous run in --output and start over.")
@click.option("--device", default="auto", help="auto, cpu or cuda (accelerate launch picks each process's GPU).")
@click.option(
    "--mixed-precision",
    type=click.Choice(["auto", "no", "bf16"]),
    default="auto",
    help="auto: bf16 autocast on GPUs that support it, float32 otherwise.",
)
@click.option("--gradient-checkpointing", is_flag=True, help="Recompute activations in the backward pass.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or summary.")
@user_errors
def uptrain(converted: str, quiet: bool, **options: Any) -> None:
    """Uptrain CONVERTED (a GQA checkpoint) on --data by continued pretraining or distillation, and
    write a stock Hugging Face model to --output (run with `accelerate launch` for several GPUs)."""
    from mha2gqa.eval.harness import is_main_process
    from mha2gqa.uptrain import UptrainSettings
    from mha2gqa.uptrain import uptrain as run_uptrain

    settings = UptrainSettings(**options, progress=not quiet)
    result = run_uptrain(converted, settings, log=(lambda m: None) if quiet else click.echo)
    if not quiet and is_main_process():
        click.echo(result.summary())


@main.command()
@click.argument("results", nargs=-1, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--uptrain",
    "runs",
    multiple=True,
    type=click.Path(exists=True, path_type=Path),
    help="An uptraining run (its --output folder or uptrain_log.jsonl), repeatable: adds recovery curves.",
)
@click.option(
    "--html",
    "html_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the HTML page here [default: the first RESULTS (or run log) with .html].",
)
@click.option(
    "--md",
    "md_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write a Markdown summary here.",
)
@user_errors
def report(results: tuple[Path, ...], runs: tuple[Path, ...], html_path: Path | None, md_path: Path | None) -> None:
    """Render eval RESULTS files (and --uptrain runs) as an HTML page (figures embedded) and Markdown."""
    from mha2gqa.eval.report import load_results, load_runs, render

    if not results and not runs:
        raise Mha2GqaError("nothing to report: give eval RESULTS files and/or --uptrain RUN")
    loaded = load_results(list(results))
    logs = load_runs(list(runs))
    if html_path is None and md_path is None:
        first = results[0] if results else (runs[0] / "report" if runs[0].is_dir() else runs[0])
        html_path = first.with_suffix(".html")
    for kind, path in render(loaded, html_path, md_path, logs).items():
        click.echo(f"{kind}: {path}")


@main.command()
@click.option("--original", required=True, help="The original model (folder or hub id).")
@click.option("--converted", default=None, help="Its conversion.")
@click.option("--prompt-len", type=int, default=512, help="Prompt tokens (seeded random ids, the same for both).")
@click.option("--new-tokens", type=int, default=64, help="Tokens generated per run.")
@click.option("--batch-size", type=int, default=1, help="Sequences per run.")
@click.option("--repeats", type=int, default=5, help="Timed runs (median and min-max reported).")
@click.option("--warmup", type=int, default=1, help="Untimed runs first.")
@click.option("--device", default="auto", help="auto, cpu, cuda or cuda:N.")
@click.option("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16 or float16.")
@click.option(
    "--output", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the figures as JSON here."
)
@user_errors
def bench(
    original: str,
    converted: str | None,
    prompt_len: int,
    new_tokens: int,
    batch_size: int,
    repeats: int,
    warmup: int,
    device: str,
    dtype: str,
    output: Path | None,
) -> None:
    """Prefill latency, decode tokens/s and allocated KV cache: ORIGINAL vs CONVERTED."""
    from mha2gqa.eval.bench import bench_model
    from mha2gqa.eval.harness import write_results
    from mha2gqa.eval.models import load_model, resolve_device, resolve_dtype

    if new_tokens < 2 or prompt_len < 1 or repeats < 1:
        raise Mha2GqaError("--new-tokens must be at least 2, --prompt-len and --repeats at least 1")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    results: dict = {"settings": {"prompt_len": prompt_len, "new_tokens": new_tokens, "batch_size": batch_size,
                                  "repeats": repeats, "warmup": warmup, "device": str(dev), "dtype": str(dt)},
                     "models": {}}  # fmt: skip
    for name, path in (("original", original), ("converted", converted)):
        if path is None:
            continue
        loaded = load_model(path, dev, dt)
        limit = getattr(loaded.model.config, "max_position_embeddings", None)
        if limit and prompt_len + new_tokens > limit:
            raise Mha2GqaError(
                f"--prompt-len + --new-tokens = {prompt_len + new_tokens} exceeds the model's {limit} positions"
            )
        results["models"][name] = {
            "path": path,
            **bench_model(loaded.model, prompt_len, new_tokens, repeats, warmup, batch_size),
        }
        del loaded
    click.echo(
        f"{prompt_len}-token prompt, {new_tokens} new tokens, batch {batch_size}, {dev} "
        f"{str(dt).removeprefix('torch.')}, median of {repeats} [min-max]"
    )
    click.echo(
        f"{'model':<10} {'KV heads':>8} {'prefill ms':>20} {'decode tok/s':>22} "
        f"{'KV cache bytes/token':>21} {'planned':>9}"
    )
    for name, m in results["models"].items():
        p, d, kv = m["prefill_seconds"], m["decode_tokens_per_second"], m["kv_cache"]
        pre = f"{p['median'] * 1e3:.1f} [{p['min'] * 1e3:.1f}-{p['max'] * 1e3:.1f}]"
        dec = f"{d['median']:.1f} [{d['min']:.1f}-{d['max']:.1f}]"
        diff = kv["measured_bytes"] / kv["planned_bytes"] - 1
        click.echo(
            f"{name:<10} {m['num_kv_heads']:>8} {pre:>20} {dec:>22} {kv['bytes_per_token']:>21,.0f} {diff:>+8.1%}"
        )
    if len(results["models"]) == 2:
        o, c = results["models"]["original"], results["models"]["converted"]
        speed = c["decode_tokens_per_second"]["median"] / o["decode_tokens_per_second"]["median"]
        cache = c["kv_cache"]["measured_bytes"] / o["kv_cache"]["measured_bytes"]
        results["converted_vs_original"] = {"decode_speedup": speed, "kv_cache_ratio": cache}
        click.echo(f"converted: decode {speed:.2f}x, KV cache {cache:.1%} of the original")
    if output is not None:
        write_results(results, output)


def _bytes(n: float) -> str:
    from mha2gqa.convert.planning import format_bytes

    return format_bytes(n)


@main.command()
@click.argument("model")
@click.option("--seq-len", type=int, default=4096, help="Sequence length for the KV-cache total.")
@click.option("--batch-size", type=int, default=1, help="Concurrent sequences for the KV-cache total.")
@click.option("--revision", default=None, help="Hub revision when MODEL is a hub id.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@user_errors
def inspect(model: str, seq_len: int, batch_size: int, revision: str | None, as_json: bool) -> None:
    """Family, head counts, parameters and KV-cache size of MODEL (folder, config.json or hub id)."""
    from mha2gqa.convert.planning import KV_DTYPE_BYTES, describe, load_config, model_shape

    shape = model_shape(load_config(model, revision))
    info = describe(shape)
    info["kv_cache_bytes"] = {
        name: shape.dims.kv_cache_bytes_per_token(shape.dims.num_kv_heads, b) * seq_len * batch_size
        for name, b in KV_DTYPE_BYTES.items()
    }
    info.update(seq_len=seq_len, batch_size=batch_size)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    d = shape.dims
    kind = "MHA" if d.num_kv_heads == d.num_heads else ("MQA" if d.num_kv_heads == 1 else "GQA")
    click.echo(
        f"{model}: {shape.architecture} (family {shape.family}), "
        f"{shape.parameters:,} parameters ({shape.weights_dtype})"
    )
    click.echo(
        f"  {d.num_layers} layers, hidden {d.hidden_size}, {d.num_heads} query heads, "
        f"{d.num_kv_heads} KV heads ({kind}), head_dim {d.head_dim}"
    )
    click.echo(f"  {'KV dtype':<8} {'bytes/token':>12} {f'KV cache @ {seq_len} x {batch_size}':>24}")
    for name in KV_DTYPE_BYTES:
        click.echo(
            f"  {name:<8} {info['kv_cache_bytes_per_token'][name]:>12,} {_bytes(info['kv_cache_bytes'][name]):>24}"
        )


@main.command()
@click.argument("model")
@click.option("--gpu-memory", default="80GB", help="Accelerator memory, e.g. 80GB, 24GiB.")
@click.option("--seq-len", type=int, default=4096, help="Tokens per sequence (prompt + generation).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32", "fp8"]), default="bf16", help="KV-cache dtype.")
@click.option(
    "--weights-dtype",
    type=click.Choice(["bf16", "fp16", "fp32", "fp8"]),
    default=None,
    help="Weights dtype [default: --dtype].",
)
@click.option("--revision", default=None, help="Hub revision when MODEL is a hub id.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@user_errors
def plan(
    model: str,
    gpu_memory: str,
    seq_len: int,
    dtype: str,
    weights_dtype: str | None,
    revision: str | None,
    as_json: bool,
) -> None:
    """For every valid KV-head count: KV cache, weights and how many sequences fit (config only)."""
    import dataclasses

    from mha2gqa.convert.planning import KV_DTYPE_BYTES, load_config, model_shape, parse_size
    from mha2gqa.convert.planning import plan as make_plan

    shape = model_shape(load_config(model, revision))
    memory = parse_size(gpu_memory)
    rows = make_plan(shape, memory, seq_len, dtype, KV_DTYPE_BYTES[weights_dtype or dtype])
    if as_json:
        click.echo(json.dumps({"model": model, "gpu_memory": memory, "seq_len": seq_len, "dtype": dtype,
                               "rows": [dataclasses.asdict(r) for r in rows]}, indent=2))  # fmt: skip
        return
    click.echo(
        f"{model}: {shape.dims.num_heads} query heads, {seq_len}-token sequences, {gpu_memory} memory, {dtype} KV cache"
    )
    click.echo(f"{'KV heads':>8} {'KV bytes/token':>15} {'KV/sequence':>13} {'weights':>12} {'sequences that fit':>19}")
    for r in rows:
        click.echo(
            f"{r.num_kv_heads:>8} {r.kv_bytes_per_token:>15,} {_bytes(r.kv_bytes_per_sequence):>13} "
            f"{_bytes(r.weights_bytes):>12} {r.max_sequences:>19,}"
        )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
