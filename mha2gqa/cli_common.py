"""The command line's shared parts: the one error path, and the options several commands take."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from mha2gqa.core.errors import Mha2GqaError, SettingError, disk_full
from mha2gqa.core.settings import flag

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
            click.echo(f"Error: stopped by {e.name}; {e.kept or 'nothing partial was left behind'}", err=True)
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
    if disk_full(e):
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
        type=click.IntRange(min=1, max=4096),
        default=None,
        help="CPU threads for torch [default: OMP_NUM_THREADS, else the idle cores it may use, reviewed as it runs].",
    )
    return option(wrapper)


quiet_option = click.option(
    "-q", "--quiet", is_flag=True, help="No progress bars or log lines; the results and the verdict still print."
)
overwrite_option = click.option(
    "--overwrite", is_flag=True, help="Replace an existing output file (only one mha2gqa wrote)."
)


def output_option(help: str, name: str = "--output", dest: str = "output", folder: bool = False):
    """A path option for a file (or ``folder``) the command writes."""
    kind = click.Path(file_okay=not folder, dir_okay=folder, path_type=Path)
    return click.option(name, dest, type=kind, default=None, help=help)


def echo_all(lines: list[str]) -> None:
    for line in lines:
        click.echo(line)


revision_option = click.option("--revision", default=None, help="Hub revision when MODEL is a hub id.")
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
