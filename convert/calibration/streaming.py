"""Calibration: the original model reads calibration text layer by layer through the layer engine
(:mod:`mha2gqa.convert.engine.layers`), streamed from its shards, while
:func:`mha2gqa.core.capture.capturing` hands every layer's attention inputs to the statistics
(:mod:`mha2gqa.convert.calibration.stats`). Memory: one layer plus the calibration activations, never
the whole model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mha2gqa.convert.calibration.grouping import regroup
from mha2gqa.convert.calibration.stats import CalibrationStats, LayerStats, accumulate, output_gram
from mha2gqa.convert.engine.layers import (
    LayerRun,
    calibration_ids,
    each_layer,
    first_layer_inputs,
    float32_on_call,
    skeleton,
)
from mha2gqa.convert.plan.groupings import Grouping, get_grouping
from mha2gqa.convert.settings import calibration_window
from mha2gqa.core.checkpoint import Checkpoint
from mha2gqa.core.dims import max_positions
from mha2gqa.core.ranks import Ranks, ranks
from mha2gqa.core.signals import check as check_signals


@dataclass(frozen=True)
class CalibrationText:
    """What a calibration pass reads: the first ``tokens`` tokens of ``data`` (a file or a ``datasets``
    name; its ``text_field``) in windows of ``seq_len`` (None: the default window, cut to the model)."""

    data: str
    tokens: int
    seq_len: int | None = None
    text_field: str = "text"


@dataclass(frozen=True)
class PassOptions:
    """How a calibration pass runs and what it keeps (see :func:`collect`)."""

    device: str = "auto"
    grouping: Grouping | str = "contiguous"
    allow_pickle: bool = False
    compact: bool = True
    progress: bool = False
    weigh_values: bool = True
    autocast: torch.dtype | None = None
    weighted_aside: bool = False


@torch.inference_mode()
def collect(
    source: Path | Checkpoint,
    groups: int | tuple[int, ...] | None,
    text: CalibrationText,
    options: PassOptions = PassOptions(),
    on_layer=None,
) -> CalibrationStats:
    """Gather :class:`CalibrationStats` for merging into ``groups`` KV heads (one count, one per layer,
    or None: nothing kept) from ``text``, layer by layer (the module doc), as ``options`` say. Per-
    layer counts and ``grouping="similarity"`` gather each layer over all source heads first, then
    cut it into its groups (similarity: the least-residual groups, recorded as ``perm``);
    ``compact`` keeps only what the merges read. ``on_layer(layer, full, run)`` sees each layer's
    all-heads statistics and the loaded layer (:class:`LayerRun`) before they are cut.
    ``weigh_values``: record each layer's output-projection Gram (``svd`` then picks the value code
    that loses least through ``o_proj``; without: the values' principal subspace;
    ``weighted_aside``: that code kept beside it, :meth:`CalibrationStats.weighted`); ``autocast``:
    the dtype the layers run under. Every process of a launcher must call it (:func:`_start`)."""
    from mha2gqa.core.capture import capturing
    from mha2gqa.core.progress import bar as progress_bar

    o = options
    ckpt, model, dims, windows, states, dev, team = _start(source, o.device, o.allow_pickle, text)
    grouping = get_grouping(o.grouping) if isinstance(o.grouping, str) else o.grouping
    per_layer = groups if isinstance(groups, tuple) else None
    stats = CalibrationStats(max(per_layer) if per_layer else groups or 1, dims.head_dim, dims.rotary, source=text.data)
    split = grouping.reorders or per_layer is not None or on_layer is not None
    full = CalibrationStats(1, dims.head_dim, dims.rotary) if split else stats
    o_proj = _output_projection(ckpt) if o.weigh_values or o.weighted_aside else None
    desc, quiet = f"calibrating {dims.num_layers} layers on {windows.numel():,} tokens", not o.progress or not team.main
    bar = progress_bar(total=dims.num_layers * len(states), unit="window", desc=desc, disable=quiet)
    recording = [True]  # off while a cost runs a layer again with merged weights

    def record(call):
        if recording[0]:
            accumulate(full, call.layer, call.q, call.k, call.v)

    with capturing(model, record), bar:
        for i, layer, prefix in each_layer(model, ckpt, dev, dtype=None):  # as stored, run in float32
            inputs = [h for h, _ in states] if on_layer is not None else None
            _advance(layer, states, bar, o.autocast)
            _gathered(full, i, team, ckpt, o_proj, dims, plain=not o.weigh_values)
            if on_layer is not None:  # before the weights go: a cost may run the layer again
                recording[0] = False
                with float32_on_call(layer):
                    on_layer(i, full.layers[i], LayerRun(layer, inputs, states, prefix, team))
                recording[0] = True
            _keep(i, full, stats, per_layer[i] if per_layer else groups, grouping, dims, o.compact)
    stats.tokens = windows.numel()
    return stats


def _keep(i: int, full, stats, g: int | None, grouping: Grouping, dims, compact: bool) -> None:
    """Layer ``i`` gathered: where it was gathered over all source heads (``full``), cut into its
    ``g`` groups (None: drop it); keep only the blocks the merges read (``compact``)."""
    if full is not stats:
        layer_full = full.layers.pop(i)
        if g is None:
            return
        stats.layers[i] = _grouped(layer_full, g, grouping, dims)
    if compact:
        stats.layers[i].compact(dims.head_dim, dims.head_dim - dims.rotary)


def _start(source, device: str, allow_pickle: bool, text: CalibrationText):
    """The checkpoint, its model on ``meta``, its dimensions, the calibration windows ``[n, T]``, what
    the first decoder layer receives for this process's windows, the device, and the processes
    (:class:`Ranks`). Under a launcher (``torchrun``) each process reads its share of the windows and
    the sums are added at each layer's end (:func:`_gathered`), so every process must call it (a cost
    that runs each layer again runs it on the same share, and sums over the processes:
    :class:`~mha2gqa.convert.engine.layers.LayerRun`)."""
    from mha2gqa.core.architecture import dims_of
    from mha2gqa.core.checkpoint import open_checkpoint
    from mha2gqa.core.models import resolve_device

    dev = resolve_device(device)  # (forms the processes' group under a launcher)
    ckpt = source if isinstance(source, Checkpoint) else open_checkpoint(str(source), allow_pickle=allow_pickle)
    model = skeleton(ckpt)
    dims = dims_of(model.config)
    seq_len = calibration_window(text.seq_len, max_positions(model.config))
    windows = calibration_ids(ckpt.folder, text.data, text.tokens, seq_len, text.text_field).to(dev)
    team = ranks()
    states = first_layer_inputs(model, ckpt, team.share(windows, f"--calibration {text.data}"), dev)
    return ckpt, model, dims, windows, states, dev, team


def _output_projection(ckpt: Checkpoint) -> str:
    """The name of each layer's output projection weight (``{layer}`` to fill)."""
    from mha2gqa.core.families import find_family

    return find_family(ckpt.config).o_proj + ".weight"


def _gathered(
    full: CalibrationStats, i: int, team: Ranks, ckpt: Checkpoint, o_proj: str | None, dims, plain: bool
) -> None:
    """Layer ``i`` read by every process: its sums added over the processes, and its output
    projection's Gram (``o_proj``, ``{layer}`` to fill: how each value direction reaches the output;
    ``plain``: kept aside, the code staying the principal subspace)."""
    if team.size > 1:
        _summed(full.layers[i], team)
    if o_proj is not None and i in full.layers:
        full.layers[i].o_gram = _output_gram(ckpt, o_proj.format(layer=i), dims)
        full.layers[i].plain_code = plain


def _summed(entry: LayerStats, team: Ranks) -> None:
    """One layer's sums (second moments, energies, tokens) added over every process, in place."""
    for total in entry.sums():
        team.sum(total)
    entry.tokens = int(team.sum(torch.tensor(entry.tokens, dtype=torch.int64)))


def _advance(
    layer: torch.nn.Module, states: list[tuple[torch.Tensor, dict]], bar, autocast: torch.dtype | None = None
) -> None:
    """Replace every window's hidden states ``[1, T, hidden]`` by ``layer``'s output on them (each
    module in float32 only while it runs, under ``autocast`` where given; the states stay float32),
    one progress tick a window."""
    device = states[0][0].device.type if states else "cpu"
    with float32_on_call(layer), torch.autocast(device, dtype=autocast, enabled=autocast is not None):
        for n, (h, kw) in enumerate(states):
            check_signals()
            out = layer(h, **kw)
            states[n] = ((out[0] if isinstance(out, tuple) else out).float(), kw)
            bar.update(1)


def _output_gram(ckpt: Checkpoint, name: str, dims) -> torch.Tensor | None:
    """Each query head's ``O_h^T O_h`` from the output projection ``name`` (None when the checkpoint
    has no such tensor)."""
    return output_gram(ckpt.load(name), dims.num_heads, dims.head_dim) if name in ckpt.tensors else None


def _grouped(full: LayerStats, groups: int, grouping: Grouping, dims) -> LayerStats:
    """One layer's statistics over all source KV heads cut into the ``groups`` groups ``grouping`` chooses."""
    return regroup(full, grouping.choose(full, groups), dims.num_heads)
