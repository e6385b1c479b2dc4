"""The ``mha2gqa`` command line: one click group, user errors as one line and a non-zero exit.

Options come from the settings dataclasses (:func:`mha2gqa.core.settings.click_options`), so their
defaults, choices and help are written once; values are checked before anything heavy is imported.
``--help``, ``plan``, ``inspect`` and ``report`` never import torch.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from mha2gqa.convert.methods import METHODS
from mha2gqa.convert.settings import ConvertSettings
from mha2gqa.core.errors import Mha2GqaError, SettingError
from mha2gqa.core.planning import PlanSettings
from mha2gqa.core.settings import click_options, flag
from mha2gqa.core.tables import Table
from mha2gqa.core.units import format_bytes
from mha2gqa.demo import DEMO_ARCHITECTURES, DemoSettings
from mha2gqa.eval.gates import GATE_EXIT_CODE, GateSettings
from mha2gqa.eval.settings import BenchSettings, EvalSettings
from mha2gqa.uptrain.settings import UptrainSettings

CONTEXT = {"auto_envvar_prefix": "MHA2GQA", "show_default": True, "help_option_names": ["-h", "--help"]}
#: Set to 1 to see the traceback of a user error (for bug reports).
DEBUG_ENV = "MHA2GQA_DEBUG"


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """One error path: :class:`Mha2GqaError` becomes click's one-line ``Error: ...`` and exit code 1
    (a :class:`SettingError` names the option, ``--calibration-tokens``, rather than the field); a
    full disk says so in one line; SIGTERM/SIGHUP stop like SIGINT, after the cleanup, with exit code
    128 + signal. ``--debug`` (or ``MHA2GQA_DEBUG=1``) shows the traceback instead."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from mha2gqa.core.signals import Terminated

        try:
            return fn(*args, **kwargs)
        except Terminated as e:
            click.echo(f"Error: stopped by {e.name}; nothing partial was left behind", err=True)
            sys.exit(128 + e.signum)
        except Exception as e:
            if os.environ.get(DEBUG_ENV):
                raise
            raise click.ClickException(_one_line(e)) from None

    return wrapper


def _one_line(e: Exception) -> str:
    """The message of a user error (anything else is a bug and keeps its traceback)."""
    if isinstance(e, SettingError):
        return e.render(e.setting if "." in e.setting else flag(e.setting))
    if isinstance(e, Mha2GqaError):
        return str(e)
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        where = f" while writing {e.filename}" if e.filename else ""
        return f"disk full{where}: free space or choose another output path"
    raise e


def threads_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--threads N`` for a command that computes: applied before any work (see core/threads.py)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, threads: int | None = None, **kwargs: Any) -> Any:
        from mha2gqa.core.threads import use_threads

        use_threads(threads)
        return fn(*args, **kwargs)

    option = click.option(
        "--threads",
        type=click.IntRange(min=1),
        default=None,
        help="CPU threads for torch [default: OMP_NUM_THREADS, else the idle cores].",
    )
    return option(wrapper)


quiet_option = click.option("-q", "--quiet", is_flag=True, help="No progress bars or summary.")
overwrite_option = click.option(
    "--overwrite", is_flag=True, help="Replace an existing output file (only one mha2gqa wrote)."
)


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="mha2gqa")
@click.option("--debug", is_flag=True, help="Show the traceback of an error (for bug reports).")
def main(debug: bool) -> None:
    """Convert multi-head-attention checkpoints to grouped-query attention, and measure the cost."""
    from mha2gqa.core.signals import install

    click.get_current_context().call_on_close(install())
    if debug:
        os.environ[DEBUG_ENV] = "1"


@main.command()
@click.argument("src")
@click.argument("dst", type=click.Path(path_type=Path))
@click_options(ConvertSettings)
@quiet_option
@threads_option
@user_errors
def convert(src: str, dst: Path, quiet: bool, **options: Any) -> None:
    """Convert the checkpoint SRC (local folder or hub id) into DST with fewer KV heads."""
    from mha2gqa.convert.preflight import preflight

    preflight(src, dst, ConvertSettings(**options, progress=not quiet).check())  # before torch loads
    from mha2gqa.convert import convert_checkpoint

    result = convert_checkpoint(src, dst, **options, progress=not quiet)
    if not quiet:
        click.echo(result.summary())


def _check_models(**models: str | None) -> None:
    """Each model (label -> folder or hub id) resolves and has a readable config.json: checked
    before torch and transformers load, so a typing mistake is reported at once."""
    from mha2gqa.core.checkpoint import read_config, resolve_folder

    for label, model in models.items():
        if model is not None:
            try:
                read_config(resolve_folder(model)[0])
            except Mha2GqaError as e:
                raise Mha2GqaError(f"{label} {e}") from None


def _run_and_print(job, output_dir: Path | None, quiet: bool) -> None:
    from mha2gqa.eval.tables import sweep_table
    from mha2gqa.jobs import run_job

    result = run_job(job, output_dir, log=(lambda m: None) if quiet else click.echo, progress=False)
    if quiet:
        return
    for line in sweep_table(result.rows).text():
        click.echo(line)
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
@threads_option
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
    type=click.Choice(list(METHODS)),
    multiple=True,
    help="Methods (repeatable) [default: the job's].",
)
@click.option(
    "--steps",
    type=int,
    default=None,
    help=f"Training steps of the demo model [default: the job's; {DemoSettings.steps}: ~1 min on 2 cores].",
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
@click.option(
    "--architecture",
    type=click.Choice(DEMO_ARCHITECTURES),
    default=None,
    help="The demo model's class [default: the job's; llama]; gpt_neox trains a Pythia-style model, "
    "converted through PhiForCausalLM.",
)
@click.option("--rebuild", is_flag=True, help="Retrain the cached demo model.")
@threads_option
@user_errors
def demo(
    config_file: Path | None,
    kv_heads: tuple[int, ...],
    methods: tuple[str, ...],
    steps: int | None,
    output_dir: Path | None,
    uptrain_steps: int | None,
    architecture: str | None,
    rebuild: bool,
) -> None:
    """The whole pipeline offline: train (once, cached) a small MHA Llama (or GPT-NeoX) on CPython's
    docs, convert it to fewer KV heads, evaluate, and write an HTML report."""
    import dataclasses

    from mha2gqa.core.settings import validate
    from mha2gqa.demo import demo_model
    from mha2gqa.jobs import load_job, shipped_jobs

    job = load_job(config_file or shipped_jobs()["demo"])
    if steps is not None:
        job.demo = validate(dataclasses.replace(job.demo, steps=steps))
    if architecture is not None:
        job.demo = validate(dataclasses.replace(job.demo, architecture=architecture))
    if any(g < 1 for g in kv_heads):
        raise SettingError("num_kv_heads", "{name} must be at least 1")
    if uptrain_steps is not None and uptrain_steps < 0:
        raise SettingError("uptrain_steps", "{name} must be 0 (no uptraining) or more")
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
@click_options(EvalSettings)
@click.option(
    "--output", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the results JSON here."
)
@overwrite_option
@click_options(GateSettings)
@quiet_option
@threads_option
@user_errors
def eval_cmd(
    original: str, converted: str | None, output: Path | None, overwrite: bool, quiet: bool, **options: Any
) -> None:
    """Perplexity, output agreement and attention similarity: ORIGINAL vs CONVERTED.

    Gates (--max-ppl-ratio applies to every protocol run, --max-kl, --min-top1) print a one-line
    verdict; when one fails the exit code is 3 (1: bad input, 2: bad usage)."""
    from mha2gqa.core.settings import validate

    gate_fields = {f: options.pop(f) for f in ("max_ppl_ratio", "max_kl", "min_top1")}
    limits = validate(GateSettings(**gate_fields))
    settings = EvalSettings(**options, progress=not quiet).check()
    if converted is None and limits.any:
        raise Mha2GqaError("gates compare a conversion with its original: pass --converted")
    from mha2gqa.core.output import check_destination, write_json

    inputs = {"the --data text": settings.data, "the original model": original, "the converted model": converted}
    if output is not None:
        check_destination(output, overwrite, inputs, "--output", folder=False)
    if settings.reference_cache is not None and converted is not None:
        from mha2gqa.core.output import check_overlap

        cache = check_overlap(Path(settings.reference_cache), inputs, "--reference-cache")
        if cache.exists() and not cache.is_dir():
            raise Mha2GqaError(f"--reference-cache {cache} is a file: give a folder")
        existing = next(p for p in (cache, *cache.parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise Mha2GqaError(f"--reference-cache {cache}: {existing} is not a writable folder; choose another")
    _check_models(**{"--original": original, "--converted": converted})
    from mha2gqa.eval.gates import check_gates, gates_record, verdict
    from mha2gqa.eval.harness import evaluate, is_main_process
    from mha2gqa.eval.results import Results
    from mha2gqa.eval.summary import summary_lines

    results = evaluate(original, converted, settings, log=None if quiet else lambda m: click.echo(m, err=True))
    if not is_main_process():
        return
    typed = Results.from_dict(results)
    gates = check_gates(typed, limits)
    if gates:
        results["gates"] = gates_record(gates)
    if output is not None:
        write_json(output, results, "--output", overwrite, inputs)
    if not quiet:
        for line in summary_lines(typed):
            click.echo(line)
        if output is not None:
            click.echo(f"results: {output}")
    if gates:
        click.echo(verdict(gates))
        if not results["gates"]["passed"]:
            sys.exit(GATE_EXIT_CODE)


@main.command(context_settings={"show_default": True})
@click.argument("converted")
@click_options(UptrainSettings)
@quiet_option
@threads_option
@user_errors
def uptrain(converted: str, quiet: bool, **options: Any) -> None:
    """Uptrain CONVERTED (a GQA checkpoint) on --data by continued pretraining or distillation, and
    write a stock Hugging Face model to --output (run with `accelerate launch` for several GPUs)."""
    settings = UptrainSettings(**options, progress=not quiet).check()
    _check_models(CONVERTED=converted, **{"--teacher": settings.teacher})
    from mha2gqa.eval.harness import is_main_process
    from mha2gqa.uptrain import uptrain as run_uptrain

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
@overwrite_option
@user_errors
def report(
    results: tuple[Path, ...], runs: tuple[Path, ...], html_path: Path | None, md_path: Path | None, overwrite: bool
) -> None:
    """Render eval RESULTS files (and --uptrain runs) as an HTML page (figures embedded) and Markdown."""
    from mha2gqa.eval.report import load_results, load_runs, render

    if not results and not runs:
        raise Mha2GqaError("nothing to report: give eval RESULTS files and/or --uptrain RUN")
    loaded = load_results(list(results))
    logs = load_runs(list(runs))
    if html_path is None and md_path is None:
        first = results[0] if results else (runs[0] / "report" if runs[0].is_dir() else runs[0])
        html_path = first.with_suffix(".html")
    for kind, path in render(loaded, html_path, md_path, logs, overwrite=overwrite).items():
        click.echo(f"{kind}: {path}")


def _bench_lengths(s: BenchSettings, limit: int | None) -> tuple[int, int]:
    """Prompt and new tokens: as given, else 512 and 64 cut to fit the model's ``limit`` positions."""
    new = s.new_tokens or (min(64, max(2, limit // 4)) if limit else 64)
    prompt = s.prompt_len or (max(1, min(512, limit - new)) if limit else 512)
    if limit and prompt + new > limit:
        raise SettingError(
            "prompt_len", f"{{name}} + --new-tokens = {prompt + new} exceeds the model's {limit} positions"
        )
    return prompt, new


@main.command()
@click.option("--original", required=True, help="The original model (folder or hub id).")
@click.option("--converted", default=None, help="Its conversion.")
@click_options(BenchSettings)
@click.option(
    "--output", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the figures as JSON here."
)
@overwrite_option
@threads_option
@user_errors
def bench(original: str, converted: str | None, output: Path | None, overwrite: bool, **options: Any) -> None:
    """Prefill latency, decode tokens/s and allocated KV cache: ORIGINAL vs CONVERTED."""
    s = BenchSettings(**options).check()
    from mha2gqa.core.output import check_destination, write_json

    inputs = {"the original model": original, "the converted model": converted}
    if output is not None:
        check_destination(output, overwrite, inputs, "--output", folder=False)
    _check_models(**{"--original": original, "--converted": converted})
    import torch

    from mha2gqa.core.models import load_model, resolve_device, resolve_dtype
    from mha2gqa.eval.bench import bench_model

    dev = resolve_device(s.device)
    dt = resolve_dtype(s.dtype, dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    results: dict = {
        "schema": "mha2gqa.bench/1",
        "settings": {**options, "device": str(dev), "device_name": name, "dtype": str(dt)},
        "models": {},
    }
    for name, path in (("original", original), ("converted", converted)):
        if path is None:
            continue
        loaded = load_model(path, dev, dt)
        prompt, new = _bench_lengths(s, getattr(loaded.model.config, "max_position_embeddings", None))
        results["settings"].update(prompt_len=prompt, new_tokens=new)
        results["models"][name] = {
            "path": path,
            **bench_model(loaded.model, prompt, new, s.repeats, s.warmup, s.batch_size),
        }
        del loaded
    settings = results["settings"]
    click.echo(
        f"{settings['prompt_len']}-token prompt, {settings['new_tokens']} new tokens, batch {s.batch_size}, "
        f"{dev} {str(dt).removeprefix('torch.')}, median of {s.repeats} [min-max]"
    )
    table = Table(["model", "KV heads", "prefill ms", "decode tok/s", "KV cache bytes/token", "vs planned"])
    for name, m in results["models"].items():
        p, d, kv = m["prefill_seconds"], m["decode_tokens_per_second"], m["kv_cache"]
        table.add(
            name,
            m["num_kv_heads"],
            f"{p['median'] * 1e3:.1f} [{p['min'] * 1e3:.1f}-{p['max'] * 1e3:.1f}]",
            f"{d['median']:.1f} [{d['min']:.1f}-{d['max']:.1f}]",
            f"{kv['bytes_per_token']:,.0f}",
            f"{kv['measured_bytes'] / kv['planned_bytes'] - 1:+.1%}",
        )
    for line in table.text():
        click.echo(line)
    if len(results["models"]) == 2:
        o, c = results["models"]["original"], results["models"]["converted"]
        speed = c["decode_tokens_per_second"]["median"] / o["decode_tokens_per_second"]["median"]
        cache = c["kv_cache"]["measured_bytes"] / o["kv_cache"]["measured_bytes"]
        results["converted_vs_original"] = {"decode_speedup": speed, "kv_cache_ratio": cache}
        click.echo(f"converted: decode {speed:.2f}x, KV cache {cache:.1%} of the original")
    if output is not None:
        write_json(output, results, "--output", overwrite, inputs)


@main.command()
@click.argument("model")
@click_options(
    PlanSettings, exclude=("gpu", "gpu_memory", "bandwidth", "tflops", "utilization", "dtype", "weights_dtype")
)
@click.option(
    "--batch-size", type=click.IntRange(min=1), default=1, help="Concurrent sequences for the KV-cache total."
)
@click.option("--revision", default=None, help="Hub revision when MODEL is a hub id.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@user_errors
def inspect(model: str, seq_len: int, batch_size: int, revision: str | None, as_json: bool) -> None:
    """Family, head counts, parameters and KV-cache size of MODEL (folder, config.json or hub id)."""
    from mha2gqa.core.dtypes import KV_DTYPES
    from mha2gqa.core.planning import describe, load_config, model_shape
    from mha2gqa.core.settings import validate

    validate(PlanSettings(seq_len=seq_len))
    shape = model_shape(load_config(model, revision))
    info = describe(shape)
    info["kv_cache_bytes"] = {k: v * seq_len * batch_size for k, v in info["kv_cache_bytes_per_token"].items()}
    info.update(seq_len=seq_len, batch_size=batch_size)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    d = shape.dims
    kind = "MHA" if d.num_kv_heads == d.num_heads else ("MQA" if d.num_kv_heads == 1 else "GQA")
    if d.kv_heads_per_layer:
        kind = f"GQA per layer: {','.join(map(str, d.kv_heads_per_layer))}"
    moved = f"converted as {shape.converts_as}, " if shape.converts_as else ""
    click.echo(
        f"{model}: {shape.architecture} ({moved}family {shape.family}), {shape.parameters:,} parameters "
        f"({shape.weights_dtype})"
    )
    click.echo(
        f"  {d.num_layers} layers, hidden {d.hidden_size}, {d.num_heads} query heads, {d.num_kv_heads} KV "
        f"heads ({kind}), head_dim {d.head_dim}"
    )
    table = Table(["KV dtype", "bytes/token", f"KV cache @ {seq_len} x {batch_size}"])
    for name in KV_DTYPES:
        table.add(name, f"{info['kv_cache_bytes_per_token'][name]:,}", format_bytes(info["kv_cache_bytes"][name]))
    for line in table.text(indent="  "):
        click.echo(line)


@main.command()
@click.argument("model")
@click_options(PlanSettings)
@click.option("--revision", default=None, help="Hub revision when MODEL is a hub id.")
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write a PNG of decode tokens/s against batch size for each KV-head count.",
)
@click.option(
    "--num-kv-heads-per-layer",
    "per_layer",
    default=None,
    help="Also plan these per-layer KV-head counts (comma-separated, one per layer).",
)
@click.option(
    "--bench",
    "bench_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="A `bench --output` JSON of this model: its measured decode speed beside the estimate.",
)
@overwrite_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@user_errors
def plan(
    model: str,
    revision: str | None,
    plot_path: Path | None,
    per_layer: str | None,
    bench_path: Path | None,
    overwrite: bool,
    as_json: bool,
    **options: Any,
) -> None:
    """For every valid KV-head count: KV cache, weights, how many sequences fit and (with --gpu or
    --bandwidth) estimated decode tokens/s and prefill time (config only)."""
    import dataclasses

    from mha2gqa.core.dtypes import by_name
    from mha2gqa.core.output import check_destination, write_text
    from mha2gqa.core.planning import load_config, model_shape, throughput, throughput_plot
    from mha2gqa.core.planning import plan as make_plan
    from mha2gqa.core.settings import validate

    s = validate(PlanSettings(**options))
    gpu = s.hardware()
    if plot_path is not None:
        if not gpu.bandwidth:
            raise SettingError("gpu", "--plot draws decode throughput: give {name} or --bandwidth")
        check_destination(plot_path, overwrite, {"MODEL": model}, "--plot", folder=False)
    bench = _read_bench(bench_path) if bench_path else None
    shape = model_shape(load_config(model, revision))
    heads = None
    if per_layer is not None:
        from mha2gqa.core.dims import parse_kv_heads_list

        heads = parse_kv_heads_list(per_layer)
        shape.dims.check_kv_heads_per_layer(heads)
    rows = make_plan(shape, gpu.memory, s.seq_len, s.dtype, by_name(s.weights_dtype or s.dtype).bytes, heads)
    speed = throughput(shape, rows, gpu, s.seq_len, s.utilization) if gpu.bandwidth else []
    if as_json:
        click.echo(
            json.dumps(
                {
                    "model": model,
                    "gpu": dataclasses.asdict(gpu),
                    "gpu_memory": gpu.memory,
                    "seq_len": s.seq_len,
                    "dtype": s.dtype,
                    "utilization": s.utilization,
                    "rows": [dataclasses.asdict(r) for r in rows],
                    "throughput": [dataclasses.asdict(t) for t in speed],
                },
                indent=2,
            )
        )
    else:
        hw = f"{gpu.name}: {format_bytes(gpu.memory)}" + (f", {gpu.bandwidth / 1e12:.3g} TB/s" if gpu.bandwidth else "")
        click.echo(
            f"{model}: {shape.dims.num_heads} query heads, {s.seq_len}-token sequences, {hw}, {s.dtype} KV cache"
        )
        table = Table(
            ["KV heads", "KV bytes/token", "KV/sequence", "weights", "sequences that fit"]
            + (["tok/s @1", "tok/s/seq @max", "tok/s total @max", "prefill"] if speed else [])
        )
        for i, r in enumerate(rows):
            cells = [
                r.label,
                f"{r.kv_bytes_per_token:,}",
                format_bytes(r.kv_bytes_per_sequence),
                format_bytes(r.weights_bytes),
                f"{r.max_sequences:,}",
            ]
            if speed:
                t = speed[i]
                pre = f"{t.prefill_seconds * 1e3:,.0f} ms" if t.prefill_seconds is not None else "-"
                cells += [
                    f"{t.tokens_per_second_batch1:,.1f}",
                    f"{t.tokens_per_second_per_sequence_max:,.1f}" if t.max_batch else "-",
                    f"{t.tokens_per_second_aggregate_max:,.0f}" if t.max_batch else "-",
                    pre,
                ]
            table.add(*cells)
        for line in table.text(indent="  "):
            click.echo(line)
        if speed:
            prefill = "prefill: give --tflops"
            if gpu.bf16_flops:
                rate = f"{gpu.bf16_flops / 1e12:,.0f} TFLOP/s"
                prefill = f"prefill: one {s.seq_len:,}-token prompt at {s.utilization:.0%} of {rate}"
            click.echo(
                f"  decode: bandwidth roofline, each step reads the weights and every sequence's KV cache at "
                f"the mean context ({s.seq_len // 2:,} tokens); {prefill}. Real decode is slower."
            )
    if bench:
        _bench_beside_estimate(bench, shape, rows, gpu, s)
    if plot_path is not None:
        write_text(
            plot_path,
            throughput_plot(rows, gpu, s.seq_len, Path(model).name or model),
            "--plot",
            overwrite,
            {"MODEL": model},
        )
        click.echo(f"plot: {plot_path}")


def _read_bench(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise Mha2GqaError(f"--bench {path}: not readable JSON ({e})") from None
    if not isinstance(data, dict) or data.get("schema") != "mha2gqa.bench/1":
        raise Mha2GqaError(f"--bench {path}: not a `mha2gqa bench --output` file")
    return data


def _bench_beside_estimate(bench: dict[str, Any], shape, rows, gpu, s: PlanSettings) -> None:
    """Each benchmarked model's measured decode tokens/s beside the roofline estimate for the same
    batch and context (refused when the benchmark is of another model)."""
    from mha2gqa.core.planning import decode_step_seconds

    if not gpu.bandwidth:
        raise SettingError("gpu", "--bench compares with the estimate: give {name} or --bandwidth")
    settings = bench.get("settings", {})
    by_heads = {r.num_kv_heads: r for r in rows}
    context = settings.get("prompt_len", 0) + settings.get("new_tokens", 0) / 2
    batch = settings.get("batch_size", 1)
    click.echo(
        f"  bench ({settings.get('device_name') or settings.get('device')}, batch {batch}, mean context "
        f"{context:,.0f}) beside the estimate on {gpu.name}:"
    )
    for name, m in bench.get("models", {}).items():
        row = by_heads.get(m.get("num_kv_heads"))
        if row is None or (
            m.get("parameters") is not None and m["parameters"] != shape.parameters_at(row.num_kv_heads)
        ):
            raise Mha2GqaError(
                f"--bench: its {name} model is not this model at {m.get('num_kv_heads')} KV heads; "
                "benchmark this model, or plan the benchmarked one"
            )
        measured = m["decode_tokens_per_second"]["median"]
        estimate = batch / decode_step_seconds(row, batch, context, gpu.bandwidth)
        click.echo(
            f"    {name} ({row.num_kv_heads} KV heads): measured {measured:,.1f} tok/s, estimate "
            f"{estimate:,.1f} tok/s ({measured / estimate:.0%} of the roofline)"
        )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
