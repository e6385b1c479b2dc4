"""The streaming MHA -> GQA conversion, in named stages: resolve the source and the method, calibrate
(when the method reads activations), decide where every output tensor comes from, then write them one at a time into a
folder that is renamed into place only when complete."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from mha2gqa.convert.calibration.own_text import with_own_text
from mha2gqa.convert.engine.retarget_view import retarget_record
from mha2gqa.convert.prepare import Conversion, prepare
from mha2gqa.convert.settings import COST_MEASURES, ConvertSettings
from mha2gqa.convert.write.shard_writer import OutputTensor, write_checkpoint
from mha2gqa.convert.write.tensor_sources import rewritten, tensor_sources
from mha2gqa.core.cache_layers import sizing_window
from mha2gqa.core.cards import model_card
from mha2gqa.core.checkpoint import AUX_FILES, Checkpoint, local_name
from mha2gqa.core.conversion_record import (
    Allocation,
    Calibration,
    ConversionRecord,
    Facts,
    Output,
    Refit,
    Source,
    StageGuard,
    WindowedCache,
)
from mha2gqa.core.dims import contiguous_groups, max_positions
from mha2gqa.core.dtypes import BY_CODE
from mha2gqa.core.errors import Mha2GqaError, first_line
from mha2gqa.core.expected_tensors import check_tensors, expected_tensors
from mha2gqa.core.families import Family
from mha2gqa.core.output import staged_output
from mha2gqa.core.per_layer import MODELING_FILE
from mha2gqa.core.ranks import ranks
from mha2gqa.core.recipe_file import recipe_name, write_recipe
from mha2gqa.core.records import CONVERSION_RECORD, now, version
from mha2gqa.core.resume import ResumeFolder, resumable
from mha2gqa.core.text_ref import portable_name, text_ref


@dataclass(frozen=True)
class ConversionResult:
    """What :func:`run` wrote: the folder, its record, and how long it took."""

    output: Path
    record: ConversionRecord = field(repr=False)
    seconds: float = 0.0
    #: the stage guard, for a stage after the conversion (``convert --distill``); None when off
    guard: Any = field(default=None, repr=False, compare=False)

    @property
    def facts(self) -> Facts:
        """What the conversion did (method, counts, KV bytes): the record's ``conversion``."""
        return self.record.conversion

    @property
    def kv_heads_per_layer(self) -> list[int]:
        """Each layer's KV heads after the conversion."""
        f = self.facts
        return f.num_kv_heads_per_layer or [f.num_kv_heads_after] * f.num_layers

    def summary(self) -> str:
        """One line for the terminal."""
        f, out = self.facts, self.record.output
        after = (
            f"{','.join(map(str, f.num_kv_heads_per_layer))} (per layer)"
            if f.num_kv_heads_per_layer
            else (str(f.num_kv_heads_after))
        )
        guard, allocation, lines = f.guard, f.per_layer_allocation, ""
        if not f.changed:
            lines += (
                f"\n  {f.num_kv_heads_after} KV heads is the model's own count: nothing merged, a byte-for-byte copy"
            )
        if allocation:
            chose = ",".join(map(str, allocation.chosen))
            lines += (
                f"\n  per-layer auto: chose {chose}, {sum(allocation.chosen)} of {allocation.budget_kv_heads} KV heads"
            )
        if f.windowed_cache:
            lines += f"\n  KV cache {f.windowed_cache.line()}"
        if f.calibration and f.calibration.own:
            lines += f"\n  calibration {f.calibration.data}: {f.calibration.own.line()}"
        if guard:
            lines += "".join(f"\n  guard: {stage.line()}" for stage in guard.stages) or f"\n  guard: {guard.where}"
        return (
            f"{self.record.family}: KV heads {f.num_kv_heads_before} -> {after} "
            f"({f.num_heads} query heads, {f.num_layers} layers, {f.recipe}); "
            f"KV cache {f.kv_cache_bytes_per_token_before:,} -> {f.kv_cache_bytes_per_token_after:,} "
            f"bytes/token ({f.kv_cache_dtype}); wrote {out.total_size / 2**20:,.1f} MiB in "
            f"{len(out.files)} shard(s) to {self.output} in {self.seconds:.1f} s" + lines
        )


def _collect(source: Conversion, groups: int | tuple[int, ...] | None, on_layer=None) -> Any:
    """The streamed calibration pass over the conversion's text (statistics for ``groups`` KV heads;
    ``on_layer`` sees each layer; under a launcher the windows are split across the processes, every
    one calling this; see :func:`~mha2gqa.convert.calibration.streaming.collect`)."""
    from mha2gqa.convert.calibration.streaming import CalibrationText, PassOptions, collect
    from mha2gqa.core.models import autocast_dtype

    s = source.settings
    text = CalibrationText(source.text, s.calibration_tokens, s.calibration_seq_len)
    options = PassOptions(
        s.device,
        grouping=source.grouping,
        allow_pickle=s.allow_pickle,
        progress=s.progress,
        # a refit starts better from the values' principal subspace than from the output-weighted
        # code (docs/methods.md, "The value code weighted by o_proj")
        weigh_values=not s.refit,
        weighted_aside=s.refit and source.method.weighs_values and s.guard != "off",  # the merge the guard holds it to
        autocast=autocast_dtype(s.refit_arithmetic()),  # a refit's calibration runs in its arithmetic
    )
    return collect(source.ckpt, groups, text, options, on_layer=on_layer)


def _calibrate(source: Conversion) -> tuple[Any, Calibration | None]:
    """Calibration statistics (None when the method needs none) and their record (every process of a
    launcher calls this: :func:`_collect`)."""
    s = source.settings
    if not source.layered or not source.changes:
        return None, None
    if not s.calibration:  # a layer method that works from the weights alone (aligned)
        return None, Calibration(None, 0, source.dims.rotary, weights_only=True)
    stats = _collect(source, source.targets if source.per_layer else source.targets[0])
    own = source.own.facts if source.own is not None else None
    return stats, Calibration(
        portable_name(s.calibration), stats.tokens, stats.rotary_dim, text=text_ref(s.calibration), own=own
    )


def _allocate(source: Conversion) -> tuple[Conversion, Allocation]:
    """``--per-layer auto``: measure each layer's cost of every KV-head count on the calibration text
    and choose the counts (:mod:`~mha2gqa.convert.plan.allocation`); returns the conversion
    with those counts and the allocation record."""
    from mha2gqa.convert.plan.allocation import LOGITS_WINDOWS, FinalKL, Merger, allocate, layer_costs, output_costs

    s, dims = source.settings, source.dims
    candidates = dims.valid_kv_heads()
    costs: dict[int, dict[int, float]] = {}
    merger = Merger(source.ckpt, source.family, dims, source.method, source.grouping)
    final = FinalKL(LOGITS_WINDOWS) if s.allocation_cost == "logits" else None

    def measure(layer: int, full, run) -> None:
        if final is not None:
            final.add(run, layer, full, merger, candidates)
        elif s.allocation_cost == "output":
            costs[layer] = output_costs(run, layer, full, merger, candidates)
        else:
            costs[layer] = layer_costs(full, candidates, source.grouping)

    _collect(source, None, on_layer=measure)
    if final is not None:
        costs = dict(enumerate(_final_costs(source, final, candidates)))
    ordered = [costs[i] for i in range(dims.num_layers)]
    budget = s.budget(dims.num_layers)
    chosen = allocate(ordered, budget)
    if sum(chosen) < budget:  # no counts of the candidates per layer spend it all: say so, never silently
        sys.stderr.write(
            f"warning: --per-layer auto: no choice of {', '.join(map(str, sorted(candidates)))} KV heads per layer "
            f"spends the budget of {budget} KV heads; the best spends {sum(chosen)} "
            f"({','.join(map(str, chosen))})\n"
        )
    uniform = {str(g): sum(c[g] for c in ordered) for g in candidates if g * dims.num_layers <= budget}
    record = Allocation(
        budget_kv_heads=budget,
        average_kv_heads=budget / dims.num_layers,
        chosen=list(chosen),
        cost=sum(c[g] for c, g in zip(ordered, chosen, strict=True)),
        uniform_cost=uniform,
        cost_measure=COST_MEASURES[s.allocation_cost],
        costs={str(i): {str(g): v for g, v in c.items()} for i, c in enumerate(ordered)},
    )
    return source.with_targets(tuple(chosen)), record  # uniform when the best allocation is


def _guard_allocation(c: Conversion, planned: tuple[Any, Any, list[OutputTensor]], guard: Any):
    """``--per-layer auto`` under the stage guard: the allocated counts' merge against uniform counts
    within the same budget (the most KV heads every layer can keep), scored on the guard's windows;
    ``(conversion, statistics, calibration record, tensors)`` of the allocation where it is better,
    else of the uniform conversion (``planned``: the allocation's three)."""
    dims = c.dims
    fits = [g for g in dims.valid_kv_heads() if g * dims.num_layers <= c.settings.budget(dims.num_layers)]
    if not fits or len(set(c.targets)) == 1:  # nothing uniform to compare with, or the allocation is uniform
        return (c, *planned)
    uniform = c.with_targets((max(fits),) * dims.num_layers)
    stats, calibration = _calibrate(uniform)
    uniform = uniform.planned(stats)
    tensors = tensor_sources(uniform.ckpt, uniform.family, dims, uniform.plans, uniform.method, stats, c.settings.seed)
    log = c.stage_log(_log)
    if ranks().decide(lambda: guard.allocation(c, planned[2], uniform, tensors, log)):  # scored on rank 0
        return (c, *planned)
    return uniform, stats, calibration, tensors


def _final_costs(c: Conversion, final: Any, candidates: list[int]) -> list[dict[int, float]]:
    """The ``logits`` costs of every layer at each of ``candidates`` from the streams ``final``
    followed, through the model's head."""
    from mha2gqa.convert.engine.layers import model_head, skeleton
    from mha2gqa.core.models import resolve_device

    logits = model_head(skeleton(c.ckpt), c.ckpt, resolve_device(c.settings.device)) if final.streams else None
    return final.costs(logits, c.dims.num_layers, c.dims.num_kv_heads, candidates)


def _layer_groups(stats, targets: tuple[int, ...]) -> dict[str, list[list[int]]] | None:
    """Which source KV heads each new KV head pools, per layer (similarity grouping)."""
    if stats is None:
        return None
    out = {}
    for layer, st in sorted(stats.layers.items()):
        perm, groups = st.perm or [], targets[layer]
        out[str(layer)] = [[perm[i] for i in grp] for grp in contiguous_groups(len(perm), groups)] if perm else None
    return out


def _kv_dtype(ckpt: Checkpoint, family: Family) -> str:
    name = (family.qkv_proj or family.k_proj).format(layer=0) + ".weight"
    info = ckpt.tensors.get(name)
    return info.dtype if info else "F32"


def _source_record(ckpt: Checkpoint) -> Source:
    files = []
    for path in ckpt.files:
        entry: dict[str, Any] = {"name": path.name, "size": path.stat().st_size}
        if ckpt.format == "safetensors":
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                entry["header_sha256"] = hashlib.sha256(f.read(n)).hexdigest()
        files.append(entry)
    return Source(
        path=ckpt.repo_id or local_name(ckpt.folder),  # a record travels: no folder of this machine
        repo_id=ckpt.repo_id,
        revision=ckpt.revision,
        config_sha256=hashlib.sha256((ckpt.folder / "config.json").read_bytes()).hexdigest(),
        format=ckpt.format,
        files=files,
    )


def _record(
    source: Conversion,
    stats: Any,
    calibration: Calibration | None,
    allocation: Allocation | None,
    tensors: list[OutputTensor],
    refitted: Refit | None,
    serving_form: str | None,
    guard: StageGuard | None = None,
) -> ConversionRecord:
    """The conversion record (``mha2gqa_conversion.json``): settings, shapes, what changed, KV bytes."""
    s, dims, targets, method = source.settings, source.dims, source.targets, source.method
    g = max(targets)
    kv_dtype = _kv_dtype(source.ckpt, source.family)
    esize = BY_CODE[kv_dtype].bytes
    rewrites = set(method.rewrites) | ({"q", "o"} if source.grouping.reorders else set())
    rewrites = sorted(rewrites | set(refitted.params if refitted else ()), key="qkvo".index)
    facts = Facts(
        method=method.name,
        method_summary=method.summary,
        calibration=calibration,
        grouping=source.grouping.name,
        grouping_summary=source.grouping.summary,
        source_kv_heads_per_kv_head_by_layer=_layer_groups(stats, targets) if source.grouping.reorders else None,
        seed=s.seed if method.fresh else None,
        num_layers=dims.num_layers,
        num_heads=dims.num_heads,
        num_kv_heads_before=dims.num_kv_heads,
        num_kv_heads_after=g,
        num_kv_heads_per_layer=list(targets) if source.per_layer else None,
        head_dim=dims.head_dim,
        query_heads_per_kv_head=contiguous_groups(dims.num_heads, g),
        source_kv_heads_per_kv_head=contiguous_groups(dims.num_kv_heads, g),
        rewrites=rewrites if source.changes else [],
        rewritten=rewritten(tensors, source.family),
        kv_cache_dtype=kv_dtype,
        kv_cache_bytes_per_token_before=dims.kv_cache_bytes_per_token(None, esize),
        kv_cache_bytes_per_token_after=dims.kv_cache_bytes_per_token(targets, esize),
        retarget=retarget_record(source.ckpt),
        runs_in=source.family.serving or None,  # where checkpoints of the output class run
        per_layer_allocation=allocation,
        serving_form=serving_form,
        refit=refitted,
        guard=guard,
        windowed_cache=_windowed_cache(source, targets, esize),
        layer_plans=list(source.plans),
    )
    settings = {k: v for k, v in asdict(s).items() if k not in ("progress", "overwrite")} | s.recipe()  # portable
    return ConversionRecord(
        mha2gqa_version=version(),
        created=now(),
        family=source.family.family,
        source=_source_record(source.ckpt),
        settings=settings,
        conversion=facts,
    )


def _output_config(source: Conversion) -> tuple[dict[str, Any], str | None, str | None]:
    """The converted model's ``config.json``, the modeling file a per-layer checkpoint carries (None
    otherwise) and which serving form it has (None for one count in every layer)."""
    new_config = {**source.ckpt.config, **source.family.kv_config(max(source.targets))}
    if not source.per_layer:
        return new_config, None, None
    from mha2gqa.core.per_layer import per_layer_checkpoint  # loaded by mha2gqa, or transformers + remote code

    fields, modeling, serving_form = per_layer_checkpoint(source.ckpt.config, list(source.targets))
    return new_config | fields, modeling, serving_form


#: the refit's working folder inside the staged output (removed before it is published)
_REFIT_WORK = ".mha2gqa-refit"


class _Checks:
    """Validate source and planned output against transformers' own model classes (built on the
    meta device) in a background thread, so the ~2 s of importing transformers overlaps the
    first copies. ``poll`` raises as soon as a check fails; ``wait`` blocks until both ran."""

    def __init__(self, ckpt: Checkpoint, tensors: list[OutputTensor], new_config: dict[str, Any]) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mha2gqa-check")
        self._done = False
        source = {name: info.shape for name, info in ckpt.tensors.items()}
        output = {t.name: t.shape for t in tensors}
        self._future = self._pool.submit(self._run, source, ckpt.config, str(ckpt.folder), output, new_config)

    @staticmethod
    def _run(source: dict, config: dict, what: str, output: dict, new_config: dict) -> None:
        try:
            expected = expected_tensors(config)
        except Mha2GqaError:
            raise
        except Exception as e:  # transformers refuses the config: a bad value or type in it
            raise Mha2GqaError(
                f"{what}/config.json: transformers cannot build this model from it "
                f"({type(e).__name__}: {first_line(e, 200)})"
            ) from None
        check_tensors(source, expected, what)
        check_tensors(output, expected_tensors(new_config), "converted model (internal error)")

    def poll(self) -> None:
        if not self._done and self._future.done():
            self.wait()

    def wait(self) -> None:
        self._future.result()
        self._done = True

    def __enter__(self) -> _Checks:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _write(
    source: Conversion,
    tensors: list[OutputTensor],
    make_record: Callable[..., ConversionRecord],
    guard: Any = None,
    resume: ResumeFolder | None = None,
    alone: list[OutputTensor] | None = None,
) -> ConversionRecord:
    """Refit (``--refit``) and write the converted checkpoint into a staged folder beside its
    destination, then rename it into place; returns the record as written (with its output files).
    The refit's own files (fitted layers, spilled hidden states) live in the staged folder until the
    shards are written, so a failure or a signal leaves nothing behind but the fitted layers, kept
    for ``--resume`` in ``resume`` (the caller's, which it removes once its own output is published;
    else DST's own, removed here once DST is). ``alone``: the method's merge without the refit, where
    the refit starts from another (:func:`_merge_alone`), scored by the guard beside it."""
    ckpt, s = source.ckpt, source.settings
    new_config, modeling, serving_form = _output_config(source)
    owned = resume is None and source.fingerprint is not None
    if owned:  # a refit: each fitted layer kept beside DST until DST is published
        resume = ResumeFolder.open(source.dst, source.fingerprint, s.resume, s.remove_stale)
    staged = staged_output(source.dst, s.overwrite, source.inputs, remove_stale=s.remove_stale)
    with resumable(resume if owned else None), _Checks(ckpt, tensors, new_config) as checks, staged as tmp:
        refitted, log = None, source.stage_log(_log)
        merged = tensors
        if s.refit and source.changes:
            from mha2gqa.convert.refit import refit

            checks.wait()  # the checks import transformers in their thread: never two importers at once
            tensors, refitted = refit(source, tensors, tmp / _REFIT_WORK, log=log, resume=resume)
        guarded = None
        if guard is not None:
            checks.wait()
            tensors, guarded = guard.conversion(source, merged, (tensors, refitted) if refitted else None, log, alone)
        record = make_record(tensors, refitted, serving_form, guarded)
        written = write_checkpoint(
            tmp, tensors, s.max_shard_size, progress=s.progress, fsync=s.fsync, after_each=checks.poll
        )
        checks.wait()
        shutil.rmtree(tmp / _REFIT_WORK, ignore_errors=True)
        (tmp / "config.json").write_text(json.dumps(new_config, indent=2) + "\n", encoding="utf-8")
        if modeling is not None:
            (tmp / MODELING_FILE).write_text(modeling, encoding="utf-8")
        for name in AUX_FILES:
            if (ckpt.folder / name).is_file():
                shutil.copyfile(ckpt.folder / name, tmp / name)
        record = dataclasses.replace(record, output=Output(written.files, written.total_size))
        (tmp / CONVERSION_RECORD).write_text(record.to_json(), encoding="utf-8")
        (tmp / "README.md").write_text(model_card(record), encoding="utf-8")
        write_recipe(tmp, recipe_name(s.method, s.refit, False), {"convert": s.recipe()})
    if resume is None:  # DST published by a run that keeps no work: nothing stopped is left beside it
        ResumeFolder.discard(source.dst)
    return record


def _windowed_cache(source: Conversion, targets, esize: int) -> WindowedCache | None:
    """A model whose layers keep different spans: its cache at :data:`SIZING_WINDOW` tokens (or its
    positions), before and after (None: every layer holds every token, bytes/token says it all)."""
    dims = source.dims
    if not dims.windowed:
        return None
    tokens = sizing_window(max_positions(source.ckpt.config))
    before, after = (dims.kv_cache_bytes(tokens, g, esize) for g in (None, targets))
    return WindowedCache(tokens, before, after, dims.window_note())


def _merge_alone(c: Conversion, stats: Any) -> list[OutputTensor] | None:
    """The merge ``--method`` publishes without ``--refit`` where a refit starts from another (``svd``:
    the output-weighted value code, the refit the plain principal subspace), for the stage guard to
    hold the refit to: the recipe is never worse than the method alone. None where they are one."""
    weighted = stats.weighted() if stats is not None else None  # kept aside only for a guarded refit
    if weighted is None:
        return None
    return tensor_sources(c.ckpt, c.family, c.dims, c.plans, c.method, weighted, c.settings.seed)


def _refit_alongside(c: Conversion, tensors: list[OutputTensor], resume: ResumeFolder | None) -> None:
    """A process other than rank 0: its share of ``--refit``'s windows (streams kept in a scratch
    folder beside DST, removed at the end), in step with rank 0's :func:`_write`; writes nothing."""
    if not (c.settings.refit and c.changes):
        return
    from mha2gqa.convert.refit import refit
    from mha2gqa.core.output import scratch_folder

    with scratch_folder(c.dst) as work:
        refit(c, tensors, work, resume=resume)


def _log(line: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(line, file=sys.stderr)


def run(
    conversion: Conversion, guard_data: str | None = None, resume: ResumeFolder | None = None
) -> ConversionResult | None:
    """Carry out a conversion made by :func:`~mha2gqa.convert.prepare.prepare`: per-layer allocation and
    calibration when the method needs them, where every output tensor comes from, the refit (``--refit``),
    then the staged write. Streams tensor by tensor (and layer by layer): peak memory is about one
    layer, whatever the model size; nothing is left at the destination when it fails. The stage guard
    (:mod:`~mha2gqa.convert.guard`, ``--guard``) scores the merge and the refit on held-out windows of
    the calibration text (``guard_data`` where the conversion itself reads none, e.g. before ``--distill``)
    and publishes only what made the model better. ``resume``: where a caller that publishes later
    (``convert --distill``) keeps the refit's finished layers. Under a launcher (``torchrun``), every process
    reads its share of the calibration windows for the statistics and the refit, whose sums are summed
    across them; the stage guard scores on rank 0, which alone writes: the other processes return None
    once the refit is done."""
    from mha2gqa.convert.guard import open_guard

    start = time.perf_counter()
    conversion = with_own_text(conversion, conversion.stage_log(_log))  # (--self-text: once, before the guard)
    conversion, guard = open_guard(conversion, guard_data or conversion.settings.calibration)
    allocation = None
    if conversion.settings.per_layer == "auto":
        conversion, allocation = _allocate(conversion)
    stats, calibration = _calibrate(conversion)
    c = conversion.planned(stats)  # what each layer becomes, before any tensor is written
    tensors = tensor_sources(c.ckpt, c.family, c.dims, c.plans, c.method, stats, c.settings.seed)
    if guard is not None and allocation is not None:
        c, stats, calibration, tensors = _guard_allocation(c, (stats, calibration, tensors), guard)
    if not ranks().main:  # several processes: each refits its share of the windows; rank 0 writes
        _refit_alongside(c, tensors, resume)
        return None
    alone = _merge_alone(c, stats) if guard is not None else None
    record = _write(c, tensors, partial(_record, c, stats, calibration, allocation), guard, resume, alone)
    return ConversionResult(c.dst.absolute(), record, time.perf_counter() - start, guard)


def convert_checkpoint(
    src: str | Path, dst: str | Path, num_kv_heads: int | None, method: str | None = None, **options: Any
) -> ConversionResult | None:
    """Convert the checkpoint at ``src`` (folder or hub id) to ``num_kv_heads`` KV heads in ``dst``
    (``None`` with ``num_kv_heads_per_layer="8,4,..."``: each layer its own count): ``run(prepare(...))``.

    ``method`` and ``options`` are the fields of :class:`~mha2gqa.convert.settings.ConvertSettings`
    (their defaults and meaning are there; the methods are in :mod:`mha2gqa.convert.methods`).
    Raises :class:`~mha2gqa.core.errors.Mha2GqaError` for bad input, before anything is written.
    Under a launcher (``torchrun``) every process but rank 0 returns None (see :func:`run`).
    """
    s = ConvertSettings(num_kv_heads=num_kv_heads, **({"method": method} if method else {}), **options)
    return run(prepare(src, dst, s))
