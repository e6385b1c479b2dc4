"""The evaluation run: original vs converted (or one model) on the same text, as a results dict.

Results follow a versioned schema (``SCHEMA``): models (paths, config summaries, hashes,
conversion records), tokenizer, data source and token counts, every protocol with its settings,
output agreement, attention similarity, timings and tokens/s, library versions, device, git
revision. Under ``accelerate launch`` the windows are split across processes, sums are reduced,
and only the main process returns the full results.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import platform
import re
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from mha2gqa.errors import Mha2GqaError
from mha2gqa.eval.attention import attention_similarity
from mha2gqa.eval.data import TextData, document_tokens, load_text, prefix_token, token_stream
from mha2gqa.eval.metrics import summarize
from mha2gqa.eval.models import (
    check_same_tokenizer,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    tokenizer_info,
)
from mha2gqa.eval.perplexity import Window, disjoint_windows, rolling_windows, score_windows, stride_windows

SCHEMA = "mha2gqa.eval/1"
PROTOCOLS = ("disjoint", "stride", "rolling")


@dataclass
class EvalSettings:
    """Every knob of an evaluation run (recorded verbatim in the results)."""

    data: str
    text_field: str = "text"
    doc_split: str = "file"
    protocols: tuple[str, ...] = ("disjoint",)
    seq_len: int | None = None  # default: min(2048, the models' max positions)
    stride: int | None = None  # default: seq_len // 2
    max_tokens: int | None = None
    batch_size: int = 1
    device: str = "auto"
    dtype: str = "auto"
    device_map: str | None = None
    attention: bool = True
    attention_seq_len: int | None = None  # default: min(seq_len, 1024)
    attention_windows: int = 1
    attention_chunk: int = 128
    revision: str | None = None
    progress: bool = True


def _max_positions(model: torch.nn.Module) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


def _split_for_rank(windows: list[Window]) -> tuple[list[Window], Any]:
    from accelerate import PartialState

    state = PartialState()
    return windows[state.process_index :: state.num_processes], state


def _gather(obj: Any) -> list[Any]:
    from accelerate.utils import gather_object

    return gather_object([obj])


def scored_pass(
    models: list[torch.nn.Module], windows: list[Window], batch_size: int = 1, progress: bool = False, desc: str = ""
) -> dict[str, Any]:
    """One :func:`score_windows` pass split across ``accelerate`` processes, sums reduced on all:
    ``nll_sum`` per model, ``tokens``, ``windows``, ``seconds`` and (two models) ``agreement``."""
    mine, state = _split_for_rank(windows)
    res = score_windows(models, mine, batch_size, progress=progress and state.is_main_process, desc=desc)
    parts = _gather((res.nll_sum, res.tokens, res.seconds, res.agreement))
    nll = [sum(p[0][i] for p in parts) for i in range(len(models))]
    tokens = sum(p[1] for p in parts)
    seconds = max(p[2] for p in parts)
    out: dict[str, Any] = {"nll_sum": nll, "tokens": tokens, "windows": len(windows), "seconds": seconds}
    agreements = [p[3] for p in parts if p[3] is not None]
    if agreements:
        kl = torch.cat([k for a in agreements for k in a.kl]) if any(a.kl for a in agreements) else torch.zeros(0)
        n = sum(a.tokens for a in agreements)
        out["agreement"] = {
            "tokens": n,
            "kl": summarize(kl) if n else {},
            "top1_agreement": sum(a.top1_same for a in agreements) / max(n, 1),
            "nll_delta": sum(a.nll_delta_sum for a in agreements) / max(n, 1),
        }
    return out


def is_main_process() -> bool:
    from accelerate import PartialState

    return PartialState().is_main_process


def write_results(results: dict[str, Any], path: Path) -> None:
    """Write the results JSON atomically (a temporary file renamed into place)."""
    import json
    import os
    import tempfile

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as e:
        raise Mha2GqaError(f"--output {path}: cannot write there: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2, allow_nan=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _ppl_entry(nll_sum: float, tokens: int) -> dict[str, float]:
    nll = nll_sum / tokens
    return {"nll_sum": nll_sum, "tokens": tokens, "nll": nll, "ppl": math.exp(nll)}


def _protocol_result(
    names: list[str], res: dict[str, Any], settings: dict[str, Any], extra: list[dict] | None = None
) -> dict:
    entry: dict[str, Any] = {"settings": settings, "windows": res["windows"], "seconds": res["seconds"],
                             "tokens_per_second": res["tokens"] * len(names) / max(res["seconds"], 1e-9)}  # fmt: skip
    for i, name in enumerate(names):
        entry[name] = {**_ppl_entry(res["nll_sum"][i], res["tokens"]), **((extra or [{}] * len(names))[i])}
    if len(names) == 2:
        entry["ppl_ratio"] = entry[names[1]]["ppl"] / entry[names[0]]["ppl"]
    return entry


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("mha2gqa", "torch", "transformers", "accelerate", "datasets", "safetensors"):
        with contextlib.suppress(PackageNotFoundError):
            out[pkg] = version(pkg)
    return out


def _git_revision() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return rev.stdout.strip() or None if rev.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def evaluate(original: str, converted: str | None, settings: EvalSettings) -> dict[str, Any]:
    """Evaluate ``original`` (and ``converted`` against it) on ``settings.data``; see module doc."""
    started = time.perf_counter()
    unknown = [p for p in settings.protocols if p not in PROTOCOLS]
    if unknown or not settings.protocols:
        raise Mha2GqaError(f"--protocol {', '.join(unknown) or '(none)'}: choose from {', '.join(PROTOCOLS)}")
    if settings.batch_size < 1:
        raise Mha2GqaError("--batch-size must be at least 1")
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    data: TextData = load_text(settings.data, settings.text_field, settings.doc_split)
    paths = [original] + ([converted] if converted else [])
    names = ["original", "converted"][: len(paths)]
    loaded = [load_model(p, device, dtype, settings.device_map, settings.revision) for p in paths]
    models = [m.model for m in loaded]
    tok = load_tokenizer(loaded[0].folder)
    if converted:
        has_tokenizer = any(
            (loaded[1].folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        )
        if has_tokenizer:
            check_same_tokenizer(tok, load_tokenizer(loaded[1].folder), original, converted)

    limits = [p for p in (_max_positions(m) for m in models) if p]
    max_pos = min(limits) if limits else None
    seq_len = settings.seq_len or min(2048, max_pos or 2048)
    if seq_len < 2:
        raise Mha2GqaError("--seq-len must be at least 2")
    if max_pos and seq_len > max_pos:
        raise Mha2GqaError(
            f"--seq-len {seq_len} is longer than the model's {max_pos} positions; use --seq-len {max_pos} or less"
        )
    stride = settings.stride or max(seq_len // 2, 1)
    if not 1 <= stride <= seq_len:
        raise Mha2GqaError(f"--stride {stride} must be between 1 and --seq-len {seq_len}")

    ids = token_stream(tok, data, settings.max_tokens)
    if ids.numel() < seq_len:
        raise Mha2GqaError(
            f"--data {settings.data}: {ids.numel()} tokens, fewer than one window of {seq_len}; "
            "give more text or a smaller --seq-len"
        )
    results: dict[str, Any] = {
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "settings": {**asdict(settings), "seq_len": seq_len, "stride": stride, "protocols": list(settings.protocols)},
        "models": {n: m.describe() for n, m in zip(names, loaded, strict=True)},
        "tokenizer": tokenizer_info(tok),
        "data": {**data.describe(), "stream_tokens": ids.numel()},
        "protocols": {},
        "device": _device_info(device, dtype, settings.device_map),
        "versions": _versions(),
        "git_revision": _git_revision(),
    }
    common = {"seq_len": seq_len, "max_tokens": settings.max_tokens, "batch_size": settings.batch_size}
    bos = "one BOS at the start" if tok.bos_token_id is not None else "no BOS (tokenizer has none)"
    disjoint = disjoint_windows(ids, seq_len)
    if "disjoint" in settings.protocols or converted:
        res = scored_pass(models, disjoint, settings.batch_size, settings.progress, "disjoint")
        if "disjoint" in settings.protocols:
            results["protocols"]["disjoint"] = _protocol_result(names, res, {**common, "stream": bos})
        if converted:
            results["agreement"] = {**res["agreement"], "settings": {"protocol": "disjoint", **common}}
    if "stride" in settings.protocols:
        res = scored_pass(
            models, stride_windows(ids, seq_len, stride), settings.batch_size, settings.progress, "stride"
        )
        results["protocols"]["stride"] = _protocol_result(names, res, {**common, "stride": stride, "stream": bos})
    if "rolling" in settings.protocols:
        docs, used = document_tokens(tok, data, settings.max_tokens)
        prefix = prefix_token(tok)
        windows = [w for d in docs for w in rolling_windows(d, prefix, seq_len)]
        res = scored_pass(models, windows, settings.batch_size, settings.progress, "rolling")
        words = sum(len(re.split(r"\s+", d)) for d in used)
        nbytes = sum(len(d.encode("utf-8")) for d in used)
        extra = []
        for i in range(len(models)):
            ll = -res["nll_sum"][i]
            extra.append({"word_perplexity": math.exp(-ll / words), "byte_perplexity": math.exp(-ll / nbytes),
                          "bits_per_byte": -ll / nbytes / math.log(2)})  # fmt: skip
        settings_r = {**common, "documents": len(used), "words": words, "bytes": nbytes, "prefix_token": prefix,
                      "context_len": 1}  # fmt: skip
        results["protocols"]["rolling"] = _protocol_result(names, res, settings_r, extra)
    if converted and settings.attention:
        results["attention"] = _attention(models, disjoint, ids, seq_len, settings)
    results["seconds"] = time.perf_counter() - started
    return results


def _attention(
    models: list[torch.nn.Module], disjoint: list[Window], ids: torch.Tensor, seq_len: int, settings: EvalSettings
) -> dict:
    from accelerate import PartialState

    t = min(settings.attention_seq_len or min(seq_len, 1024), seq_len)
    windows = [w for w, _ in disjoint_windows(ids, t) if w.numel() == t][: settings.attention_windows]
    if not windows or not PartialState().is_main_process:
        return {}
    start = time.perf_counter()
    out = attention_similarity(models[0], models[1], torch.stack(windows), settings.attention_chunk)
    out["seconds"] = time.perf_counter() - start
    return out


def _device_info(device: torch.device, dtype: torch.dtype, device_map: str | None) -> dict[str, Any]:
    from accelerate import PartialState

    info: dict[str, Any] = {"type": device.type, "dtype": str(dtype).removeprefix("torch."), "device_map": device_map,
                            "processes": PartialState().num_processes}  # fmt: skip
    if device.type == "cuda":
        info["name"] = torch.cuda.get_device_name(device)
    else:
        info["name"] = platform.processor() or platform.machine()
        info["threads"] = torch.get_num_threads()
    return info
