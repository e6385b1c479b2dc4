"""The evaluation run: original vs converted (or one model) on the same text, as a results dict.

Results follow a versioned schema (:mod:`mha2gqa.eval.results`): models (paths, config summaries,
hashes, KV bytes, conversion records), tokenizer, data source and token counts, every protocol with
its settings, output agreement, attention similarity, timings and tokens/s, library versions,
device, git revision. Under ``accelerate launch`` the windows are split across processes, sums are
reduced, and only the main process returns the full results.
"""

from __future__ import annotations

import math
import platform
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from mha2gqa.core.errors import SettingError
from mha2gqa.core.models import (
    LoadedModel,
    check_same_tokenizer,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    tokenizer_info,
)
from mha2gqa.core.records import EVAL_SCHEMA, git_revision, now, versions
from mha2gqa.core.text import TextData, document_tokens, load_text, prefix_token, token_stream
from mha2gqa.eval.attention import attention_similarity
from mha2gqa.eval.metrics import agreement_stats
from mha2gqa.eval.perplexity import Window, disjoint_windows, rolling_windows, score_windows, stride_windows
from mha2gqa.eval.settings import EvalSettings


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
    if agreements and sum(a.tokens for a in agreements):
        per_token = {key: torch.cat([t for a in agreements for t in getattr(a, key)])
                     for key in ("kl", "kl_reverse", "delta_p", "nll")}  # fmt: skip
        out["agreement"] = agreement_stats(**per_token, top1_same=sum(a.top1_same for a in agreements))
    return out


def is_main_process() -> bool:
    from accelerate import PartialState

    return PartialState().is_main_process


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


@dataclass
class _Run:
    """What every protocol of one evaluation shares."""

    settings: EvalSettings
    names: list[str]
    loaded: list[LoadedModel]
    tokenizer: Any
    data: TextData
    ids: torch.Tensor  # [N] the token stream
    seq_len: int
    stride: int

    @property
    def models(self) -> list[torch.nn.Module]:
        return [m.model for m in self.loaded]

    @property
    def common(self) -> dict[str, Any]:
        s = self.settings
        return {"seq_len": self.seq_len, "max_tokens": s.max_tokens, "batch_size": s.batch_size}

    @property
    def stream(self) -> str:
        return "one BOS at the start" if self.tokenizer.bos_token_id is not None else "no BOS (tokenizer has none)"

    def scored(self, windows: list[Window], desc: str) -> dict[str, Any]:
        return scored_pass(self.models, windows, self.settings.batch_size, self.settings.progress, desc)


def _prepare(original: str, converted: str | None, s: EvalSettings) -> _Run:
    """Load the models, tokenizer and text and fix the window sizes (all checked)."""
    device = resolve_device(s.device)
    dtype = resolve_dtype(s.dtype, device)
    data = load_text(s.data, s.text_field, s.doc_split)
    paths = [original] + ([converted] if converted else [])
    loaded = [load_model(p, device, dtype, s.device_map, s.revision) for p in paths]
    tok = load_tokenizer(loaded[0].folder)
    if converted:
        files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        if any((loaded[1].folder / f).is_file() for f in files):
            check_same_tokenizer(tok, load_tokenizer(loaded[1].folder), original, converted)
    limits = [p for p in (getattr(m.model.config, "max_position_embeddings", None) for m in loaded) if p]
    max_pos = min(limits) if limits else None
    seq_len = s.seq_len or min(2048, max_pos or 2048)
    if max_pos and seq_len > max_pos:
        raise SettingError("seq_len", f"{{name}} {seq_len} is longer than the model's {max_pos} positions; use "
                           f"{{name}} {max_pos} or less")  # fmt: skip
    stride = s.stride or max(seq_len // 2, 1)
    if not 1 <= stride <= seq_len:
        raise SettingError("stride", f"{{name}} {stride} must be between 1 and --seq-len {seq_len}")
    ids = token_stream(tok, data, s.max_tokens)
    if ids.numel() < seq_len:
        raise SettingError("data", f"{{name}} {s.data}: {ids.numel()} tokens, fewer than one window of {seq_len}; "
                           "give more text or a smaller --seq-len")  # fmt: skip
    names = ["original", "converted"][: len(paths)]
    return _Run(s, names, loaded, tok, data, ids, seq_len, stride)


def _disjoint(run: _Run, results: dict[str, Any]) -> None:
    """Disjoint windows; their pass also gives the output agreement of a pair."""
    res = run.scored(disjoint_windows(run.ids, run.seq_len), "disjoint")
    if "disjoint" in run.settings.protocols:
        results["protocols"]["disjoint"] = _protocol_result(run.names, res, {**run.common, "stream": run.stream})
    if len(run.names) == 2 and "agreement" in res:
        results["agreement"] = {**res["agreement"], "settings": {"protocol": "disjoint", **run.common}}


def _stride(run: _Run, results: dict[str, Any]) -> None:
    res = run.scored(stride_windows(run.ids, run.seq_len, run.stride), "stride")
    settings = {**run.common, "stride": run.stride, "stream": run.stream}
    results["protocols"]["stride"] = _protocol_result(run.names, res, settings)


def _rolling(run: _Run, results: dict[str, Any]) -> None:
    """lm-evaluation-harness rolling windows per document, with word and byte perplexity."""
    docs, used = document_tokens(run.tokenizer, run.data, run.settings.max_tokens)
    prefix = prefix_token(run.tokenizer)
    res = run.scored([w for d in docs for w in rolling_windows(d, prefix, run.seq_len)], "rolling")
    words = sum(len(re.split(r"\s+", d)) for d in used)
    nbytes = sum(len(d.encode("utf-8")) for d in used)
    extra = []
    for i in range(len(run.names)):
        ll = -res["nll_sum"][i]
        extra.append({"word_perplexity": math.exp(-ll / words), "byte_perplexity": math.exp(-ll / nbytes),
                      "bits_per_byte": -ll / nbytes / math.log(2)})  # fmt: skip
    settings = {**run.common, "documents": len(used), "words": words, "bytes": nbytes, "prefix_token": prefix,
                "context_len": 1}  # fmt: skip
    results["protocols"]["rolling"] = _protocol_result(run.names, res, settings, extra)


def _attention(run: _Run) -> dict:
    from accelerate import PartialState

    s = run.settings
    t = min(s.attention_seq_len or min(run.seq_len, 1024), run.seq_len)
    windows = [w for w, _ in disjoint_windows(run.ids, t) if w.numel() == t][: s.attention_windows]
    if not windows or not PartialState().is_main_process:
        return {}
    start = time.perf_counter()
    out = attention_similarity(run.models[0], run.models[1], torch.stack(windows), s.attention_chunk)
    out["seconds"] = time.perf_counter() - start
    return out


@torch.inference_mode()
def _samples(run: _Run) -> list[dict[str, Any]]:
    """Greedy continuations by both models of the same prompts: the first quarter of the first
    windows (at most 32 tokens), ``sample_tokens`` new tokens each, cut to the models' positions."""
    from accelerate import PartialState

    if not PartialState().is_main_process:
        return []
    s, tok = run.settings, run.tokenizer
    prompt_len = max(1, min(32, run.seq_len // 4))
    limit = min(p for p in (getattr(m.config, "max_position_embeddings", None) or 10**9 for m in run.models))
    new = max(1, min(s.sample_tokens, limit - prompt_len))
    out = []
    for w, _ in disjoint_windows(run.ids, run.seq_len)[: s.samples]:
        prompt = w[:prompt_len][None]
        entry = {"prompt": tok.decode(prompt[0], skip_special_tokens=True)}
        for name, model in zip(run.names, run.models, strict=True):
            ids = model.generate(prompt.to(next(model.parameters()).device), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=tok.pad_token_id or tok.eos_token_id or 0)  # fmt: skip
            entry[name] = tok.decode(ids[0, prompt_len:], skip_special_tokens=True)
        out.append(entry)
    return out


def evaluate(original: str, converted: str | None, settings: EvalSettings,
             log: Callable[[str], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Evaluate ``original`` (and ``converted`` against it) on ``settings.data``; see module doc.
    ``log`` hears, before the scoring starts, how much will be scored."""
    started = time.perf_counter()
    run = _prepare(original, converted, settings.check())
    if log is not None:
        passes = len(settings.protocols) + (1 if converted and "disjoint" not in settings.protocols else 0)
        log(f"scoring {run.ids.numel():,} tokens of {settings.data} with {len(run.models)} model(s): {passes} "
            f"pass(es) of windows of {run.seq_len} ({', '.join(settings.protocols)})"
            + (", then attention similarity" if converted and settings.attention else ""))  # fmt: skip
    device = next(run.models[0].parameters()).device
    results: dict[str, Any] = {
        "schema": EVAL_SCHEMA,
        "created": now(),
        "settings": {
            **asdict(settings),
            "seq_len": run.seq_len,
            "stride": run.stride,
            "protocols": list(settings.protocols),
        },
        "models": {n: m.describe() for n, m in zip(run.names, run.loaded, strict=True)},
        "tokenizer": tokenizer_info(run.tokenizer),
        "data": {**run.data.describe(), "stream_tokens": run.ids.numel()},
        "protocols": {},
        "device": _device_info(device, next(run.models[0].parameters()).dtype, settings.device_map),
        "versions": versions(),
        "git_revision": git_revision(),
    }
    if "disjoint" in settings.protocols or converted:
        _disjoint(run, results)
    if "stride" in settings.protocols:
        _stride(run, results)
    if "rolling" in settings.protocols:
        _rolling(run, results)
    if converted and settings.attention:
        results["attention"] = _attention(run)
    if converted and settings.samples:
        results["samples"] = _samples(run)
    results["seconds"] = time.perf_counter() - started
    return results


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
