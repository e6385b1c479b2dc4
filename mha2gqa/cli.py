"""The ``mha2gqa`` command line: one click group, user errors as one line and a non-zero exit."""

from __future__ import annotations

import functools
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
@click.option("-g", "--num-kv-heads", type=int, required=True, help="KV heads after conversion (a divisor of the current count).")
@click.option("--method", type=click.Choice(["mean", "first"]), default="mean", help="How the K/V heads of a group are merged.")
@click.option("--max-shard-size", default="5GB", help="Largest output shard, HF style ('5GB', '500MB').")
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit) when SRC is a hub id.")
@click.option("--overwrite", is_flag=True, help="Replace DST if it exists and is not empty.")
@click.option("--allow-pickle", is_flag=True, help="Read PyTorch .bin checkpoints (with weights_only=True).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or summary.")
@user_errors
def convert(src: str, dst: Path, num_kv_heads: int, method: str, max_shard_size: str, revision: str | None, overwrite: bool, allow_pickle: bool, quiet: bool) -> None:
    """Convert the checkpoint SRC (local folder or hub id) into DST with fewer KV heads."""
    from mha2gqa.convert import convert_checkpoint

    result = convert_checkpoint(
        src, dst, num_kv_heads, method,
        max_shard_size=max_shard_size, overwrite=overwrite, allow_pickle=allow_pickle,
        revision=revision, progress=not quiet,
    )  # fmt: skip
    if not quiet:
        click.echo(result.summary())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
