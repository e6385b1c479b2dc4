"""The evaluation run: original vs converted (or one model) on the same text, as :class:`Results`.

Results follow a versioned schema (:mod:`mha2gqa.eval.results`): models (paths, config summaries,
hashes, KV bytes, conversion records), tokenizer, data source and token counts, every protocol with
its settings, output agreement, attention similarity, timings and tokens/s, library versions,
device, git revision. Under ``accelerate launch`` the windows are split across processes, sums are
reduced, and only the main process returns the results (the others None). Each stage returns its
section typed (:class:`Protocol`, :class:`Agreement`, :class:`Attention`, :class:`Sample`,
:class:`Quantized`, ...); :func:`run` assembles them into :class:`Results`, checks the sections
against each other, and :meth:`Results.to_dict` writes the file.
"""

from __future__ import annotations

import math
import platform
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from mha2gqa.core.checkpoint import read_config
from mha2gqa.core.dims import config_value
from mha2gqa.core.errors import SettingError
from mha2gqa.core.memory import map_large_allocations
from mha2gqa.core.model_info import ModelInfo
from mha2gqa.core.models import (
    LoadedModel,
    load_model,
    resolve_device,
    resolve_dtype,
    tokenizer_info,
)
from mha2gqa.core.ranks import ranks
from mha2gqa.core.records import EVAL_SCHEMA, git_revision, now, versions
from mha2gqa.core.text import prefix_token
from mha2gqa.core.units import format_bytes
from mha2gqa.eval.agreement import Agreement, GreedyProbe, RestMass
from mha2gqa.eval.attention import attention_similarity, head_order_of
from mha2gqa.eval.greedy import compare as compare_continuations
from mha2gqa.eval.greedy import continuations, greedy_generate
from mha2gqa.eval.metrics import agreement_stats, summarize
from mha2gqa.eval.pair import calibration_overlap
from mha2gqa.eval.perplexity import (
    PassResult,
    ScoredPass,
    Window,
    batch_count,
    score_windows,
)
from mha2gqa.eval.prepare import Evaluation, prepare
from mha2gqa.eval.results import (
    Attention,
    DataInfo,
    DeviceInfo,
    Protocol,
    Quantized,
    ReferenceInfo,
    Results,
    Sample,
    Score,
)
from mha2gqa.eval.settings import EvalSettings
from mha2gqa.eval.tasks import TasksSection


def scored_pass(
    models: list[torch.nn.Module],
    windows: list[Window],
    batch_size: int = 1,
    progress: bool = False,
    desc: str = "",
    **replay: Any,
) -> ScoredPass:
    """One :func:`score_windows` pass split across ``accelerate`` processes, sums reduced on all.
    ``replay``: ``record=`` or ``replay=`` for a pair one model at a time (see score_windows)."""
    return reduced(rank_pass(models, windows, batch_size, progress, desc, **replay))


def rank_pass(
    models: list[torch.nn.Module],
    windows: list[Window],
    batch_size: int = 1,
    progress: bool = False,
    desc: str = "",
    **replay: Any,
) -> PassResult:
    """This process's share of ``windows`` scored (:func:`score_windows`; ``replay`` may carry
    ``into=``, the sums of an earlier block), not yet reduced (:func:`reduced`)."""
    team = ranks()
    mine = team.part(windows)
    padding = None
    if team.size > 1 and windows:  # as many forward passes on every process (FSDP's collectives)
        padding = (max(team.gather(batch_count(mine, batch_size))), windows[0][0][None])
    shown = (desc or "scoring") if progress and team.main else None
    return score_windows(models, mine, batch_size, progress=shown, padding=padding, **replay)


def reduced(res: PassResult) -> ScoredPass:
    """Every process's sums of one pass (:func:`rank_pass`) reduced: the protocols' and agreement's figures."""
    parts = ranks().gather((res.nll_sum, res.tokens, res.seconds, res.agreement, res.windows))
    nll = [sum(p[0][i] for p in parts) for i in range(len(res.nll_sum))]
    tokens = sum(p[1] for p in parts)
    seconds = max(p[2] for p in parts)
    agreement = None
    agreements = [p[3] for p in parts if p[3] is not None]
    if agreements and sum(a.tokens for a in agreements):
        per_token = {
            key: torch.cat([t for a in agreements for t in getattr(a, key)])
            for key in ("kl", "kl_reverse", "delta_p", "nll")
        }
        agreement = agreement_stats(**per_token, top1_same=sum(a.top1_same for a in agreements))
        rest = [t for a in agreements for t in a.rest_mass]
        if rest:  # against a top-k reference: the mass its KLs do not resolve
            rest_mass = summarize(torch.cat(rest))
            agreement.reference_rest_mass = RestMass(mean=rest_mass["mean"], max=rest_mass["max"])
    return ScoredPass(tuple(nll), tokens, sum(p[4] for p in parts), seconds, agreement)


def is_main_process() -> bool:
    """Whether this process writes (rank 0 of the run's processes)."""
    return ranks().main


def _score_of(nll_sum: float, tokens: int, **extra: float) -> Score:
    nll = nll_sum / tokens
    return Score(nll_sum=nll_sum, tokens=tokens, nll=nll, ppl=math.exp(nll), **extra)


def _protocol(
    name: str, names: list[str], res: ScoredPass, settings: dict[str, Any], extra: list[dict[str, float]] | None = None
) -> Protocol:
    """The protocol ``name``'s section from its scored pass (``extra``: per model, further scores)."""
    scores = [_score_of(res.nll_sum[i], res.tokens, **(extra[i] if extra else {})) for i in range(len(names))]
    converted = scores[1] if len(scores) == 2 else None
    return Protocol(
        name=name,
        settings=settings,
        original=scores[0],
        converted=converted,
        ppl_ratio=converted.ppl / scores[0].ppl if converted else None,
        windows=res.windows,
        seconds=res.seconds,
        tokens_per_second=res.tokens * len(names) / max(res.seconds, 1e-9),
    )


def _score(run: Evaluation, models: list[torch.nn.Module], name: str, **kw: Any) -> ScoredPass:
    """One pass (``name``) of ``run``'s windows through ``models``."""
    return scored_pass(models, run.passes[name], run.settings.batch_size, run.settings.progress, name, **kw)


class _Tasks:
    """The downstream tasks of one evaluation (``--tasks``): each model's scores taken while it is
    loaded, then the results' section; nothing without ``--tasks``."""

    def __init__(self, evaluation: Evaluation) -> None:
        self.evaluation, self.scores = evaluation, {}

    def run(self, model: torch.nn.Module, name: str, log: Callable[[str], None] | None = None) -> None:
        """The tasks on the loaded ``model`` (``name``: original or converted)."""
        ev = self.evaluation
        if ev.task_selection is None:
            return
        from mha2gqa.eval.tasks import score_tasks

        s = ev.settings
        if log:
            log(f"tasks {', '.join(ev.task_selection.names)} on the {name} model (lm-evaluation-harness)")
        self.scores[name] = score_tasks(ev.task_selection, model, ev.tokenizer, s.num_fewshot, s.limit, s.batch_size)

    def section(self) -> TasksSection | None:
        """The results' ``tasks`` section from both models' task scores (None without ``--tasks``)."""
        ev = self.evaluation
        if ev.task_selection is None:
            return None
        from mha2gqa.eval.tasks import compare_tasks

        s = ev.settings
        settings = {"tasks": list(s.tasks), "num_fewshot": s.num_fewshot, "limit": s.limit,
                    "include_path": s.include_path, "batch_size": s.batch_size}  # fmt: skip
        return compare_tasks(ev.task_selection, settings, self.scores["original"], self.scores.get("converted"))


def _protocols(run: Evaluation, scored: dict[str, ScoredPass]) -> dict[str, Protocol]:
    """Each protocol's section from its pass's scored sums."""
    common, out = run.common, {}
    if "disjoint" in run.settings.protocols:
        out["disjoint"] = _protocol("disjoint", run.names, scored["disjoint"], {**common, "stream": run.stream})
    if "stride" in run.settings.protocols:
        settings = {**common, "stride": run.stride, "stream": run.stream}
        out["stride"] = _protocol("stride", run.names, scored["stride"], settings)
    if "rolling" in run.settings.protocols:
        res, used = scored["rolling"], run.rolling_text
        words = sum(len(re.split(r"\s+", d)) for d in used)
        nbytes = sum(len(d.encode("utf-8")) for d in used)
        extra = []
        for i in range(len(run.names)):
            ll = -res.nll_sum[i]
            extra.append(
                {
                    "word_perplexity": math.exp(-ll / words),
                    "byte_perplexity": math.exp(-ll / nbytes),
                    "bits_per_byte": -ll / nbytes / math.log(2),
                }
            )
        settings = {
            **common,
            "seq_len": run.rolling_len,
            "documents": len(used),
            "words": words,
            "bytes": nbytes,
            "prefix_token": prefix_token(run.tokenizer),
            "context_len": 1,
            "convention": run.settings.rolling_convention,
        }
        out["rolling"] = _protocol("rolling", run.names, res, settings, extra)
    return out


def _agreement(run: Evaluation, scored: dict[str, ScoredPass]) -> Agreement | None:
    """A pair's output agreement, from the disjoint pass."""
    found = scored["disjoint"].agreement if len(run.names) == 2 else None
    return replace(found, settings={"protocol": "disjoint", **run.common}) if found is not None else None


@torch.inference_mode()
def _generate(run: Evaluation, model: torch.nn.Module) -> list[str]:
    """Greedy continuations of the sample prompts, ``run.new_tokens`` each."""
    from mha2gqa.core.progress import bar as progress_bar

    tok = run.tokenizer
    out = []
    with progress_bar(total=len(run.prompts), unit="sample", desc="samples", disable=not run.settings.progress) as bar:
        for prompt in run.prompts:
            ids = greedy_generate(model, prompt.to(next(model.parameters()).device), run.new_tokens, _pad_id(tok))
            out.append(tok.decode(ids[0, prompt.shape[1] :], skip_special_tokens=True))
            bar.update(1)
    return out


def _samples(run: Evaluation, original: list[str], converted: list[str]) -> list[Sample]:
    """The sample generations of both models side by side."""
    return [
        Sample(prompt=run.tokenizer.decode(p[0], skip_special_tokens=True), original=o, converted=c)
        for p, o, c in zip(run.prompts, original, converted, strict=True)
    ]


def _load(run: Evaluation, index: int) -> LoadedModel:
    s = run.settings
    device = resolve_device(s.device)
    return load_model(run.paths[index], device, resolve_dtype(s.dtype, device), s.device_map, s.revision)


def _free(loaded: LoadedModel) -> None:
    """Let go of a model's weights before the next one is loaded."""
    import gc

    device = next(loaded.model.parameters()).device
    loaded.model = None  # type: ignore[assignment]
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


@dataclass
class _Scored:
    """What the scoring stages give the results, each section typed: the models' descriptions, the
    protocols and a pair's agreement, attention similarity, samples, the reference cache entry used,
    the quantized yardsticks, and where the last model ran."""

    models: list[ModelInfo]
    protocols: dict[str, Protocol]
    device: DeviceInfo
    agreement: Agreement | None = None
    attention: Attention | None = None
    samples: list[Sample] = field(default_factory=list)
    greedy: GreedyProbe | None = None
    reference: ReferenceInfo | None = None
    quantization: dict[str, Quantized] = field(default_factory=dict)


def _together(run: Evaluation, tasks: _Tasks) -> _Scored:
    """One model, or a pair with both models in memory (``load_both``)."""
    loaded = [_load(run, i) for i in range(len(run.paths))]
    models = [m.model for m in loaded]
    scored = {name: _score(run, models, name) for name in run.passes}
    main = is_main_process()
    attention = samples = None
    if len(models) == 2 and run.attention_batch is not None and main:
        order = head_order_of(loaded[1].conversion())
        attention, seconds = _timed(
            lambda: attention_similarity(*models, run.attention_batch, run.settings.attention_chunk, order)
        )
        attention.seconds = seconds
    if len(models) == 2 and run.prompts and main:
        samples = _samples(run, _generate(run, models[0]), _generate(run, models[1]))
    greedy = _probe(run, _continue(run, models[0]), models[1]) if len(models) == 2 and main else None
    for name, model in zip(run.names, models, strict=True):
        tasks.run(model, name)
    return _Scored(
        models=[m.describe() for m in loaded],
        protocols=_protocols(run, scored),
        agreement=_agreement(run, scored),
        device=_device_info(models[-1], run.settings.device_map),
        attention=attention,
        samples=samples or [],
        greedy=greedy,
    )


def _continue(run: Evaluation, model: torch.nn.Module) -> torch.Tensor | None:
    """``model``'s greedy continuations of the generative probe's prompts (None: no probe)."""
    if run.probe is None:
        return None
    return continuations(model, run.probe, run.probe_tokens, _pad_id(run.tokenizer), run.settings.progress)


def _pad_id(tok) -> int:
    """The id generation pads with (the tokenizer's pad token, else its EOS, else 0)."""
    return tok.pad_token_id or tok.eos_token_id or 0


def _probe(run: Evaluation, original: torch.Tensor | None, converted: torch.nn.Module) -> GreedyProbe | None:
    """The generative probe: the converted model's continuations against the original's."""
    if original is None:
        return None
    return compare_continuations(original, _continue(run, converted), run.probe.shape[1])


def _reference_key(run: Evaluation, loaded_dtype: str, device: torch.device) -> tuple[str, dict[str, Any]]:
    from mha2gqa.core.cache import entry_name, model_identity
    from mha2gqa.eval.reference import reference_key_material, windows_digest

    s, team = run.settings, ranks()
    extra = [t for t in (run.attention_batch, *run.prompts, run.probe) if t is not None]
    digest = windows_digest(run.passes, *extra)
    settings = {
        "batch_size": s.batch_size,
        "device": str(device),
        "dtype": loaded_dtype,
        "device_map": s.device_map,
        "revision": s.revision,
        "process": [team.rank, team.size],
        "attention": run.attention_batch is not None and list(run.attention_batch.shape),
        "samples": len(run.prompts),
        "new_tokens": run.new_tokens,
        "greedy": [*run.probe.shape, run.probe_tokens] if run.probe is not None else None,
        "top_k": s.reference_top_k,
    }
    material = reference_key_material(model_identity(run.paths[0], run.folders[0]), digest, settings)
    return entry_name(material), material


def _score_bytes(run: Evaluation, dtype: torch.dtype) -> int:
    """Bytes the reference cache keeps per scored token: the original's logits in ``dtype``, or their
    top-k form (``8 top_k + 8``). Refuses a top-k wider than the vocabulary."""
    from mha2gqa.core.dtypes import from_torch

    vocab = _vocab(run)
    if run.settings.reference_top_k > vocab:
        raise SettingError(
            "reference_top_k",
            f"{{name}} {run.settings.reference_top_k} is more than the vocabulary ({vocab:,} tokens): "
            f"give at most {vocab:,}, or 0 to cache exact logits",
        )
    top_k = run.settings.reference_top_k
    return 8 * top_k + 8 if top_k else vocab * from_torch(dtype).bytes


def _vocab(run: Evaluation) -> int:
    """The original's vocabulary (its config's, else its tokenizer's)."""
    return int(config_value(read_config(run.folders[0]), "vocab_size") or len(run.tokenizer))


def _reference_size(run: Evaluation, device: torch.device, dtype: torch.dtype) -> int:
    """Bytes the original's cached scores will take (from its config, before loading it)."""
    from mha2gqa.core.architecture import dims_of
    from mha2gqa.core.dtypes import from_torch
    from mha2gqa.eval.perplexity import IGNORE
    from mha2gqa.eval.reference import estimate_bytes

    per_token = _score_bytes(run, dtype)
    scored = sum(int((t != IGNORE).sum()) for windows in run.passes.values() for _, t in windows)
    attention = None
    if run.attention_batch is not None:
        dims = dims_of(read_config(run.folders[0]))
        b, t = run.attention_batch.shape
        attention = {
            "layers": dims.num_layers,
            "tokens": b * t,
            "seq_len": t,
            "batch": b,
            "heads": dims.num_heads,
            "kv_heads": dims.num_kv_heads,
            "head_dim": dims.head_dim,
            "hidden": dims.hidden_size,
        }
    return estimate_bytes(scored, per_token, from_torch(dtype).bytes, attention)


def _against_reference(run: Evaluation, converted, ref, log: Callable[[str], None] | None) -> tuple[Any, Any, Any]:
    """The converted model's attention similarity, samples and generative probe against the cached
    original (each where the run asked for it, else None)."""
    from mha2gqa.eval.attention import compare_attention

    attention = samples = greedy = None
    if run.attention_batch is not None:
        if log:
            log("attention similarity, layer by layer, against the cached original")
        order = head_order_of(converted.conversion())
        attention, seconds = _timed(
            lambda: compare_attention(
                converted.model, run.attention_batch, ref, run.settings.attention_chunk, order, run.settings.progress
            )
        )
        attention.seconds = seconds + ref.seconds("attention")
    if run.prompts:
        if log:
            log(f"{len(run.prompts)} sample generation(s) of {run.new_tokens} tokens")
        samples = _samples(run, ref.samples, _generate(run, converted.model))
    if run.probe is not None:
        if log:
            log(f"the generative probe: {len(run.probe)} greedy continuations of {run.probe_tokens} tokens")
        greedy = _probe(run, ref.greedy((len(run.probe), run.probe_tokens)), converted.model)
    return attention, samples, greedy


@dataclass
class _Replayed:
    """A pair scored one model at a time, block by block: each pass's sums and each yardstick's, added
    to in every block, and what the first block measured once (the models, attention, samples, the
    probe, the entry)."""

    passes: dict[str, PassResult] = field(default_factory=dict)
    yardsticks: dict[str, dict[str, PassResult]] = field(default_factory=dict)
    weights: dict[str, int] = field(default_factory=dict)
    once: tuple[Any, Any, Any] = (None, None, None)
    models: list[ModelInfo] = field(default_factory=list)
    device: DeviceInfo | None = None
    reference: ReferenceInfo | None = None


def _one_at_a_time(run: Evaluation, tasks: _Tasks, log: Callable[[str], None] | None) -> _Scored:
    """A pair, one model in memory at a time: the original's scores come from (or go to) the
    reference cache, then the converted model is scored against them. A temporary cache larger than
    ``--reference-block`` is built and replayed block after block, each removed after its replay."""
    import tempfile

    s = run.settings
    temporary = s.reference_cache is None
    root = Path(tempfile.mkdtemp(prefix="mha2gqa-reference-")) if temporary else Path(s.reference_cache)
    try:
        parts = _blocks(run, root, temporary)
        if log and len(parts) > 1:
            log(f"the original's scores take more than --reference-block {s.reference_block}: scored and "
                f"replayed in {len(parts)} blocks, each model loaded once a block (--reference-top-k keeps "
                "them in one)")  # fmt: skip
        done = _Replayed()
        for part in parts:
            _replay_block(part, tasks, (root, temporary and len(parts) > 1), done, log)
        if run.task_selection is not None and "original" not in tasks.scores:  # its scores came from the cache
            original = _load(run, 0)
            tasks.run(original.model, "original", log)
            _free(original)
        scored = {name: reduced(res) for name, res in done.passes.items()}
        attention, samples, greedy = done.once
        if done.reference is not None and len(parts) > 1:
            done.reference.blocks = len(parts)
        return _Scored(
            models=done.models,
            protocols=_protocols(run, scored),
            agreement=_agreement(run, scored),
            device=done.device,
            attention=attention,
            samples=samples or [],
            greedy=greedy,
            reference=done.reference,
            quantization={name: _quantized(run, name, done) for name in s.compare_quantization},
        )
    finally:
        if temporary:
            shutil.rmtree(root, ignore_errors=True)


def _blocks(run: Evaluation, root: Path, temporary: bool) -> list[Evaluation]:
    """``run`` as the blocks its original's scores are cached in: itself, unless a temporary cache
    would exceed ``--reference-block`` (then each block holds whole batches; the first also the
    attention batch, samples and probe). Refused before any model loads when the largest block does
    not fit the temporary folder's free space."""
    from mha2gqa.core.units import parse_size
    from mha2gqa.eval.reference import blocks

    s = run.settings
    device = resolve_device(s.device)
    dtype = resolve_dtype(s.dtype, device)
    parts = [run]
    if temporary:
        cut = blocks(run.passes, s.batch_size, _score_bytes(run, dtype), parse_size(s.reference_block))
        if len(cut) > 1:
            rest = dict(attention_batch=None, prompts=[], probe=None)
            parts = [replace(run, passes=cut[0])] + [replace(run, passes=p, **rest) for p in cut[1:]]
        need, free = max(_reference_size(p, device, dtype) for p in parts), shutil.disk_usage(root).free
        if need > free:
            raise SettingError(
                "reference_block",
                f"the original's scores need about {format_bytes(need)} of temporary disk at once and "
                f"{root.parent} has {format_bytes(free)} free: point TMPDIR at a bigger disk, lower {{name}} "
                "(more blocks), cache --reference-top-k 64 of each token's logits, or pass --load-both",
            )
    return parts


def _replay_block(
    part: Evaluation, tasks: _Tasks, where: tuple[Path, bool], done: _Replayed, log: Callable[[str], None] | None
) -> None:
    """One block of a pair scored one model at a time: the original's entry found or built (under its
    lock), the converted model replayed against it and each yardstick too, all added to ``done``;
    ``where``: the cache's root and whether the block's entry is removed after (a temporary block)."""
    from mha2gqa.eval.reference import locked

    (root, drop), s = where, part.settings
    device = resolve_device(s.device)
    dtype = resolve_dtype(s.dtype, device)
    key, material = _reference_key(part, str(dtype).removeprefix("torch."), device)
    with locked(root, key, log):
        ref = _reference(part, tasks, (root, key, material), (device, dtype), s.reference_cache is None, log)
    if log:
        log(f"scoring the converted model {part.paths[1]}")
    converted = _load(part, 1)
    for name, windows in part.passes.items():
        res = rank_pass([converted.model], windows, s.batch_size, s.progress, name,
                        replay=ref.replayer(name), into=done.passes.get(name))  # fmt: skip
        res.seconds += ref.seconds(name)
        done.passes[name] = res
    if done.reference is None:
        done.once = _against_reference(part, converted, ref, log) if is_main_process() else (None, None, None)
        tasks.run(converted.model, "converted", log)
        done.models, done.device = [ref.model, converted.describe()], _device_info(converted.model, s.device_map)
        form = f"top-{s.reference_top_k}" if s.reference_top_k else "exact"
        folder = None if s.reference_cache is None else str(ref.folder)
        done.reference = ReferenceInfo(key=key, folder=folder, bytes=ref.size(), form=form)
    done.reference.bytes = max(done.reference.bytes, ref.size())
    _free(converted)
    for name in s.compare_quantization:
        _yardstick_block(part, ref, name, done, log)
    if drop:
        shutil.rmtree(ref.folder, ignore_errors=True)


def _reference(
    run: Evaluation,
    tasks: _Tasks,
    entry: tuple[Path, str, dict[str, Any]],
    place: tuple[torch.device, torch.dtype],
    temporary: bool,
    log: Callable[[str], None] | None,
) -> Any:
    """The original's cached scores: the entry (``root``, ``key``, ``material``) when it exists
    (checked), else built now on ``place`` (device, dtype), the original loaded, scored and freed
    (under the entry's lock, held by the caller)."""
    from mha2gqa.eval.attention import record_attention
    from mha2gqa.eval.reference import build, find

    (root, key, material), s = entry, run.settings
    ref = find(root, key)
    if ref is not None:
        if log:
            log(f"the original's scores: reusing {ref.folder}")
        return ref
    main = is_main_process()
    inputs = {"the original model": run.paths[0], "the converted model": run.paths[1], "the --data text": s.data}
    with build(root, key, material, _reference_size(run, *place), inputs) as ref:
        if log:
            log(f"scoring the original once, its scores cached in {root if temporary else root / key}")
        original = _load(run, 0)
        for name in run.passes:
            res = _score(run, [original.model], name, record=ref.recorder(name, s.reference_top_k))
            ref.add_seconds(name, res.seconds)
        if run.attention_batch is not None and main:
            if log:
                log("the original's attention, layer by layer, recorded for the similarity")
            _, seconds = _timed(lambda: record_attention(original.model, run.attention_batch, ref))
            ref.add_seconds("attention", seconds)
        if run.prompts and main:
            if log:
                log(f"the original's {len(run.prompts)} sample generation(s) of {run.new_tokens} tokens")
            ref.set_samples(_generate(run, original.model))
        if run.probe is not None and main:
            if log:
                log(f"the original's continuations of the generative probe ({len(run.probe)} prompts)")
            ref.set_greedy(_continue(run, original.model))
        if "original" not in tasks.scores:  # (once, in a pair's first block)
            tasks.run(original.model, "original", log)
        ref.set_model(original.describe())
        _free(original)
    return ref


def _yardstick_block(part: Evaluation, ref: Any, name: str, done: _Replayed, log: Callable[[str], None] | None) -> None:
    """One block of the yardstick ``name``: the original quantized with that scheme, replayed against
    the block's cached original, its sums added to ``done``."""
    from mha2gqa.eval.quantization import SCHEMES, quantize_model

    scheme, s = SCHEMES[name], part.settings
    if log:
        log(f"yardstick: scoring the original with {scheme.description}, against the original")
    model = _load(part, 0)
    done.weights[name] = quantize_model(model.model, scheme)
    sums = done.yardsticks.setdefault(name, {})
    for p, windows in part.passes.items():
        sums[p] = rank_pass([model.model], windows, s.batch_size, s.progress, p,
                            replay=ref.replayer(p), into=sums.get(p))  # fmt: skip
    _free(model)


def _quantized(run: Evaluation, name: str, done: _Replayed) -> Quantized:
    """The yardstick ``name``'s section (its blocks' sums reduced): the perplexity ratio of every
    protocol asked for and the output agreement (what the verdict places the conversion against)."""
    from mha2gqa.eval.quantization import SCHEMES

    scheme = SCHEMES[name]
    scored = {p: reduced(res) for p, res in done.yardsticks[name].items()}
    protocols = _protocols(run, scored)
    agreement = scored["disjoint"].agreement
    assert agreement is not None  # a replayed pass is a pair's
    return Quantized(
        description=scheme.description,
        bits=scheme.bits,
        group=scheme.group,
        weights=done.weights[name],
        ppl_ratio={p: protocols[p].ppl_ratio for p in run.settings.protocols},
        agreement=agreement,
        seconds=sum(r.seconds for r in scored.values()),
    )


def evaluate(
    original: str, converted: str | None, settings: EvalSettings, log: Callable[[str], None] | None = None
) -> Results | None:
    """Evaluate ``original`` (and ``converted`` against it) on ``settings.data``; see module doc.
    ``log`` hears, before the scoring starts, how much will be scored. None on every process but
    the main one of a multi-process run."""
    return run(prepare(original, converted, settings), log)


def run(evaluation: Evaluation, log: Callable[[str], None] | None = None) -> Results | None:
    """Score the prepared ``evaluation`` (see the module doc); None on every process but the main one
    of a multi-process run."""
    started = time.perf_counter()
    map_large_allocations()  # logits come and go batch after batch: keep the heap from fragmenting
    ev, settings, tasks = evaluation, evaluation.settings, _Tasks(evaluation)
    pair = len(ev.paths) == 2
    if log is not None:
        how = "" if not pair else " both in memory" if settings.load_both else " one at a time"
        log(
            f"scoring {ev.ids.numel():,} tokens of {settings.data} with {len(ev.paths)} model(s){how}: "
            f"{len(ev.passes)} pass(es) of windows of {ev.seq_len} ({', '.join(settings.protocols)})"
            + (", then attention similarity" if ev.attention_batch is not None else "")
        )
        log(_estimate(ev))
    overlap = calibration_overlap(ev.data, settings.data, ev.folders[1], settings.text_field) if pair else None
    if overlap is not None and overlap.flagged:
        sys.stderr.write(overlap.warning() + "\n")
    scored = _one_at_a_time(ev, tasks, log) if pair and not settings.load_both else _together(ev, tasks)
    if not is_main_process():
        return None
    results = Results(
        schema=EVAL_SCHEMA,
        created=now(),
        settings={
            **asdict(settings),
            "seq_len": ev.seq_len,
            "stride": ev.stride,
            "protocols": list(settings.protocols),
        },
        models=dict(zip(ev.names, scored.models, strict=True)),
        tokenizer=tokenizer_info(ev.tokenizer),
        data=DataInfo(**ev.data.describe(), stream_tokens=ev.ids.numel(), calibration_overlap=overlap),
        protocols=scored.protocols,
        agreement=scored.agreement,
        attention=scored.attention,
        samples=scored.samples,
        greedy=scored.greedy,
        quantization=scored.quantization,
        reference=scored.reference,
        tasks=tasks.section(),
        device=scored.device,
        versions=versions(),
        git_revision=git_revision(),
        seconds=time.perf_counter() - started,
    )
    return results.checked()


#: What the process holds before any model (Python, torch, transformers, the tokenizer): the estimate's floor.
RUNTIME_BYTES = 512 << 20


def _estimate(run: Evaluation) -> str:
    """What the evaluation will hold, before any model loads: memory (the models in memory at once
    and a batch's logits, the replayed original's batch and the scoring's bounded temporaries, over the
    runtime's floor) and the reference cache's disk. The tiny 262,144-vocabulary benchmark: 2.6 GiB
    estimated, 3.0 GiB measured."""
    from mha2gqa.core.memory import HEAD_BLOCK
    from mha2gqa.core.units import parse_size

    s = run.settings
    device = resolve_device(s.device)
    dtype = resolve_dtype(s.dtype, device)
    element = torch.empty(0, dtype=dtype).element_size()
    params = [_parameters(folder) for folder in run.folders]
    held = sum(params) if s.load_both or len(params) == 1 else max(params)
    logits = s.batch_size * run.seq_len * _vocab(run) * element * (len(params) if s.load_both else 1)
    memory = held * element + 2 * logits + 4 * HEAD_BLOCK + RUNTIME_BYTES
    line = (
        f"estimate: about {format_bytes(memory)} of {device.type} memory (weights {format_bytes(held * element)}, "
        f"a batch's logits {format_bytes(logits)}; lower --batch-size or --seq-len for less)"
    )
    if len(params) == 2 and not s.load_both:
        total = _reference_size(run, device, dtype)
        if s.reference_cache is None:
            at_once = min(total, parse_size(s.reference_block) + logits)
            line += f"; {format_bytes(at_once)} of temporary disk at once ({format_bytes(total)} written)"
        else:
            line += f"; {format_bytes(total)} in --reference-cache {s.reference_cache} unless it holds them"
    return line


def _parameters(folder: Path) -> int:
    """About how many values ``folder``'s weights hold: its weight files' bytes over the stored dtype's."""
    from mha2gqa.core.models import stored_dtype

    stored = stored_dtype(folder / "config.json")
    files = [f for f in folder.iterdir() if f.suffix in (".safetensors", ".bin") and f.is_file()]
    return sum(f.stat().st_size for f in files) // (stored.bytes if stored else 4)


def _device_info(model: torch.nn.Module, device_map: str | None) -> DeviceInfo:
    """Where ``model`` ran: device type and name, dtype, processes (and a CPU's threads)."""
    p = next(model.parameters())
    cuda = p.device.type == "cuda"
    return DeviceInfo(
        type=p.device.type,
        dtype=str(p.dtype).removeprefix("torch."),
        device_map=device_map,
        processes=ranks().size,
        name=torch.cuda.get_device_name(p.device) if cuda else platform.processor() or platform.machine(),
        threads=None if cuda else torch.get_num_threads(),
    )
