"""The calibration engine: the original model reads calibration text layer by layer, streamed from its
shards, while :func:`mha2gqa.core.capture.capturing` hands every layer's attention inputs to the
statistics (:mod:`mha2gqa.convert.calibration.stats`). Memory: one layer plus the calibration
activations, never the whole model."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from mha2gqa.convert.calibration.grouping import least_residual_groups, regroup
from mha2gqa.convert.calibration.stats import CalibrationStats, LayerStats, accumulate, output_gram
from mha2gqa.convert.settings import calibration_window
from mha2gqa.core.checkpoint import Checkpoint
from mha2gqa.core.dims import contiguous_groups
from mha2gqa.core.errors import SettingError
from mha2gqa.core.memory import trim
from mha2gqa.core.signals import check as check_signals


@dataclass
class LayerRun:
    """One decoder layer while its weights are loaded: the module, the calibration windows it read
    (``inputs``) and what it gave (``outputs``, with each window's keyword arguments), and the name
    prefix of its tensors (``model.layers.3.``)."""

    module: torch.nn.Module
    inputs: list[torch.Tensor]
    outputs: list[tuple[torch.Tensor, dict]]
    prefix: str


class _Stop(Exception):
    """Raised by the stand-in first layer once it has seen its inputs."""


class _Catch(torch.nn.Module):
    """Stands in for the decoder layers: records the inputs of the first one, then stops."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.Tensor, dict]] = []

    def forward(self, hidden_states, *args, **kwargs):
        if any(a is not None for a in args):  # GPTBigCode passes encoder_hidden_states=None by position
            raise RuntimeError("decoder layers are expected to be called with keyword arguments")
        self.calls.append((hidden_states, kwargs))
        raise _Stop


def materialize(
    module: torch.nn.Module, ckpt, prefix: str, device: torch.device, dtype: torch.dtype | None = torch.float32
) -> None:
    """Give ``module``'s parameters (on ``meta``) their weights from the checkpoint on ``device``, in
    ``dtype`` (None: as stored); its buffers (real, computed at construction) move along."""
    from accelerate.utils import set_module_tensor_to_device

    for name, _ in module.named_parameters():
        value = ckpt.load(prefix + name)
        value = value if dtype is None else value.to(dtype=dtype)
        set_module_tensor_to_device(module, name, device, value=value, dtype=value.dtype)  # else it casts back
    for name, _ in module.named_buffers():
        set_module_tensor_to_device(module, name, device)


@contextlib.contextmanager
def _float32_on_call(layer: torch.nn.Module):
    """Run ``layer`` in float32 while its weights stay in their stored dtype: each submodule's own
    parameters are upcast just before it runs and given back after, so a bf16 layer costs its bf16
    size plus one float32 module (the largest projection) instead of twice its size. The values
    are those of a float32 copy (bf16 -> fp32 is exact), so the outputs are too."""
    stored: dict[torch.nn.Module, dict[str, torch.Tensor]] = {}

    def up(module, args):
        own = dict(module.named_parameters(recurse=False))
        stored[module] = {n: p.data for n, p in own.items()}
        for p in own.values():
            p.data = p.data.float()

    def down(module, args, output):
        for n, p in module.named_parameters(recurse=False):
            p.data = stored[module][n]
        del stored[module]

    handles = []
    for m in layer.modules():
        own = list(m.parameters(recurse=False))
        if own and any(p.dtype != torch.float32 for p in own):
            handles += [m.register_forward_pre_hook(up), m.register_forward_hook(down)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def release(module: torch.nn.Module) -> None:
    """Send ``module``'s parameters back to ``meta`` and hand the freed memory back to the OS
    (glibc keeps freed heap pages otherwise, and RSS would creep up layer after layer)."""
    from accelerate.utils import set_module_tensor_to_device

    for name, _ in module.named_parameters():
        set_module_tensor_to_device(module, name, "meta")
    trim()


def calibration_ids(model_dir: Path, data: str, tokens: int, seq_len: int, text_field: str = "text") -> torch.Tensor:
    """``[windows, seq_len]``: the first ``tokens`` tokens of ``data`` as disjoint windows."""
    from mha2gqa.core.models import load_tokenizer
    from mha2gqa.core.text import load_text, token_stream

    ids = token_stream(load_tokenizer(model_dir), load_text(data, text_field, setting="calibration"), tokens)
    if ids.numel() < seq_len:
        raise SettingError("calibration", f"{{name}} {data}: {ids.numel()} tokens, fewer than one window of {seq_len}")
    n = ids.numel() // seq_len
    if n * seq_len < tokens:
        sys.stderr.write(
            f"warning: --calibration {data} gives {n * seq_len:,} tokens ({n} windows of {seq_len}) of the "
            f"{tokens:,} asked for: give more text, or lower --calibration-tokens to silence this\n"
        )
    return ids[: n * seq_len].reshape(n, seq_len)


def skeleton(ckpt):
    """The model of ``ckpt`` with its parameters on ``meta`` (buffers such as RoPE tables real); a
    re-targeted checkpoint's is the target class."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    if ckpt.format == "retargeted":
        config = AutoConfig.for_model(**ckpt.config)
    else:
        config = AutoConfig.from_pretrained(ckpt.folder)
    config.use_cache = False
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config).eval()


def first_layer_inputs(model, ckpt, windows: torch.Tensor, device) -> list[tuple[torch.Tensor, dict]]:
    """Run everything before the decoder layers once per window (embeddings as stored: a lookup
    loses nothing) and catch what the first layer receives, GPTQ-style; hidden states and RoPE
    tables in float32."""
    from mha2gqa.core.capture import decoder_layers

    base = model.base_model
    prefix = f"{model.base_model_prefix}."
    layers, attr = decoder_layers(model)
    others = [(n, c) for n, c in base.named_children() if n != attr]
    for name, child in others:
        materialize(child, ckpt, f"{prefix}{name}.", device, dtype=None)
    catcher = _Catch()
    setattr(base, attr, torch.nn.ModuleList([catcher]))
    try:
        for w in windows:
            with contextlib.suppress(_Stop):
                base(w[None], use_cache=False)
    finally:
        setattr(base, attr, layers)
    for _, child in others:
        release(child)
    states = []
    for h, kw in catcher.calls:
        h = h.float()
        if "position_embeddings" in kw and kw.get("position_ids") is not None:
            kw = {**kw, "position_embeddings": base.rotary_emb(h, kw["position_ids"])}
        states.append((h, kw))
    return states


@torch.inference_mode()
def collect(
    source: Path | Checkpoint,
    groups: int | tuple[int, ...] | None,
    data: str,
    tokens: int,
    seq_len: int | None = None,
    device: str = "auto",
    text_field: str = "text",
    grouping: str = "contiguous",
    allow_pickle: bool = False,
    compact: bool = True,
    progress: bool = False,
    on_layer=None,
    weigh_values: bool = True,
) -> CalibrationStats:
    """Gather :class:`CalibrationStats` for merging into ``groups`` KV heads from the first
    ``tokens`` tokens of ``data`` (disjoint windows of ``seq_len``), streaming the model (a folder,
    or an opened checkpoint such as a re-targeted one) layer by layer from its shards: the model is
    built on ``meta``; the embeddings run once (the inputs of the first decoder layer are caught),
    then each decoder layer in turn gets its weights, processes every window and is emptied again.
    Memory: one layer plus the calibration activations (``tokens x hidden``, float32), never the
    whole model.

    With ``grouping="similarity"`` each layer's statistics are first gathered over all source KV
    heads, which then form the equal groups that lose least in the merge
    (:func:`~mha2gqa.convert.calibration.grouping.least_residual_groups`), recorded as ``perm`` on
    the layer's statistics. ``groups`` may give each layer its own count (a per-layer conversion):
    the statistics are then gathered over all source heads too and cut into that layer's groups.
    With ``compact`` (the default) each finished layer keeps only what the merges read
    (:meth:`LayerStats.compact`). ``on_layer(layer, full, run)`` sees each layer's statistics over
    all source heads as one group, and the layer itself with its inputs and outputs
    (:class:`LayerRun`), before they are cut (with ``groups=None``, nothing is kept). With
    ``weigh_values`` each layer's output-projection Gram is recorded too, so that ``svd`` chooses the
    value code that loses least as ``o_proj`` passes it on (without: the values' principal
    subspace, the better start for a refit)."""
    from mha2gqa.core.architecture import dims_of
    from mha2gqa.core.capture import capturing, decoder_layers
    from mha2gqa.core.checkpoint import open_checkpoint
    from mha2gqa.core.families import find_family
    from mha2gqa.core.models import resolve_device
    from mha2gqa.core.progress import bar as progress_bar

    dev = resolve_device(device)
    ckpt = source if isinstance(source, Checkpoint) else open_checkpoint(str(source), allow_pickle=allow_pickle)
    model_dir = ckpt.folder
    model = skeleton(ckpt)
    dims = dims_of(model.config)
    seq_len = calibration_window(seq_len, getattr(model.config, "max_position_embeddings", None))
    windows = calibration_ids(model_dir, data, tokens, seq_len, text_field).to(dev)
    states = first_layer_inputs(model, ckpt, windows, dev)
    per_layer = groups if isinstance(groups, tuple) else None
    keep = groups is not None
    stats = CalibrationStats(max(per_layer) if per_layer else groups or 1, dims.head_dim, dims.rotary, source=data)
    split = grouping == "similarity" or per_layer is not None or on_layer is not None
    full = CalibrationStats(1, dims.head_dim, dims.rotary) if split else stats
    layers, attr = decoder_layers(model)
    prefix = f"{model.base_model_prefix}.{attr}."
    family = find_family(ckpt.config) if weigh_values else None
    o_proj = family.o_proj + ".weight" if family is not None else None  # {layer} to fill
    desc = f"calibrating {len(layers)} layers on {windows.numel():,} tokens"
    bar = progress_bar(total=len(layers) * len(states), unit="window", desc=desc, disable=not progress)
    recording = [True]  # off while a cost runs a layer again with merged weights

    def record(layer, q, k, v, *_):
        if recording[0]:
            accumulate(full, layer, q, k, v)

    with capturing(model, record), bar:
        for i, layer in enumerate(layers):
            materialize(layer, ckpt, f"{prefix}{i}.", dev, dtype=None)  # as stored, run in float32
            inputs = [h for h, _ in states] if on_layer is not None else None
            _advance(layer, states, bar)
            if o_proj is not None and i in full.layers:  # how each value direction reaches the output
                full.layers[i].o_gram = _output_gram(ckpt, o_proj.format(layer=i), dims)
            if on_layer is not None:  # before the weights go: a cost may run the layer again
                recording[0] = False
                with _float32_on_call(layer):
                    on_layer(i, full.layers[i], LayerRun(layer, inputs, states, f"{prefix}{i}."))
                recording[0] = True
            release(layer)
            if full is not stats:  # choose this layer's groups, keep only their blocks
                layer_full = full.layers.pop(i)
                if not keep:
                    continue
                g = per_layer[i] if per_layer else groups
                stats.layers[i] = _grouped(layer_full, g, grouping, dims)
            if compact:
                stats.layers[i].compact(dims.head_dim, dims.head_dim - dims.rotary)
    stats.tokens = windows.numel()
    return stats


def _advance(layer: torch.nn.Module, states: list[tuple[torch.Tensor, dict]], bar) -> None:
    """Replace every window's hidden states ``[1, T, hidden]`` by ``layer``'s output on them (each
    module in float32 only while it runs), one progress tick a window."""
    with _float32_on_call(layer):
        for n, (h, kw) in enumerate(states):
            check_signals()
            out = layer(h, **kw)
            states[n] = (out[0] if isinstance(out, tuple) else out, kw)
            bar.update(1)


def _output_gram(ckpt: Checkpoint, name: str, dims) -> torch.Tensor | None:
    """Each query head's ``O_h^T O_h`` from the output projection ``name`` (None when the checkpoint
    has no such tensor)."""
    return output_gram(ckpt.load(name), dims.num_heads, dims.head_dim) if name in ckpt.tensors else None


def _grouped(full: LayerStats, groups: int, grouping: str, dims) -> LayerStats:
    """One layer's statistics over all source KV heads cut into ``groups`` groups: the ones that lose
    least in the merge (``similarity``) or consecutive heads."""
    if grouping == "similarity":
        chosen = least_residual_groups(full, groups)
    else:
        chosen = contiguous_groups(dims.num_kv_heads, groups)
    return regroup(full, chosen, dims.num_heads)
