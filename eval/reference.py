"""The original's side of a pair evaluation, kept on disk, so only one model is in memory at a time.

As llama.cpp's KL workflow does (``--kl-divergence-base``), the original is scored once and what the
comparison needs is saved; each converted model is then scored against it. An entry is a folder
``<cache>/<key>`` holding

``mha2gqa_reference.json``
    The manifest, written last: the key and what it was made from, the original's description, the
    seconds and token counts of its passes, and its sample generations.
``logits/<pass>/<batch>.safetensors``
    Per batch of windows, ``{chunk start: logits [n, vocab]}`` at the scored positions, in the
    model's own dtype: exact, so the replayed comparison equals the two-model pass bit for bit.
    Size: scored tokens x vocab x dtype bytes (Llama-2: 64 KB per token in bf16). With ``top_k``,
    each token's top-k form instead (:func:`~mha2gqa.eval.perplexity.top_k_form`, 8k + 8 bytes):
    perplexity, Δp, NLL statistics and same-top stay exact; both KLs become lower bounds.
``attention/<layer>.safetensors``
    The original's post-RoPE ``q``, ``k``, ``v``, its mask, output projection and layer output on
    the attention batch (one layer at a time is read back).

Every file's size and sha256 are recorded in the manifest when it is written and checked when it is
read back: a missing, truncated or altered file is refused with its path, never used. Evaluations
sharing one cache take a lock beside the entry (``.<key>.lock``): the first builds it, the others wait
and then reuse it.

The key is a hash of everything that decides those numbers: the original (path, config, weight
files' names, sizes and modification times), the exact windows of every pass, batch size, device,
dtype, process rank, the attention batch and sample prompts, and the library versions. An entry
with the same key is reused (several conversions of one original score it once); another key gets
its own entry, so nothing is ever overwritten. Entries are published atomically.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mha2gqa.core import typed
from mha2gqa.core.cache import computed_with, file_sha256
from mha2gqa.core.cache import locked as cache_lock
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.model_info import ModelInfo
from mha2gqa.core.output import Inputs, staged_output
from mha2gqa.core.records import REFERENCE_RECORD
from mha2gqa.core.safetensors_io import read_header
from mha2gqa.core.units import format_bytes
from mha2gqa.eval.perplexity import Record, Replay, Window

SCHEMA = "mha2gqa.reference/1"


def windows_digest(passes: dict[str, list[Window]], *extra: torch.Tensor) -> str:
    """sha256 of every window's inputs and targets, pass by pass, and of ``extra`` tensors."""
    h = hashlib.sha256()
    for name, windows in sorted(passes.items()):
        h.update(name.encode())
        for inputs, targets in windows:
            h.update(inputs.numpy().tobytes())
            h.update(targets.numpy().tobytes())
            h.update(b"|")
    for t in extra:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def reference_key_material(original: dict[str, Any], digest: str, settings: dict[str, Any]) -> dict[str, Any]:
    """Everything an entry's numbers depend on (see the module doc)."""
    return {"schema": SCHEMA, "original": original, "windows": digest, "settings": settings,
            "versions": computed_with()}  # fmt: skip


#: the original's continuations of the generative probe, in an entry
GREEDY_FILE = "greedy/continuations.safetensors"


@dataclass
class Reference:
    """One entry: being written (in its temporary folder) or complete (read only)."""

    folder: Path
    manifest: dict[str, Any] = field(default_factory=dict)

    # -- logits -------------------------------------------------------------------------------
    def recorder(self, name: str, top_k: int = 0) -> Record:
        """Saves each batch of pass ``name`` (for :func:`~mha2gqa.eval.perplexity.score_windows`):
        the logits as they are (exact), or with ``top_k`` their top-k form."""
        from mha2gqa.eval.perplexity import top_k_form

        def save(index: int, chunks: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
            out: dict[str, torch.Tensor] = {}
            for start, (logits, ids) in chunks.items():
                if top_k:
                    out |= {f"{start}:{k}": v.cpu().contiguous() for k, v in top_k_form(logits, ids, top_k).items()}
                else:
                    out[start] = logits.cpu().contiguous()
            self._write(f"logits/{name}/{index:06d}.safetensors", out)

        return save

    def replayer(self, name: str) -> Replay:
        """Gives back what :meth:`recorder` saved for pass ``name`` (each file checked)."""
        if not any(f.startswith(f"logits/{name}/") for f in self.manifest.get("files", {})):
            raise Mha2GqaError(f"reference cache {self.folder} has no '{name}' pass: it is damaged; remove it")
        return lambda index: self._read(f"logits/{name}/{index:06d}.safetensors")[0]

    # -- attention (a LayerStore) -------------------------------------------------------------
    def put(self, layer: int, tensors: dict[str, torch.Tensor], scaling: float, window: int | None) -> None:
        meta = {"scaling": repr(float(scaling)), "window": "" if window is None else str(int(window))}
        copies = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}
        self._write(f"attention/{layer:04d}.safetensors", copies, meta)

    def take(self, layer: int, device: torch.device) -> tuple[dict[str, torch.Tensor], float, int | None]:
        tensors, meta = self._read(f"attention/{layer:04d}.safetensors")
        try:
            scaling, window = float(meta["scaling"]), int(meta["window"]) if meta["window"] else None
        except (KeyError, TypeError, ValueError):
            raise self._damaged(f"attention/{layer:04d}.safetensors", "its metadata is not ours") from None
        return {k: v.to(device) for k, v in tensors.items()}, scaling, window

    # -- the generative probe -----------------------------------------------------------------
    def set_greedy(self, continuations: torch.Tensor) -> None:
        """The original's greedy continuations ``[n, new]`` of the probe's prompts."""
        self._write(GREEDY_FILE, {"ids": continuations.to(torch.long).cpu().contiguous()})

    def greedy(self, shape: tuple[int, int]) -> torch.Tensor:
        """The original's continuations, refused unless they are ``shape`` token ids (what this run asks)."""
        ids = self._read(GREEDY_FILE)[0].get("ids")
        if ids is None or ids.dtype != torch.long or tuple(ids.shape) != tuple(shape):
            raise self._damaged(GREEDY_FILE, f"it does not hold {shape[0]} continuations of {shape[1]} token ids")
        return ids

    # -- files, with their checksums ----------------------------------------------------------
    def _write(self, name: str, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> None:
        """Write ``tensors`` to ``name`` (relative) and record its size and sha256 in the manifest."""
        from safetensors.torch import save_file

        path = self.folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, path, metadata=meta)  # straight from the tensors: no copy of a batch's logits in memory
        self.manifest.setdefault("files", {})[name] = [path.stat().st_size, file_sha256(path)]

    def _read(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The tensors and metadata of ``name``, refused unless its bytes are the ones written."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        expected = self.manifest.get("files", {}).get(name)
        if expected is None:
            raise self._damaged(name, "it is not in the manifest")
        path = self.folder / name
        try:  # hashed as it streams, then loaded: one copy of a batch's logits in memory, not two
            size, digest = path.stat().st_size, file_sha256(path)
        except OSError as e:
            raise self._damaged(name, f"it cannot be read ({e.strerror or e})") from None
        if size != expected[0] or digest != expected[1]:
            raise self._damaged(name, f"its content changed since it was written ({size:,} bytes)")
        try:
            return load_file(path), read_header(path)[1]
        except (SafetensorError, Mha2GqaError, OSError) as e:
            raise self._damaged(name, f"it is not a safetensors file ({e})") from None

    def _damaged(self, name: str, why: str) -> Mha2GqaError:
        return Mha2GqaError(
            f"reference cache {self.folder}: {name} is damaged ({why}); remove {self.folder} and evaluate "
            "again to rebuild it"
        )

    # -- manifest -----------------------------------------------------------------------------
    def seconds(self, name: str) -> float:
        return float(self.manifest.get("seconds", {}).get(name, 0.0))

    def add_seconds(self, name: str, seconds: float) -> None:
        self.manifest.setdefault("seconds", {})[name] = seconds

    def size(self) -> int:
        return sum(f.stat().st_size for f in self.folder.rglob("*") if f.is_file())

    @property
    def model(self) -> ModelInfo:
        """The original's description, as it was scored (checked when the entry was found)."""
        return typed.read(ModelInfo, self.manifest["model"], "model")

    def set_model(self, model: ModelInfo) -> None:
        self.manifest["model"] = model.to_dict()

    @property
    def samples(self) -> list[str]:
        """The original's sample generations (checked when the entry was found)."""
        return list(self.manifest.get("samples", []))

    def set_samples(self, samples: list[str]) -> None:
        self.manifest["samples"] = samples


#: What a complete entry's manifest holds: key -> the JSON types it may have.
_MANIFEST = {"schema": (str,), "key": (str,), "material": (dict,), "model": (dict,), "files": (dict,),
             "seconds": (dict,), "samples": (list,), "created": (int, float)}  # fmt: skip
_REQUIRED = ("schema", "key", "material", "model", "files")


def _check_manifest(manifest: Any, folder: Path, key: str) -> None:
    """A manifest's keys, types and files (present, each of its recorded size), or one error naming it."""
    path = folder / REFERENCE_RECORD

    def bad(why: str) -> Mha2GqaError:
        return Mha2GqaError(f"reference cache {path}: {why}; remove {folder} and evaluate again to rebuild it")

    if not isinstance(manifest, dict):
        raise bad("not a manifest (not a JSON object)")
    if manifest.get("schema") != SCHEMA or manifest.get("key") != key:
        raise bad("its schema or key does not match its folder")
    for name in _REQUIRED:
        if name not in manifest:
            raise bad(f"'{name}' is missing")
    for name, kinds in _MANIFEST.items():
        if name in manifest and (not isinstance(manifest[name], kinds) or isinstance(manifest[name], bool)):
            raise bad(f"'{name}' has the wrong type")
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in manifest.get("seconds", {}).values()):
        raise bad("'seconds' holds a value that is not a number")
    if not all(isinstance(v, str) for v in manifest.get("samples", [])):
        raise bad("'samples' holds a value that is not text")
    try:
        typed.read(ModelInfo, manifest["model"], "model")
    except typed.RecordError as e:
        raise bad(f"its model description is damaged ({e})") from None
    recorded = manifest["material"].get("settings")
    wanted = recorded.get("samples", 0) if isinstance(recorded, dict) else 0
    if isinstance(wanted, int) and wanted and len(manifest.get("samples", [])) != wanted:
        raise bad(f"it should hold {wanted} sample generation(s)")
    for name, entry in manifest["files"].items():
        ok = isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int) and isinstance(entry[1], str)
        if not ok or "/" not in name or ".." in name.split("/") or name.startswith("/"):
            raise bad(f"its record of {name!r} is malformed")
        file = folder / name
        if not file.is_file():
            raise bad(f"{name} is missing")
        if file.stat().st_size != entry[0]:
            raise bad(f"{name} has {file.stat().st_size:,} bytes, not the {entry[0]:,} written (truncated?)")


def find(root: Path, key: str) -> Reference | None:
    """The complete entry ``key`` under ``root``, or None. A folder of that name that is not a
    complete, intact entry (manifest keys and types, every file present at its written size) is
    refused, never overwritten; each file's checksum is verified when it is read."""
    folder = root / key
    if not folder.exists():
        return None
    manifest_path = folder / REFERENCE_RECORD
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        raise Mha2GqaError(
            f"--reference-cache {folder} exists but is not a complete reference entry: remove it, "
            "or choose another --reference-cache"
        ) from None
    _check_manifest(manifest, folder, key)
    return Reference(folder, manifest)


@contextmanager
def locked(root: Path, key: str, log: Any = None) -> Iterator[None]:
    """Hold the lock of entry ``key`` under ``root``: evaluations sharing a cache build an entry once;
    the others wait here, then find it."""
    waiting = f"waiting for another evaluation that is scoring the same original into {root / key}"
    with cache_lock(root, key, f"--reference-cache {root}", waiting, log):
        yield


@contextmanager
def build(root: Path, key: str, material: dict[str, Any], need: int, inputs: Inputs) -> Iterator[Reference]:
    """A new entry ``key`` under ``root``, written in a temporary folder beside it and published,
    manifest last, when the block succeeds (removed on any error or signal). Refused before any work
    when the disk has not ``need`` bytes free."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise Mha2GqaError(
            f"--reference-cache {root}: cannot create it ({e.strerror or e}); choose a writable folder"
        ) from None
    free = shutil.disk_usage(root).free
    if need > free:
        raise Mha2GqaError(
            f"--reference-cache {root}: the original's scores need about {format_bytes(need)} and "
            f"{format_bytes(free)} is free; point --reference-cache at a bigger disk, lower "
            "--max-tokens, or pass --load-both if both models fit in memory"
        )
    with staged_output(root / key, inputs=inputs, what="--reference-cache") as tmp:
        ref = Reference(tmp, {"schema": SCHEMA, "key": key, "material": material, "created": time.time()})
        yield ref
        (tmp / REFERENCE_RECORD).write_text(json.dumps(ref.manifest, indent=1) + "\n", encoding="utf-8")
    ref.folder = root / key


def estimate_bytes(scored_tokens: int, per_token: int, element: int, attention: dict[str, int] | None) -> int:
    """Bytes an entry needs: ``per_token`` for every scored token (the logits, or their top-k form),
    and (``attention``: ``layers``, ``tokens`` B*T, ``seq_len`` T, ``batch`` B, ``heads``, ``kv_heads``,
    ``head_dim``, ``hidden``) each layer's q, k, v, layer output, output projection (``element`` bytes a
    value) and a boolean mask, plus 1% for headers."""
    total = scored_tokens * per_token
    if attention:
        a = attention
        per_layer_token = (a["heads"] + 2 * a["kv_heads"]) * a["head_dim"] + a["hidden"]
        per_layer = a["tokens"] * per_layer_token * element + a["hidden"] * a["heads"] * a["head_dim"] * element
        per_layer += a["batch"] * a["seq_len"] ** 2
        total += a["layers"] * per_layer
    return int(total * 1.01) + 2**20


def blocks(
    passes: dict[str, list[Window]], batch_size: int, per_token: int, budget: int
) -> list[dict[str, list[Window]]]:
    """Every pass's windows cut into blocks whose cached scores (``per_token`` bytes a scored token)
    stay within ``budget`` bytes: whole batches, in the order :func:`~mha2gqa.eval.perplexity.batches`
    gives them, so each block batches as the whole pass does (the same numbers). One block where all
    fit; a batch larger than ``budget`` is a block of its own."""
    from mha2gqa.eval.perplexity import IGNORE, batches

    out: list[dict[str, list[Window]]] = [{}]
    held = 0
    for name, windows in passes.items():
        for batch in batches(windows, batch_size):
            size = per_token * sum(int((t != IGNORE).sum()) for _, t in batch)
            if held and held + size > budget:
                out.append({})
                held = 0
            out[-1].setdefault(name, []).extend(batch)
            held += size
    return out
