"""Finding a checkpoint (local folder or hub id) and indexing its tensors without loading them."""

from __future__ import annotations

import json
import pickle
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from mha2gqa.core.dtypes import BY_CODE, from_torch
from mha2gqa.core.errors import Mha2GqaError, first_line
from mha2gqa.core.safetensors_io import TensorInfo, load_tensor, read_shard_index

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
PICKLE_INDEX = "pytorch_model.bin.index.json"
PICKLE_SINGLE = "pytorch_model.bin"

#: A folder holding one of these has a tokenizer of its own (fast, slow or sentencepiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
#: Every file that decides how a tokenizer splits text (whichever of them a folder has).
TOKENIZER_DEFINITION = (
    *TOKENIZER_FILES,
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "spiece.model",
)
#: Files copied next to the converted weights (tokenizer, generation and chat-template files).
AUX_FILES = ("generation_config.json", *TOKENIZER_DEFINITION, "chat_template.jinja", "chat_template.json")
_HUB_PATTERNS = ["config.json", "*.safetensors", SAFE_INDEX, *AUX_FILES]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass
class Checkpoint:
    """A model folder: its ``config.json``, where each tensor lives, and how to read it."""

    folder: Path
    config: dict[str, Any]
    tensors: dict[str, TensorInfo]
    files: list[Path]
    format: str  # "safetensors" or "pickle"
    repo_id: str | None = None
    revision: str | None = None
    _pickle_cache: tuple[Path, dict[str, Any]] | None = field(default=None, repr=False)

    nonfinite: set[str] = field(default_factory=set, repr=False)

    def load(self, name: str, warn: bool = True) -> Any:
        """One tensor as a CPU ``torch.Tensor`` in its stored dtype. A floating tensor holding NaN
        or Inf is reported once on stderr (and remembered in :attr:`nonfinite`)."""
        info = self.tensors[name]
        if self.format == "safetensors":
            tensor = load_tensor(info)
        else:
            if self._pickle_cache is None or self._pickle_cache[0] != info.file:
                self._pickle_cache = (info.file, _torch_load(info.file))
            tensor = self._pickle_cache[1][name]
        if tensor.is_floating_point() and name not in self.nonfinite and not _finite(tensor):
            self.nonfinite.add(name)
            if warn:
                sys.stderr.write(f"warning: {self.folder}: {name} holds NaN or Inf values\n")
        return tensor

    def check_finite(self) -> None:
        """Read every floating tensor (one at a time) and refuse the checkpoint if any holds NaN or Inf."""
        for name, info in self.tensors.items():
            if BY_CODE[info.dtype].floating:
                self.load(name, warn=False)
        if self.nonfinite:
            bad = sorted(self.nonfinite)
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            raise Mha2GqaError(
                f"{self.folder}: {', '.join(bad[:3])}{more} hold NaN or Inf values; the checkpoint is "
                "damaged (or was saved mid-divergence)"
            )


def _finite(tensor: Any) -> bool:
    """No NaN or Inf in ``tensor``: its max and min are finite (NaN propagates through both), which
    needs no temporary the size of the tensor and runs ~15x faster than ``isfinite().all()``."""
    if tensor.numel() == 0:
        return True
    if tensor.element_size() == 1:  # float8: no min/max kernels on CPU; one byte a value, so a copy is small
        return bool(tensor.float().isfinite().all())
    return bool(tensor.amax().isfinite() & tensor.amin().isfinite())


def hub_id(name: str) -> str | None:
    """``name`` where it reads as a Hugging Face hub id (``org/name``, or a canonical ``gpt2``), else None."""
    return name if _REPO_ID.match(name) and not name.startswith((".", "/", "~")) else None


def portable_model(name: str) -> str:
    """A model named so that a record can travel: a hub id as given; a local folder (or any path) by its
    folder name as ``./NAME`` (never the path of the machine that read it; :func:`hub_id` reads it as
    no hub id)."""
    if hub_id(name) is not None and not Path(name).expanduser().exists():
        return name
    return local_name(name)


def local_name(path: str | Path) -> str:
    """A local folder or file as a travelling record names it: ``./NAME``."""
    path = Path(path).expanduser()
    return "./" + (path.resolve().name if path.exists() else path.name)


def resolve_folder(
    src: str, revision: str | None = None, allow_pickle: bool = False
) -> tuple[Path, str | None, str | None]:
    """Local folder for ``src`` (a path, or a hub id downloaded with huggingface_hub).

    Returns ``(folder, repo_id, commit)``; ``repo_id``/``commit`` are None for local folders.
    """
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise Mha2GqaError(f"{src} is a file: pass the model folder that holds config.json")
        return path.resolve(), None, None
    if not _REPO_ID.match(src) or src.startswith((".", "/", "~")):
        raise Mha2GqaError(f"{src}: no such folder (and not a Hugging Face hub id like 'org/name')")
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    patterns = [*_HUB_PATTERNS, *(["*.bin", PICKLE_INDEX] if allow_pickle else [])]
    try:
        folder = _snapshot(src, revision, tuple(patterns))
    except (OfflineModeIsEnabled, LocalEntryNotFoundError) as e:
        raise Mha2GqaError(
            f"{src} is not a local folder and the Hugging Face hub cannot be reached "
            f"(offline: {type(e).__name__}); pass a local folder or go online"
        ) from None
    except GatedRepoError:
        raise Mha2GqaError(f"{src} is gated: accept its licence on the hub and log in (`hf auth login`)") from None
    except RepositoryNotFoundError:
        raise Mha2GqaError(f"{src}: no such folder, and no such repository on the Hugging Face hub") from None
    except RevisionNotFoundError:
        raise Mha2GqaError(f"{src}: revision {revision!r} does not exist on the hub") from None
    except HfHubHTTPError as e:
        raise Mha2GqaError(f"{src}: download failed: {first_line(e)}") from None
    return folder.resolve(), src, folder.name


@cache
def _snapshot(repo_id: str, revision: str | None, patterns: tuple[str, ...]) -> Path:
    """The local snapshot of a hub repository, fetched once per process (the CLI's checks before
    work and the run itself resolve the same id)."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(patterns)))


def read_config(folder: Path, name: str = "config.json") -> dict[str, Any]:
    """``config.json`` (or ``name``) of ``folder`` as a dict, with a clear error when it is missing
    or unreadable."""
    path = Path(folder) / name
    if not path.is_file():
        raise Mha2GqaError(f"{folder}: no config.json (is this a Hugging Face model folder?)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Mha2GqaError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise Mha2GqaError(f"{path}: expected a JSON object")
    return config


def check_loadable(label: str, model: str, revision: str | None = None) -> None:
    """A model eval or uptrain is about to load, checked first: its config resolves (per-layer
    counts included), every weight file's header is whole (a truncated shard is found here, not
    half-way through the work), a pickle holds plain tensors only, and the tensors present are the
    ones its config describes, with their shapes. Raises a one-line error starting with ``label``."""
    from mha2gqa.core.architecture import dims_of
    from mha2gqa.core.expected_tensors import check_tensors, expected_tensors

    expected = []

    def config_first(config: dict[str, Any]) -> None:  # what the model is, before its files
        dims_of(config)
        expected.append(expected_tensors(config))

    try:
        ckpt = open_checkpoint(model, revision, allow_pickle=True, check_config=config_first)
        present = {name: info.shape for name, info in ckpt.tensors.items()}
        check_tensors(present, expected[0], str(ckpt.folder))
    except Mha2GqaError as e:
        raise Mha2GqaError(f"{label} {e}") from None


def check_models(**models: str | None) -> None:
    """Each model (label -> folder or hub id) resolves and has a readable config.json: checked
    before torch and transformers load, so a typing mistake is reported at once."""
    for label, model in models.items():
        if model is not None:
            try:
                read_config(resolve_folder(model)[0])
            except Mha2GqaError as e:
                raise Mha2GqaError(f"{label} {e}") from None


def open_checkpoint(
    src: str,
    revision: str | None = None,
    allow_pickle: bool = False,
    check_config: Callable[[dict[str, Any]], Any] | None = None,
) -> Checkpoint:
    """Resolve ``src``, read its config and index every tensor (headers only). ``check_config`` (e.g.
    the family's resolution) judges the config before the weights are looked for: a model refused for
    what it is is refused for that, not for a missing file."""
    folder, repo_id, commit = resolve_folder(src, revision, allow_pickle)
    config = read_config(folder)
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "unknown")
        raise Mha2GqaError(f"{folder}: quantized checkpoint ({method}); convert the unquantized model, then quantize")
    if check_config is not None:
        try:
            check_config(config)
        except Mha2GqaError as e:
            raise Mha2GqaError(f"{folder}: {e}") from None
    files, fmt = _weight_files(folder, allow_pickle)
    tensors = read_shard_index(files) if fmt == "safetensors" else _pickle_index(files)
    if fmt == "safetensors" and (folder / SAFE_INDEX).is_file():
        _check_index(folder / SAFE_INDEX, tensors)
    return Checkpoint(folder, config, tensors, files, fmt, repo_id, commit)


def _weight_files(folder: Path, allow_pickle: bool) -> tuple[list[Path], str]:
    for index, single, fmt in ((SAFE_INDEX, SAFE_SINGLE, "safetensors"), (PICKLE_INDEX, PICKLE_SINGLE, "pickle")):
        if (folder / index).is_file():
            files = sorted({folder / f for f in _weight_map(folder / index).values()})
        elif (folder / single).is_file():
            files = [folder / single]
        else:
            continue
        if fmt == "pickle" and not allow_pickle:
            raise Mha2GqaError(
                f"{folder}: only PyTorch pickle weights (.bin) found; pickle can run code, so pass "
                "--allow-pickle to read them with torch.load(weights_only=True)"
            )
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise Mha2GqaError(f"{folder}: shard files listed in the index are missing: {', '.join(missing)}")
        return files, fmt
    raise Mha2GqaError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def _weight_map(index_path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, KeyError, TypeError, UnicodeDecodeError, json.JSONDecodeError):
        raise Mha2GqaError(f"{index_path}: not a valid shard index (no 'weight_map')") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v and "/" not in v and v not in (".", "..")
        for k, v in weight_map.items()
    ):
        raise Mha2GqaError(f"{index_path}: 'weight_map' must map tensor names to shard file names in this folder")
    return weight_map


def _check_index(index_path: Path, tensors: dict[str, TensorInfo]) -> None:
    for name, file in _weight_map(index_path).items():
        info = tensors.get(name)
        if info is None or info.file.name != file:
            raise Mha2GqaError(f"{index_path}: lists {name!r} in {file}, but that shard does not hold it")


def _torch_load(path: Path) -> dict[str, Any]:
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))
        what = f" (it holds {found.group(1)})" if found else ""
        raise Mha2GqaError(
            f"{path}: refused as unsafe by torch.load(weights_only=True){what}: this pickle can run "
            "code when loaded; get a safetensors copy of the model from its publisher"
        ) from None
    except Exception as e:
        raise Mha2GqaError(f"{path}: cannot be read as a PyTorch checkpoint ({first_line(e)})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise Mha2GqaError(f"{path}: not a state dict of tensors")
    return state


def _pickle_index(files: list[Path]) -> dict[str, TensorInfo]:
    out: dict[str, TensorInfo] = {}
    for path in files:
        for name, t in _torch_load(path).items():
            try:
                code = from_torch(t.dtype).code
            except Mha2GqaError:
                raise Mha2GqaError(f"{path}: tensor {name!r} has unsupported dtype {t.dtype}") from None
            out[name] = TensorInfo(name, code, tuple(t.shape), path, None, None)
    return out


__all__ = ["AUX_FILES", "Checkpoint", "check_loadable", "open_checkpoint", "read_config", "resolve_folder"]
