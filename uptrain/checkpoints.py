"""Uptraining output: resumable checkpoints, the JSON-lines log, and the final model.

Layout of ``--output DIR`` (Hugging Face Trainer's convention)::

    DIR/                         the final model (written last; config.json last of all)
    DIR/checkpoints/step-0000100/ a Hugging Face model (float32 master weights) plus optimizer,
                                  scheduler and RNG state from ``accelerate``'s save_state, and
                                  trainer_state.json; each written to a temporary folder first
    DIR/uptrain_log.jsonl         one JSON object per line: start, train, eval, resume, end

Only complete checkpoints have their final name, so ``--resume`` always finds a whole one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mha2gqa.core.checkpoint import read_config
from mha2gqa.core.dtypes import by_name
from mha2gqa.core.errors import Mha2GqaError, disk_full
from mha2gqa.core.output import Inputs, as_created, check_destination, check_overlap, publish, staged_output
from mha2gqa.core.records import UPTRAIN_LOG

CHECKPOINTS = "checkpoints"
STATE_NAME = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
#: where the final model is built inside ``--output`` before it is moved in
FINAL_TMP = ".final.tmp"
#: a checkpoint's run state as ``accelerate``'s save_state names it (not part of the model)
_RUN_STATE = re.compile(r"^(optimizer|scheduler|sampler|random_states|custom_checkpoint|scaler|dl_state_dict)")


def checkpoint_dirs(output: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``output``, oldest first."""
    root = output / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and (d / STATE_NAME).is_file():
            found.append((int(m.group(1)), d))
    return sorted(found)


def read_state(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / STATE_NAME).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise Mha2GqaError(f"{folder}: unreadable checkpoint state ({e}); delete that checkpoint to resume") from None


def check_output(output: Path, resume: bool, overwrite: bool, inputs: Inputs) -> None:
    """Refuse an ``output`` that overlaps one of the run's ``inputs`` (models, text), or holds
    something not to be clobbered: a run folder is resumed or replaced only when it is ours."""
    check_overlap(output, inputs, "--output")
    if output.is_dir() and any(output.iterdir()) and not (resume or overwrite):
        raise Mha2GqaError(
            f"--output {output} exists and is not empty: pass --resume to continue that run or "
            "--overwrite to start over"
        )
    check_destination(output, overwrite or resume, inputs, "--output")


def prepare_output(output: Path, resume: bool, overwrite: bool) -> None:
    """Create ``output`` (after :func:`check_output`); ``overwrite`` without ``resume`` replaces a
    previous run by an empty folder in one atomic exchange, then deletes the old run."""
    try:
        if output.is_dir() and overwrite and not resume and any(output.iterdir()):
            with staged_output(output, overwrite=True, what="--output"):
                pass
        output.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise Mha2GqaError(f"--output {output}: cannot create it: {e.strerror or e}") from None


def _save_model(
    accelerator,
    model,
    tokenizer,
    folder: Path,
    dtype: torch.dtype | None,
    files: dict[str, str],
    final: bool = False,
    sharded: bool = False,
) -> None:
    """Hugging Face model files of ``model`` into ``folder`` (state dict gathered on every process,
    written by the main one), cast to ``dtype`` when given, plus ``files`` (name -> text).

    A LoRA-wrapped (peft) model is saved as its adapters, or with ``final`` merged into a stock model.
    A ``sharded`` (FSDP) model is gathered whole onto the main process first (a collective call).
    """
    from mha2gqa.uptrain.sharding import full_state_dict, merge_lora

    unwrapped = accelerator.unwrap_model(model)
    lora = hasattr(unwrapped, "peft_config")
    whole = full_state_dict(model) if sharded else None
    if lora and not final:  # the adapters only: resuming applies them to the student again
        if accelerator.is_main_process:
            unwrapped.save_pretrained(folder, **({"state_dict": whole} if sharded else {}))
            _write_files(folder, tokenizer, files)
        return
    if lora and sharded:
        config = unwrapped.peft_config["default"]
        state = merge_lora(whole, config.lora_alpha / config.r) if accelerator.is_main_process else {}
        unwrapped = unwrapped.get_base_model()
    elif lora:
        unwrapped = unwrapped.merge_and_unload()
        state = unwrapped.state_dict()
    else:
        state = whole if sharded else accelerator.get_state_dict(model)
    if not accelerator.is_main_process:
        return
    saved_dtype = unwrapped.config.dtype
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        unwrapped.config.dtype = dtype
    try:
        unwrapped.save_pretrained(folder, state_dict=state)
    finally:
        unwrapped.config.dtype = saved_dtype
    _write_files(folder, tokenizer, files)
    as_created(folder)  # save_pretrained leaves model.safetensors private (0600), unlike every other output file


def _write_files(folder: Path, tokenizer, files: dict[str, str]) -> None:
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")


@dataclass(frozen=True)
class StepFiles:
    """What a checkpoint of ``step`` holds besides the weights: the run's ``state`` (its JSON) and the
    ``files`` that travel with every model (records, card: name -> text)."""

    step: int
    state: dict[str, Any]
    files: dict[str, str]


def save_checkpoint(
    accelerator,
    model,
    tokenizer,
    output: Path,
    written: StepFiles,
    keep: int,
    sharded: Callable[[Path], None] | None = None,
    spare: int | None = None,
) -> Path:
    """Write the checkpoint of ``written.step`` atomically and keep only the newest ``keep`` and that
    of step ``spare`` (collective call). ``sharded``: the model is FSDP-sharded, and this writes each
    process's optimizer shard."""
    step, state, files = written.step, written.state, written.files
    root = output / CHECKPOINTS
    final = root / f"step-{step:07d}"
    tmp = root / f".step-{step:07d}.tmp"
    with _building(tmp, accelerator):
        _save_model(accelerator, model, tokenizer, tmp, None, files, sharded=sharded is not None)
        if sharded is not None:
            sharded(tmp)
        accelerator.save_state(str(tmp))  # every process writes its own RNG state into tmp ...
        accelerator.wait_for_everyone()  # ... so tmp is published only once all of them have
        if accelerator.is_main_process:
            (tmp / STATE_NAME).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
            publish(tmp, final, overwrite=True, what="checkpoint")
    if accelerator.is_main_process:
        for at, old in checkpoint_dirs(output)[:-keep] if keep > 0 else []:
            if at != spare:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


@contextlib.contextmanager
def _building(tmp: Path, accelerator) -> Iterator[None]:
    """A fresh temporary folder ``tmp`` (main process) that is removed again if the block fails."""
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        yield
    except BaseException as e:
        full = out_of_space(e, tmp)  # before the partial files are removed: they fill the disk
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        if full:  # torch, safetensors and accelerate report a full disk in their own words
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp)) from None
        raise


#: How torch's and safetensors' writers say the disk is full (they raise their own error types).
_FULL_DISK = ("No space left on device", "file write failed", "os error 28", "iostream error", "PytorchStreamWriter")
#: Free bytes below which a failed write is taken for a full disk, whatever the writer said.
_NEARLY_FULL = 1 << 20


def out_of_space(e: BaseException, where: Path) -> bool:
    """``e``, raised while writing under ``where``, is a full disk: the OS said so, the writer's
    words say so, or the disk has (almost) no room left (a C++ stream says only "iostream error")."""
    if isinstance(e, OSError) and disk_full(e):
        return True
    if not isinstance(e, Exception):  # Ctrl-C, SIGTERM: not a disk
        return False
    if any(s in str(e) for s in _FULL_DISK):
        return True
    try:
        return shutil.disk_usage(where if where.exists() else where.parent).free < _NEARLY_FULL
    except OSError:
        return False


def skip_model_weights(accelerator) -> None:
    """Make ``accelerate``'s save_state/load_state leave model weights alone: the checkpoint's
    Hugging Face files (``save_pretrained``) hold them, and the model is loaded from there."""
    accelerator.register_save_state_pre_hook(lambda models, weights, folder: weights.clear())
    accelerator.register_load_state_pre_hook(lambda models, folder: models.clear())


def save_final(
    accelerator,
    model,
    tokenizer,
    output: Path,
    dtype: torch.dtype | None,
    files: dict[str, str],
    sharded: bool = False,
) -> None:
    """The final model into ``output`` itself: written to a temporary folder, then moved in file by
    file with ``config.json`` last, so the folder loads as a model only once it is complete."""
    tmp = output / FINAL_TMP
    with _building(tmp, accelerator):
        if accelerator.is_main_process:
            (output / "config.json").unlink(missing_ok=True)
        _save_model(accelerator, model, tokenizer, tmp, dtype, files, final=True, sharded=sharded)
        if accelerator.is_main_process:
            _move_in(tmp, output)
    accelerator.wait_for_everyone()


def _move_in(tmp: Path, output: Path) -> None:
    """Every file of ``tmp`` moved into ``output``, ``config.json`` last (the folder loads as a model
    only once it is complete), then ``tmp`` removed."""
    names = sorted(p.name for p in tmp.iterdir())
    for name in [n for n in names if n != "config.json"] + ["config.json"]:
        os.replace(tmp / name, output / name)
    tmp.rmdir()


def final_from_checkpoint(checkpoint: Path, output: Path, files: dict[str, str] | None = None) -> None:
    """Replace the final model in ``output`` by checkpoint ``checkpoint``'s (an earlier step chosen
    over the last; main process): its Hugging Face files, not the run state, with the floating weights
    cast to the source's dtype as :func:`save_final` casts them, plus ``files`` (name -> text, e.g. the
    records as published), moved in with ``config.json`` last. Memory: one weight file at a time."""
    source = read_state(checkpoint).get("source_dtype")
    dtype = by_name(source).torch if source else None

    def fill(tmp: Path) -> None:
        sizes = {}
        for path in sorted(checkpoint.iterdir()):
            if path.is_dir() or path.name == STATE_NAME or _RUN_STATE.match(path.name):
                continue
            if path.suffix == ".safetensors":
                sizes[path.name] = _cast_file(path, tmp / path.name, dtype)
            else:
                shutil.copyfile(path, tmp / path.name)
        _retype(tmp, dtype, sum(sizes.values()))

    _replace_final(output, fill, files or {})


def final_from_student(student: Path, output: Path, files: dict[str, str]) -> None:
    """Replace the final model in ``output`` by the student's files as given (a run the guard undid;
    main process): every file of the folder ``student`` (hard links where the disk allows) but its run
    log, plus ``files`` (name -> text: the records saying so), moved in with ``config.json`` last."""

    def fill(tmp: Path) -> None:
        for path in sorted(Path(student).iterdir()):
            if path.is_file() and path.name not in (UPTRAIN_LOG, *files):
                link_or_copy(path.resolve(), tmp / path.name)

    _replace_final(output, fill, files)


def link_or_copy(src: Path, dst: Path) -> None:
    """``src`` hard-linked as ``dst``, copied where the disk cannot link."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _replace_final(output: Path, fill: Callable[[Path], None], files: dict[str, str]) -> None:
    """The final model in ``output`` replaced by what ``fill(tmp)`` writes into a temporary folder
    beside it, plus ``files``; the old final's files (not the run log) removed only once it is whole."""
    tmp = output / FINAL_TMP
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        fill(tmp)
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in output.iterdir():
        if old.is_file() and old.name != UPTRAIN_LOG:
            old.unlink()
    _move_in(tmp, output)


def _cast_file(src: Path, dst: Path, dtype: torch.dtype | None) -> int:
    """The safetensors file ``src`` written to ``dst`` with its floating tensors cast to ``dtype``
    (None: as they are); the bytes of its tensors."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import save_file

    tensors = {}
    try:
        with safe_open(str(src), framework="pt") as f:
            metadata = f.metadata()
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                t = f.get_tensor(name)
                tensors[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    except (SafetensorError, OSError) as e:
        raise Mha2GqaError(f"{src}: not a readable safetensors file ({e}); pass --remove-stale to start over") from None
    save_file(tensors, str(dst), metadata=metadata)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _retype(folder: Path, dtype: torch.dtype | None, total: int) -> None:
    """``folder``'s config and shard index say the weights' new dtype and size."""
    if dtype is None:
        return
    config = read_config(folder)
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for index in folder.glob("*.safetensors.index.json"):
        held = read_config(folder, index.name)
        held.setdefault("metadata", {})["total_size"] = total
        index.write_text(json.dumps(held, indent=2) + "\n", encoding="utf-8")
