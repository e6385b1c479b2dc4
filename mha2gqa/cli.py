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
    "--method", type=click.Choice(["mean", "first"]), default="mean", help="How the K/V heads of a group are merged."
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
) -> None:
    """Convert the checkpoint SRC (local folder or hub id) into DST with fewer KV heads."""
    from mha2gqa.convert import convert_checkpoint

    result = convert_checkpoint(
        src, dst, num_kv_heads, method,
        max_shard_size=max_shard_size, overwrite=overwrite, allow_pickle=allow_pickle,
        revision=revision, progress=not quiet, fsync=fsync,
    )  # fmt: skip
    if not quiet:
        click.echo(result.summary())


@main.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Demo job file (default: the shipped configs/demo.yaml).",
)
@click.option(
    "-g",
    "--num-kv-heads",
    "kv_heads",
    type=int,
    multiple=True,
    help="KV-head counts to convert to (repeatable; default: the job file's).",
)
@click.option(
    "--method",
    "methods",
    type=click.Choice(["mean", "first"]),
    multiple=True,
    help="Conversion methods to compare (repeatable; default: the job file's).",
)
@click.option(
    "--steps",
    type=int,
    default=None,
    help="Training steps for the demo model (default: the job file's, ~1 min on 2 cores).",
)
@click.option("--rebuild", is_flag=True, help="Retrain the cached demo model.")
@user_errors
def demo(
    config_file: Path | None, kv_heads: tuple[int, ...], methods: tuple[str, ...], steps: int | None, rebuild: bool
) -> None:
    """Offline end-to-end run: train (once, cached) a small MHA Llama on CPython's docs, convert it
    to fewer KV heads and print held-out perplexity before and after."""
    import dataclasses

    from mha2gqa.convert import check_num_kv_heads, convert_checkpoint
    from mha2gqa.convert.families import AttentionDims
    from mha2gqa.demo import demo_model, heldout_ids, load_job
    from mha2gqa.eval.perplexity import perplexity_disjoint

    job = load_job(config_file)
    settings = job.settings if steps is None else dataclasses.replace(job.settings, steps=steps)
    kv_heads = kv_heads or job.num_kv_heads
    methods = methods or job.methods
    src = demo_model(settings, rebuild=rebuild, log=click.echo)
    dims = AttentionDims.from_config(json.loads((src / "config.json").read_text()))
    for g in kv_heads:
        check_num_kv_heads(dims, g)
    ids = heldout_ids(src, settings)
    click.echo(f"held-out text: {ids.numel():,} tokens of CPython pydoc topics; disjoint windows of {settings.seq_len}")
    rows = [("original (MHA)", dims.num_kv_heads, src)]
    for method in methods:
        for g in kv_heads:
            out = src.parent / f"gqa-{method}-{g}"
            convert_checkpoint(src, out, g, method, overwrite=True, progress=False)
            rows.append((f"{method} -> {g} KV heads", g, out))
    click.echo(f"{'model':<22} {'KV heads':>8} {'KV cache B/token':>16} {'perplexity':>11} {'ratio':>7}")
    base = None
    for label, g, folder in rows:
        ppl = perplexity_disjoint(_load_model(folder), ids, settings.seq_len, batch_size=8).ppl
        base = base or ppl
        kv = dims.kv_cache_bytes_per_token(g, 4)
        click.echo(f"{label:<22} {g:>8} {kv:>16,} {ppl:>11.3f} {ppl / base:>6.2f}x")
    click.echo(f"models in {src.parent}")


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
@click.option("--text-field", default="text", help="Field holding the text in .jsonl/.parquet/datasets sources.")
@click.option(
    "--doc-split",
    type=click.Choice(["file", "paragraph", "line"]),
    default="file",
    help="How a .txt file is cut into documents (rolling protocol).",
)
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
    quiet: bool,
) -> None:
    """Perplexity, output agreement and attention similarity: ORIGINAL vs CONVERTED."""
    from mha2gqa.eval.harness import EvalSettings, evaluate, is_main_process, write_results
    from mha2gqa.eval.summary import summary_lines

    settings = EvalSettings(
        data=data, text_field=text_field, doc_split=doc_split, protocols=protocols, seq_len=seq_len, stride=stride,
        max_tokens=max_tokens, batch_size=batch_size, device=device, dtype=dtype, device_map=device_map,
        attention=attention, attention_seq_len=attention_seq_len, progress=not quiet,
    )  # fmt: skip
    results = evaluate(original, converted, settings)
    if not is_main_process():
        return
    if output is not None:
        write_results(results, output)
    if not quiet:
        for line in summary_lines(results):
            click.echo(line)
        if output is not None:
            click.echo(f"results: {output}")


def _load_model(folder: Path):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
