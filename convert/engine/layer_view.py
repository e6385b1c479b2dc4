"""A converted (GQA) decoder layer seen through its source (MHA) module: a GQA layer with ``G`` KV
heads computes exactly what the source layer computes with each new K/V head repeated over the
source heads it replaced. So any planned or written conversion of a layer runs as the source
layer class with these parameters (:func:`torch.func.functional_call`), for every family's own
attention, RoPE, biases and per-head norms as transformers wrote them: what the refit fits and the
stage guard (:mod:`mha2gqa.convert.guard`) scores."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Container, Iterator, Mapping

import torch

from mha2gqa.convert.methods import HeadShape
from mha2gqa.convert.write.shard_writer import OutputTensor
from mha2gqa.core.layer_tensors import LayerTensors

_SHAPED = ("k", "v", "k_bias", "v_bias")  # rows = KV heads x head_dim

#: a conversion's tensors by name: ``load(name)`` -> the output tensor (GQA shapes)
Loader = Callable[[str], torch.Tensor]


def repeat_heads(x: torch.Tensor, shape: HeadShape) -> torch.Tensor:
    """``[groups * d, ...]`` -> ``[num_kv_heads * d, ...]``: each KV head repeated over its group."""
    d = shape.head_dim
    return x.reshape(shape.groups, d, *x.shape[1:]).repeat_interleave(shape.share, 0).reshape(-1, *x.shape[1:])


class RepeatedHeads(torch.nn.Module):
    """A K or V projection with ``shape.groups`` heads whose output is each head repeated over its
    group: what the source layer's attention reads from a GQA projection, at the cost of the
    activations (``[B, T, num_kv_heads * d]``) rather than of a repeated weight."""

    def __init__(self, linear: torch.nn.Linear, shape: HeadShape) -> None:
        super().__init__()
        self.shape = shape
        rows = shape.groups * shape.head_dim
        self.weight = torch.nn.Parameter(torch.empty(rows, linear.in_features, device="meta"), requires_grad=False)
        has_bias = linear.bias is not None
        self.bias = torch.nn.Parameter(torch.empty(rows, device="meta"), requires_grad=False) if has_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x, self.weight, self.bias)
        heads = y.unflatten(-1, (self.shape.groups, self.shape.head_dim))
        return heads.repeat_interleave(self.shape.share, -2).flatten(-2)


class LayerWeights:
    """The projections of one converted layer by role (``q``, ``k``, ``v``, ``o`` and biases; a fused
    ``qkv`` split into its parts, :class:`LayerTensors`), float32, in the output's (GQA) shapes;
    :meth:`module_view` gives the source-shaped module's parameters, after :meth:`adapt` has fitted the
    module to read them."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], layout: LayerTensors, shape: HeadShape) -> None:
        self.layout, self.shape = layout, shape
        self.names = layout.names
        self.values = layout.read(lambda name: tensors[name].float(), shape.groups)
        self.repeated_outputs = False

    def adapt(self, layer: torch.nn.Module, prefix: str) -> None:
        """Give ``layer`` (the source layer class, weights loaded) K/V projections of the new head
        count that repeat their outputs (:class:`RepeatedHeads`), where they are separate linear
        modules; a fused projection keeps its module and gets repeated weights instead."""
        paths = [self.names[r][len(prefix) : -len(".weight")] for r in ("k", "v") if r in self.names]
        modules = [layer.get_submodule(p) for p in paths]
        if self.layout.family.fused or len(paths) != 2 or not all(type(m) is torch.nn.Linear for m in modules):
            return
        for path, module in zip(paths, modules, strict=True):
            parent, _, attr = path.rpartition(".")
            setattr(layer.get_submodule(parent) if parent else layer, attr, RepeatedHeads(module, self.shape))
        self.repeated_outputs = True

    def module_view(self, values: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
        """Module-relative parameter name (under ``prefix``) -> tensor, for the adapted layer."""
        shape = self.shape
        full = {
            role: repeat_heads(t, shape) if role in _SHAPED and not self.repeated_outputs else t
            for role, t in values.items()
        }
        kv_heads = shape.groups if self.repeated_outputs else shape.num_kv_heads
        return {name[len(prefix) :]: t for name, t in self.layout.named(full, kv_heads).items()}

    def outputs(self, values: Mapping[str, torch.Tensor], dtypes: Mapping[str, torch.dtype]) -> dict[str, torch.Tensor]:
        """Tensor name -> the tensor to write (output shapes, stored dtypes)."""
        named = self.layout.named(values, self.shape.groups)
        return {name: t.detach().to(dtypes[name]).contiguous() for name, t in named.items()}


def planned(tensors: Mapping[str, OutputTensor], ckpt) -> Loader:
    """The loader of a planned conversion: each output tensor's value (computed, or the source's
    when copied)."""

    def load(name: str) -> torch.Tensor:
        rule = tensors[name]
        return rule.source() if callable(rule.source) else ckpt.load(name)

    return load


def norm_overrides(family, load: Loader, names: Container[str], layer: int, shape: HeadShape, prefix: str):
    """The converted per-head key norm of ``layer`` (from ``load``, where its tensors are among
    ``names``) in the source module's shape (``rows``: each head's block repeated; ``indexed``:
    source head ``h`` reads new head ``h // share``), module-relative names under ``prefix``."""
    norm = family.k_norm
    if norm is None or norm.layout == "shared":
        return {}
    if norm.layout == "rows":
        name = norm.name.format(layer=layer)
        if name not in names:
            return {}
        return {name[len(prefix) :]: repeat_heads(load(name).float(), shape)}
    out = {}
    for h in range(shape.num_kv_heads):
        name = norm.name.format(layer=layer, head=h // shape.share)
        if name in names:
            out[norm.name.format(layer=layer, head=h)[len(prefix) :]] = load(name).float()
    return out


def source_view(
    load: Loader, names: Container[str], family, shape: HeadShape, layer: torch.nn.Module, index: int, prefix: str
) -> dict[str, torch.Tensor]:
    """Layer ``index``'s converted parameters (from ``load``, whose tensors are ``names``) as the
    source module ``layer`` (under ``prefix``) reads them, module-relative name -> float32 tensor on
    the layer's device: q/k/v/o by role (a fused qkv joined; K/V heads repeated over their groups),
    per-head key norms, and any other tensor of the layer ``names`` holds in the source's shape."""
    device = next(layer.parameters()).device
    layout = LayerTensors.of(names, family, index, shape.num_heads, shape.head_dim)
    roles = layout.names
    lw = LayerWeights({n: load(n).to(device) for n in roles.values()}, layout, shape)
    params = lw.module_view(lw.values, prefix)
    params |= {k: v.to(device) for k, v in norm_overrides(family, load, names, index, shape, prefix).items()}
    for local, p in layer.named_parameters():
        full = prefix + local
        if local not in params and full in names and full not in roles.values():
            t = load(full)
            if tuple(t.shape) == tuple(p.shape):
                params[local] = t.to(device, torch.float32)
    return params


@contextlib.contextmanager
def swapped(layer: torch.nn.Module, params: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """While in the block, ``layer``'s parameters named in ``params`` (module-relative) hold those
    values (in each parameter's own device and dtype); its own come back after."""
    saved = {}
    try:
        for name, value in params.items():
            parent, _, attr = name.rpartition(".")
            owner = layer.get_submodule(parent) if parent else layer
            old = owner._parameters[attr]
            saved[name] = (owner, attr, old)
            owner._parameters[attr] = torch.nn.Parameter(value.to(old.device, old.dtype), requires_grad=False)
        yield
    finally:
        for owner, attr, old in saved.values():
            owner._parameters[attr] = old
