"""The refit itself (:func:`refit`): each changed layer, in order, fitted on the streams and written
beside the output; see the package doc."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from mha2gqa.convert.engine.layer_view import LayerWeights, norm_overrides, planned
from mha2gqa.convert.engine.layers import batched, each_layer, skeleton
from mha2gqa.convert.methods import HeadShape
from mha2gqa.convert.prepare import Conversion
from mha2gqa.convert.refit.fit import (
    FitData,
    FitResult,
    FitSteps,
    fit_layer,
    is_exact,
    probe_near,
    solve_output,
    split_windows,
)
from mha2gqa.convert.refit.objective import Objective
from mha2gqa.convert.refit.stops import after_attention, hooked, layer_output, reads_after_attention
from mha2gqa.convert.refit.streams import Streams, dimension_scale, open_streams
from mha2gqa.convert.write.shard_writer import OutputTensor
from mha2gqa.core.conversion_record import (
    ATTENTION_TARGET,
    LAYER_TARGET,
    NORMALIZED_ERROR,
    O_SOLVED,
    Refit,
    RefitLayer,
)
from mha2gqa.core.dtypes import BY_CODE
from mha2gqa.core.layer_tensors import LayerTensors, attention_names
from mha2gqa.core.memory import STEP_BLOCKS, map_large_allocations
from mha2gqa.core.resume import ResumeDamaged, ResumeFolder
from mha2gqa.core.text_ref import portable_name, text_ref


def _spilled(path: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name)


def _norm_overrides(c: Conversion, tensors: Mapping[str, OutputTensor], layer: int, shape: HeadShape, prefix: str):
    """The converted per-head key norm of ``layer`` in the source module's shape (:func:`norm_overrides`)."""
    return norm_overrides(c.family, planned(tensors, c.ckpt), tensors, layer, shape, prefix)


def _attention_module(c: Conversion, by_name: Mapping[str, OutputTensor], i: int, prefix: str) -> str:
    """Layer ``i``'s attention block, relative to the layer (the module holding its output projection)."""
    o_proj = attention_names(by_name, c.family, i)["o"]
    return o_proj[len(prefix) : -len(".weight")].rpartition(".")[0]


def _advance_original(
    source_layer: Callable[[torch.Tensor, list[int]], torch.Tensor],
    st: Streams,
    attention: torch.nn.Module | None,
    exact: torch.nn.Module | None,
) -> None:
    """Run the original stream through the source layer (``source_layer(states, windows)``; ``exact``: what
    runs in float32, :meth:`Streams.advance`); with ``attention`` (its attention block), keep the
    residual stream after it, ``x + a``, in ``st.targets`` on the way."""
    if attention is None:
        st.advance(st.original, source_layer, exact)
        return
    seen: list[torch.Tensor] = []

    def step(x: torch.Tensor, w: list[int]) -> torch.Tensor:
        y = source_layer(x, w)
        st.targets[w] = x + seen.pop()
        return y

    with hooked(attention, lambda module, args, out: seen.append(layer_output(out))):
        st.advance(st.original, step, exact)


def _exact_part(c: Conversion, layer, i: int, prefix: str, by_name: Mapping[str, OutputTensor]) -> torch.nn.Module:
    """What of converted layer ``i`` (its source module ``layer``) the streams run in float32: its
    attention block (the whole layer where the block has no module of its own)."""
    path = _attention_module(c, by_name, i, prefix)
    return layer.get_submodule(path) if path else layer


class _ConvertedLayer:
    """Layer ``i`` as the conversion writes it, run through its source module ``layer``: its
    projections by role from ``by_name`` (:class:`LayerWeights`, float32 on the device), the per-head
    key norms, and :meth:`__call__` ``(values, h, windows)`` -> the layer's output with ``values``."""

    def __init__(self, c: Conversion, layer, i: int, prefix: str, st: Streams, by_name: dict[str, OutputTensor]):
        from accelerate.utils import set_module_tensor_to_device

        self.layer, self.prefix, self.st = layer, prefix, st
        self.shape = HeadShape.of(c.dims, c.targets[i])
        self.layout = LayerTensors.of(by_name, c.family, i, c.dims.num_heads, c.dims.head_dim)
        self.names = self.layout.names
        load = planned(by_name, c.ckpt)
        tensors = {n: load(n).to(st.dev) for n in self.names.values()}
        self.weights = LayerWeights(tensors, self.layout, self.shape)
        self.norms = {k: v.to(st.dev) for k, v in _norm_overrides(c, by_name, i, self.shape, prefix).items()}
        for name in [*self.weights.module_view(self.weights.values, prefix), *self.norms]:  # replaced on every call
            set_module_tensor_to_device(layer, name, "meta")
        self.weights.adapt(layer, prefix)

    def __call__(self, values, h: torch.Tensor, w: list[int]) -> torch.Tensor:
        params = self.weights.module_view(values, self.prefix) | self.norms
        return layer_output(torch.func.functional_call(self.layer, params, (h,), batched(self.st.kw, len(w))))


@dataclass(frozen=True)
class _Layer:
    """Decoder layer ``i``, loaded (its ``module``, whose tensors are named ``prefix...``), with what of
    it runs in float32 (``exact``: :func:`_exact_part`) and the attention block a fit stops after
    (``attention``; None: the fit runs the whole layer)."""

    i: int
    module: Any
    prefix: str
    exact: Any
    attention: Any = None


def _refit_layer(
    c: Conversion, at: _Layer, st: Streams, by_name: dict[str, OutputTensor], work: Path, last: float | None = None
) -> FitResult:
    """Fit layer ``i``'s projections (its module ``layer``, materialized, the original stream already
    past it), write them to ``work`` and point ``by_name`` at them, and advance the converted stream
    through the layer as written (``exact``: what of it runs in float32, :func:`_exact_part`). With
    ``attention`` (the layer's attention block) the fit reproduces the original's residual stream after
    it (``st.targets``) and runs the layer only that far. ``last``: the learning rate the previous
    refitted layer went on with (the rates probed are near it: :func:`probe_near`)."""
    layer, i, prefix, attention, exact = at.module, at.i, at.prefix, at.attention, at.exact
    s, dev = c.settings, st.dev
    converted = _ConvertedLayer(c, layer, i, prefix, st, by_name)
    weights, names = converted.weights, converted.names

    def fitted_part(values, w):
        x = st.converted[w].to(dev)
        if attention is None:
            return converted(values, x, w)
        return after_attention(lambda h: converted(values, h, w), attention, x)

    target = st.original if attention is None else st.targets
    fitted, _ = split_windows(len(st.ids))

    def targets(w: list[int]) -> torch.Tensor:
        return target[w].to(dev)

    scale = dimension_scale(target, fitted, st.per_call, st.ranks).to(dev)
    plan = c.plans[i]
    trainable = [r for r in weights.values if r[0] in plan.refit]
    how = FitSteps(
        s.refit_steps, s.refit_lr, st.batch, s.seed * 1_000_003 + i,
        probe=probe_near(None if last is None else last / s.refit_lr),
        autocast=st.autocast,
        spill=st.work / "probe-run.pt",  # the probe's best run while it tries the next
    )  # fmt: skip
    data = FitData(targets, len(st.ids), st.per_call, Objective(normalize=True, scale=scale), st.ranks)
    result = fit_layer(fitted_part, weights.values, trainable, data, how)
    if plan.solve_output and "o" in trainable:
        o_proj = layer.get_submodule(names["o"][len(prefix) : -len(".weight")])
        result = solve_output(result, fitted_part, data, o_proj)
    out = weights.outputs(result.values, {n: BY_CODE[by_name[n].dtype].torch for n in names.values()})
    written = LayerWeights(out, converted.layout, converted.shape).values  # as stored: what the next layer reads
    st.advance(st.converted, partial(converted, written), exact)
    if st.ranks.main:  # the other processes (the same values) write nothing
        _spill_layer(out, work / f"layer-{i}.safetensors", by_name)
    return result


def _resumed_layer(
    c: Conversion, at: _Layer, st: Streams, by_name: dict[str, OutputTensor], resume: ResumeFolder
) -> RefitLayer:
    """Layer ``i`` as a stopped run fitted it (``--resume``): its tensors read from the resume folder,
    ``by_name`` pointed at them, the converted stream advanced through them exactly as the run that
    fitted them advanced it (``exact`` in float32: :func:`_exact_part`); returns the layer's record as that
    run wrote it."""
    from safetensors import SafetensorError

    from mha2gqa.core.typed import RecordError, read

    layer, i, prefix, exact = at.module, at.i, at.prefix, at.exact

    try:
        record = read(RefitLayer, resume.read_json(f"layer-{i}.json"), f"layer-{i}.json")
    except RecordError as e:
        raise ResumeDamaged(f"{resume.folder}: {e}; pass --remove-stale to start over") from None
    path = resume.path(f"layer-{i}.safetensors")
    names = attention_names(by_name, c.family, i)
    try:
        _point_at(path, names.values(), by_name)
        converted = _ConvertedLayer(c, layer, i, prefix, st, by_name)
    except (OSError, KeyError, ValueError, RuntimeError, SafetensorError) as e:
        why = f"not the layer a stopped run wrote ({str(e)[:120]}); pass --remove-stale to start over"
        raise ResumeDamaged(f"{path}: {why}") from None
    if not all(torch.isfinite(t).all() for t in converted.weights.values.values()):
        raise ResumeDamaged(
            f"{path}: holds NaN or infinite values (damaged or edited); pass --remove-stale to start over"
        )
    st.advance(st.converted, partial(converted, converted.weights.values), exact)
    return record


def _spill_layer(out: dict[str, torch.Tensor], path: Path, by_name: dict[str, OutputTensor]) -> None:
    """Write a refitted layer's tensors to ``path`` (beside it, then renamed: whole or absent) and
    point its rules in ``by_name`` at them."""
    import os

    from safetensors.torch import save_file

    partial_path = path.with_name(f".{path.name}.partial")
    save_file({n: t.cpu() for n, t in out.items()}, str(partial_path))
    os.replace(partial_path, path)
    _point_at(path, out, by_name)


def _point_at(path: Path, names, by_name: dict[str, OutputTensor]) -> None:
    for n in names:
        rule = by_name[n]
        by_name[n] = OutputTensor(n, rule.dtype, rule.shape, partial(_spilled, path, n))


def refit(
    c: Conversion,
    tensors: list[OutputTensor],
    work: Path,
    log: Callable[[str], None] | None = None,
    resume: ResumeFolder | None = None,
) -> tuple[list[OutputTensor], Refit]:
    """Refit every changed layer of the planned conversion ``tensors`` (see the module doc); returns
    the plan with each refitted layer's projections read from ``work`` (safetensors written there,
    one file per layer) and the :class:`Refit` record. With ``resume`` each fitted layer is kept there
    (tensors, then record), and a layer a stopped run already fitted is read back, not fitted again.
    Under a launcher every process calls this (its own ``work`` for its streams): each runs its share
    of the windows, the sums are summed (:func:`fit_layer`), and rank 0 alone writes the layers and
    the kept work (the others read its ``resume`` folder, named by rank 0)."""
    from mha2gqa.core.progress import bar as progress_bar

    s = _planned(c).settings
    map_large_allocations(STEP_BLOCKS)
    model = skeleton(c.ckpt)
    st = open_streams(c, model, work)
    resume, done = _kept_layers(st.ranks, resume, c.dims.num_layers)
    by_name = {t.name: t for t in tensors}
    records: list[RefitLayer] = []
    whole: list[int] = []  # layers fitted on their output although the target is attention's
    desc = f"refitting on {st.ids.numel():,} tokens"
    quiet = not s.progress or not st.ranks.main
    with progress_bar(total=c.dims.num_layers, unit="layer", desc=desc, disable=quiet) as bar:
        for i, layer, prefix in each_layer(model, c.ckpt, st.dev, torch.float32):
            layer.requires_grad_(False)

            def source_layer(h, w, layer=layer):
                return layer_output(layer(h, **batched(st.kw, len(w))))

            plan = c.plans[i]  # what the layer becomes: its counts, what the fit fits and reproduces
            changed = plan.changed
            exact = _exact_part(c, layer, i, prefix, by_name) if changed else None
            attention = None
            if changed and plan.refit_target == "attention":
                attention = None if exact is layer else exact
                one = st.mine[:1]
                first = st.original[one].to(st.dev)
                if attention is None or not reads_after_attention(partial(source_layer, w=one), attention, first):
                    attention = None
                    whole.append(i)
            _advance_original(source_layer, st, attention, exact)
            if not changed:  # an exact copy, run as it is
                st.advance(st.converted, source_layer, None)
            elif i in done:
                records.append(_resumed_layer(c, _Layer(i, layer, prefix, exact), st, by_name, resume))
            else:
                t0 = time.perf_counter()
                kept = work if resume is None else resume.folder
                last = next((r.lr for r in reversed(records) if r.lr is not None), None)
                result = _refit_layer(c, _Layer(i, layer, prefix, exact, attention), st, by_name, kept, last)
                records.append(_layer_record(i, result, time.perf_counter() - t0, log))
                if resume is not None and st.ranks.main:  # after its tensors: a record says the layer is whole
                    resume.write_bytes(f"layer-{i}.json", json.dumps(dataclasses.asdict(records[-1])).encode())
                del result
            bar.update(1)
    return [by_name[t.name] for t in tensors], _refit_record(s, st, records, whole)


def _planned(c: Conversion) -> Conversion:
    """``c``, which must carry one plan a layer (:meth:`Conversion.planned`): a caller's mistake otherwise."""
    if len(c.plans) != c.dims.num_layers:
        raise ValueError("refit() needs the planned conversion (Conversion.planned(stats)), one plan a layer")
    return c


def _kept_layers(team, resume: ResumeFolder | None, layers: int) -> tuple[ResumeFolder | None, set[int]]:
    """``(the kept work, the layers a stopped run fitted)`` as rank 0 sees them, on every process."""
    kept = team.decide(
        lambda: (
            None
            if resume is None
            else (str(resume.folder), [i for i in range(layers) if resume.has(f"layer-{i}.json")])
        )
    )
    if kept is None:
        return None, set()
    return (resume if team.main else ResumeFolder(Path(kept[0]))), set(kept[1])


def _refit_record(s, st: Streams, records: list[RefitLayer], whole: list[int]) -> Refit:
    """The refit's record: its settings as run and each refitted layer's."""
    fitted, held = split_windows(len(st.ids))
    return Refit(
        data=portable_name(s.calibration),
        text=text_ref(s.calibration),
        tokens=st.ids.numel(),
        windows=len(fitted),
        heldout_windows=len(held),
        steps=s.refit_steps,
        lr=s.refit_lr,
        batch=st.batch,
        params=list(s.refit_roles()),
        seed=s.seed,
        layers=records,
        error=NORMALIZED_ERROR,
        precision=st.precision,
        target=_target(s.refit_target, whole, [r.layer for r in records]),
    )


def _layer_record(i: int, result, seconds: float, log: Callable[[str], None] | None) -> RefitLayer:
    """Layer ``i``'s refit as recorded (and logged)."""
    if log is not None:
        log(
            f"layer {i}: held-out error {result.loss_before:.4g} -> {result.loss_after:.4g}"
            + (" (the merge is exact: not refitted)" if is_exact(result.loss_before) else "")
            + (" (kept the merged weights)" if result.kept and not is_exact(result.loss_before) else "")
            + f", {result.steps} steps"
            + (f" at lr {result.lr:g}" if result.lr is not None else "")
            + (f", {O_SOLVED} (ridge {result.ridge:g})" if result.ridge is not None else "")
            + f", {seconds:.1f} s"
        )
    return RefitLayer(
        i, result.loss_before, result.loss_after, result.kept, result.steps, round(seconds, 3), result.ridge, result.lr
    )


def _target(asked: str, whole: list[int], refitted: list[int]) -> str:
    """:attr:`Refit.target`: ``whole``: the refitted layers that were fitted on their output although
    ``asked`` was ``attention`` (they do not read their input only through the stream after it)."""
    if asked == "layer" or (whole and len(whole) == len(refitted)):
        return LAYER_TARGET
    if not whole:
        return ATTENTION_TARGET
    return f"{ATTENTION_TARGET} ({LAYER_TARGET} in layers {', '.join(map(str, whole))})"
