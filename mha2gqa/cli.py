"""The ``mha2gqa`` command line: one click group that parses, calls the library once and prints;
user errors are one line and a non-zero exit.

Options come from the settings dataclasses (:func:`mha2gqa.core.settings.click_options`), so their
defaults, choices and help are written once; values are checked before anything heavy is imported.
``--help``, ``plan``, ``inspect`` and ``report`` never import torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from mha2gqa.cli_common import (
    CONTEXT,
    DEBUG_ENV,
    echo_all,
    json_option,
    output_option,
    overwrite_option,
    quiet_option,
    revision_option,
    threads_option,
    user_errors,
)
from mha2gqa.convert.settings import ConvertSettings
from mha2gqa.core.self_text import SelfTextSettings
from mha2gqa.core.settings import click_options
from mha2gqa.eval.gates import GATE_EXIT_CODE, GateSettings
from mha2gqa.eval.settings import BenchSettings, EvalSettings
from mha2gqa.jobs import DemoRequest
from mha2gqa.pipeline.distill import DistillSettings
from mha2gqa.serving.sizing import PlanSettings
from mha2gqa.uptrain.settings import UptrainSettings


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="mha2gqa")
@click.option("--debug", is_flag=True, help="Show the traceback of an error (for bug reports).")
def main(debug: bool) -> None:
    """Convert multi-head-attention checkpoints to grouped-query attention, and measure the cost."""
    from mha2gqa.core.progress import quiet_library_bars
    from mha2gqa.core.signals import install

    click.get_current_context().call_on_close(install())
    quiet_library_bars()  # in a log, the libraries' bars are only redraws
    if debug:
        os.environ[DEBUG_ENV] = "1"


def _recipe_defaults(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """``--recipe FILE``: the file's settings become the command's defaults (options given on the
    command line still win), checked as the options are."""
    if value is None:
        return
    from dataclasses import fields

    from mha2gqa.convert.settings import RECIPE_FIELDS
    from mha2gqa.core.errors import Mha2GqaError
    from mha2gqa.core.recipe_file import read_recipe, recipe_path

    try:
        path = recipe_path(value)
        sections = read_recipe(path)
    except Mha2GqaError as e:
        raise click.BadParameter(str(e), ctx, param) from None
    known = {"convert": set(RECIPE_FIELDS), "distill": {f.name for f in fields(DistillSettings)}}
    for name, section in sections.items():
        unknown = sorted(set(section) - known[name])
        if unknown:
            raise click.BadParameter(f"{value}: {name}.{unknown[0]} is not a setting a recipe holds", ctx, param)
    values = {k: v for section in sections.values() for k, v in section.items() if v is not None}
    lists = {p.name for p in ctx.command.params if getattr(p, "multiple", False)}  # repeatable options
    for name, section in sections.items():
        wrong = next((k for k in sorted(lists & set(section)) if not isinstance(section[k], list | type(None))), None)
        if wrong is not None:
            raise click.BadParameter(f"{value}: {name}.{wrong} must be a list", ctx, param)
    if isinstance(values.get("calibration"), str):
        values["calibration"] = _here_or_beside(values["calibration"], path)
    if isinstance(values.get("guard_data"), list):
        values["guard_data"] = [_here_or_beside(str(text), path) for text in values["guard_data"]]
    ctx.default_map = {**(ctx.default_map or {}), **values}


def _here_or_beside(text: str, recipe: Path) -> str:
    """A text a recipe names by file name: in the current folder, else beside the recipe file."""
    beside = recipe.parent / text
    return str(beside) if not Path(text).expanduser().exists() and beside.is_file() else text


@main.command()
@click.argument("src")
@click.argument("dst", type=click.Path(path_type=Path))
@click.option(
    "--recipe",
    callback=_recipe_defaults,
    is_eager=True,
    expose_value=False,
    help="Run a recipe: the file a conversion wrote beside its model (mha2gqa_recipe.yaml), or a shipped "
    "one by name (recommended); its settings, with any option given here in their place.",
)
@click_options(ConvertSettings)
@click_options(DistillSettings)
@quiet_option
@threads_option
@user_errors
def convert(src: str, dst: Path, quiet: bool, **options: Any) -> None:
    """Convert the checkpoint SRC (local folder or hub id) into DST with fewer KV heads."""
    from mha2gqa.pipeline import Recipe, prepare

    recipe = Recipe.from_options(options, progress=not quiet)
    prepared = prepare(recipe, src, dst, log=(lambda m: None) if quiet else None)  # every check, before torch loads
    for line in prepared.run().lines():  # (none: a process of several, which writes nothing)
        click.echo(line)


def _echo_unless(quiet: bool) -> Callable[[str], None]:
    return (lambda m: None) if quiet else click.echo


def _run_and_print(job, output_dir: Path | None, quiet: bool, overwrite: bool) -> None:
    from mha2gqa.eval.tables import sweep_table
    from mha2gqa.jobs import run_job

    result = run_job(job, output_dir, log=_echo_unless(quiet), progress=False, overwrite=overwrite)
    echo_all(sweep_table(result.rows).text())
    click.echo(f"results: {result.output_dir / 'results'}")
    if result.report:
        click.echo(f"report: {result.report}")
    if not result.gates_passed:
        sys.exit(GATE_EXIT_CODE)


@main.command(name="self-text")
@click.argument("model")
@click.argument("output", type=click.Path(dir_okay=False, path_type=Path))
@click_options(SelfTextSettings)
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it exists.")
@quiet_option
@threads_option
@user_errors
def self_text_cmd(model: str, output: Path, overwrite: bool, quiet: bool, **options: Any) -> None:
    """Calibration text MODEL writes itself (seeded sampling, cached and resumable), alone or mixed into
    --mix TEXT, written to OUTPUT: pass it as --calibration to calibrate on what the model knows."""
    from mha2gqa.core.checkpoint import check_loadable
    from mha2gqa.core.output import check_destination, record_of, write_text
    from mha2gqa.core.self_text import mixed, self_text
    from mha2gqa.core.text import load_text

    s = SelfTextSettings(**options).check()
    check_loadable("MODEL", model)
    inputs = {"MODEL": model, **({"--mix": s.mix} if s.mix else {})}
    check_destination(output, overwrite, inputs, "OUTPUT", folder=False)
    check_destination(record_of(output), True, inputs, "OUTPUT", folder=False)  # (its record: ours, or none)
    user = load_text(s.mix, s.text_field, "file", "mix") if s.mix else None  # before the model writes
    written = self_text(model, s, log=_echo_unless(quiet), progress=not quiet)
    body = written.path.read_text(encoding="utf-8")
    line = f"{written.tokens:,} tokens in {written.documents:,} documents written by the model"
    if user is not None:
        body, share = mixed(body, user.joined, s.share)
        line += f", mixed into {s.mix} at {share:.0%} of the characters"
    sha = hashlib.sha256(body.encode("utf-8")).hexdigest()
    record = {"schema": "mha2gqa.self_text_output/1", "sha256": sha, "model": model, "entry": str(written.path.parent),
              "written_sha256": written.sha256, "settings": dataclasses.asdict(s)}  # fmt: skip
    write_text(output, body, "OUTPUT", overwrite, inputs)
    write_text(record_of(output), json.dumps(record, indent=1) + "\n", "OUTPUT", True, inputs)
    click.echo(f"{output}: {line} (sha256 {sha[:16]})")


@main.command()
@click.argument("job_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@output_option(
    "Where models, results and the report go [default: the job's output_dir].",
    "--output-dir",
    "output_dir",
    folder=True,
)
@overwrite_option
@quiet_option
@threads_option
@user_errors
def run_cmd(job_file: Path, output_dir: Path | None, overwrite: bool, quiet: bool) -> None:
    """Run a job file: convert a model to every KV-head count and method it lists, evaluate each
    against the original, render one report and check the gates (exit 3 if one fails)."""
    from mha2gqa.jobs import load_job

    _run_and_print(load_job(job_file), output_dir, quiet, overwrite)


@main.command()
@click_options(DemoRequest)
@output_option(
    "Where models, results and the report go [default: the cache].", "--output-dir", "output_dir", folder=True
)
@overwrite_option
@threads_option
@user_errors
def demo(output_dir: Path | None, overwrite: bool, **options: Any) -> None:
    """The whole pipeline offline: train (once, cached) a small MHA Llama (or GPT-NeoX) on CPython's
    docs, convert it to fewer KV heads, evaluate, and write an HTML report."""
    request = DemoRequest(**options)
    job = request.job()
    if request.rebuild and job.source == "demo":
        from mha2gqa.demo import demo_model

        demo_model(job.demo, rebuild=True, log=click.echo)
    # its default folder, in the cache, is the demo's own: each demo replaces the last
    _run_and_print(job, output_dir, quiet=False, overwrite=overwrite or (output_dir or job.output_dir) is None)


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
@output_option("Write the results JSON here.")
@overwrite_option
@click_options(GateSettings)
@click.option("--strict", is_flag=True, help="Exit 3 unless the verdict is pass (gates or not).")
@quiet_option
@threads_option
@user_errors
def eval_cmd(
    original: str,
    converted: str | None,
    output: Path | None,
    overwrite: bool,
    strict: bool,
    quiet: bool,
    **options: Any,
) -> None:
    """Perplexity, output agreement and attention similarity: ORIGINAL vs CONVERTED.

    The last line is the verdict (pass / borderline / fail against the recommended thresholds, and
    the figure that decided it). Gates (--max-ppl-ratio applies to every protocol run, --max-kl,
    --min-top1) decide the exit code: 3 when one fails (1: bad input, 2: bad usage); --strict
    also exits 3 on a verdict other than pass."""
    from mha2gqa.core.settings import validate
    from mha2gqa.eval.outcome import EvalRequest

    limits = validate(GateSettings(**{f: options.pop(f) for f in GateSettings.__dataclass_fields__}))
    settings = EvalSettings(**options, progress=not quiet).check()
    prepared = EvalRequest(original, converted, settings, limits, output, overwrite).prepare()  # before any weights
    outcome = prepared.run(log=None if quiet else lambda m: click.echo(m, err=True))
    if outcome is None:  # not the main process
        return
    from mha2gqa.eval.summary import summary_lines

    echo_all(summary_lines(outcome.results))
    if output is not None:
        click.echo(f"results: {output}")
    echo_all(outcome.lines())
    if code := outcome.exit_code(strict):
        sys.exit(code)


@main.command(context_settings={"show_default": True})
@click.argument("converted")
@click_options(UptrainSettings)
@quiet_option
@threads_option
@user_errors
def uptrain_cmd(converted: str, quiet: bool, **options: Any) -> None:
    """Uptrain CONVERTED (a GQA checkpoint) on --data by continued pretraining or distillation, and
    write a stock Hugging Face model to --output (run with `accelerate launch` for several GPUs)."""
    settings = UptrainSettings(**options, progress=not quiet).check()  # before torch loads
    from mha2gqa.eval.harness import is_main_process
    from mha2gqa.pipeline import prepare_uptrain

    result = prepare_uptrain(converted, settings, log=_echo_unless(quiet)).run()  # checked before any weights load
    if is_main_process():
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
@output_option("Write the HTML page here [default: the first RESULTS (or run log) with .html].", "--html", "html_path")
@output_option("Also write a Markdown summary here.", "--md", "md_path")
@overwrite_option
@user_errors
def report(
    results: tuple[Path, ...], runs: tuple[Path, ...], html_path: Path | None, md_path: Path | None, overwrite: bool
) -> None:
    """Render eval RESULTS files (and --uptrain runs) as an HTML page (figures embedded) and Markdown."""
    from mha2gqa.eval.report import render_files

    for kind, path in render_files(list(results), list(runs), html_path, md_path, overwrite).items():
        click.echo(f"{kind}: {path}")


@main.command()
@click.option("--original", required=True, help="The original model (folder or hub id).")
@click.option("--converted", default=None, help="Its conversion.")
@click_options(BenchSettings)
@output_option("Write the figures as JSON here.")
@overwrite_option
@threads_option
@user_errors
def bench(original: str, converted: str | None, output: Path | None, overwrite: bool, **options: Any) -> None:
    """Prefill latency, decode tokens/s and allocated KV cache: ORIGINAL vs CONVERTED."""
    from mha2gqa.eval.outcome import benchmark

    echo_all(benchmark(original, converted, BenchSettings(**options), output, overwrite))


@main.command()
@click.argument("model")
@click_options(
    PlanSettings, exclude=("gpu", "gpu_memory", "bandwidth", "tflops", "utilization", "dtype", "weights_dtype")
)
@click.option(
    "--batch-size", type=click.IntRange(min=1), default=1, help="Concurrent sequences for the KV-cache total."
)
@revision_option
@json_option
@user_errors
def inspect(model: str, seq_len: int | None, batch_size: int, revision: str | None, as_json: bool) -> None:
    """Family, head counts, parameters and KV-cache size of MODEL (folder, config.json or hub id)."""
    from mha2gqa.serving.capacity import inspect_model

    report = inspect_model(model, seq_len, batch_size, revision)
    echo_all([json.dumps(report.data, indent=2)] if as_json else report.lines)


@main.command()
@click.argument("model")
@click_options(PlanSettings)
@revision_option
@output_option("Write a PNG of decode tokens/s against batch size for each KV-head count.", "--plot", "plot_path")
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
@json_option
@user_errors
def plan_cmd(
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
    from mha2gqa.serving.capacity import plan_capacity

    result = plan_capacity(model, PlanSettings(**options), revision, per_layer, bench_path, plot_path, overwrite)
    echo_all([json.dumps(result.to_dict(), indent=2)] if as_json else result.lines())
    echo_all(result.bench_lines)
    if result.plot is not None:
        click.echo(f"plot: {result.plot}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
