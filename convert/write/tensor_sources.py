"""Which output tensor comes from where: every tensor of the converted checkpoint, decided before
anything is written. Untouched tensors are byte copies; the method's tensors are computed one at a
time when the writer reaches them, so memory stays at about one layer's attention weights."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch

from mha2gqa.convert.methods import HeadShape, Method
from mha2gqa.convert.methods.fresh import fresh_tensor
from mha2gqa.convert.methods.pooling import Reducer, reduce_rows, reduce_stacked
from mha2gqa.convert.write.shard_writer import OutputTensor
from mha2gqa.core.checkpoint import Checkpoint
from mha2gqa.core.conversion_record import FRESH, POOL, REWRITE, LayerPlan
from mha2gqa.core.dims import AttentionDims
from mha2gqa.core.dtypes import from_torch
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.families import Family
from mha2gqa.core.layer_tensors import LayerTensors, norm_names
from mha2gqa.core.safetensors_io import TensorInfo

SUFFIXES = (".weight", ".bias")


class LayerMerge:
    """Computes one layer's merged q/k/v/o (a ``layer`` method, or any method under similarity
    grouping), hands the tensors out one by one and forgets them as they are written; a tensor asked
    for again (the stage guard reads the merge before the writer does) is computed again."""

    def __init__(
        self, ckpt: Checkpoint, family: Family, dims: AttentionDims, plan: LayerPlan, stats: Any, method: Method
    ) -> None:
        self.ckpt, self.dims, self.plan, self.groups = ckpt, dims, plan, plan.kv_heads_after
        self.layer, self.stats, self.method = plan.layer, stats, method
        self.tensors = LayerTensors.of(ckpt.tensors, family, plan.layer, dims.num_heads, dims.head_dim)
        self.ready: dict[str, torch.Tensor] | None = None

    def names(self) -> Mapping[str, str]:
        """Role (``q``, ``k_bias``, ``qkv``...) -> tensor name, for this layer's tensors that exist."""
        return self.tensors.names

    def get(self, name: str) -> torch.Tensor:
        if self.ready is None or name not in self.ready:  # first asked, or again (the stage guard, then the writer)
            self.ready = self._compute()
        return self.ready.pop(name)

    def _compute(self) -> dict[str, torch.Tensor]:
        from mha2gqa.convert.methods.aligned import weight_stats
        from mha2gqa.convert.methods.layer import permute_heads

        dims, lt = self.dims, self.tensors
        dtypes: dict[str, torch.dtype] = {}

        def load(name: str) -> torch.Tensor:  # float32 maths; the statistics stay float64
            stored = self.ckpt.load(name)
            dtypes[name] = stored.dtype
            return stored.float()

        w = lt.read(load, dims.num_kv_heads)
        shape = HeadShape.of(dims, self.groups)
        # a layer method without calibration (aligned): statistics from the weights alone
        layer_stats = weight_stats(w, shape=shape) if self.stats is None else self.stats.layers[self.layer]
        if self.plan.permutation is not None:  # similarity grouping: similar heads made contiguous
            w = permute_heads(w, list(self.plan.permutation), dims.num_heads, dims.head_dim)
        merged = self.method.merge_layer(w, layer_stats, shape=shape)
        return {name: t.to(dtypes[name]) for name, t in lt.named(merged, self.groups).items()}


class _Sources:
    """The rules of one conversion: output tensor name -> how it is made."""

    def __init__(
        self,
        ckpt: Checkpoint,
        family: Family,
        dims: AttentionDims,
        plans: tuple[LayerPlan, ...],
        method: Method,
        stats: Any,
        seed: int,
    ) -> None:
        self.ckpt, self.family, self.dims, self.plans = ckpt, family, dims, plans
        self.method, self.stats, self.seed = method, stats, seed
        self.std = float(ckpt.config.get("initializer_range", 0.02))
        self.rules: dict[str, OutputTensor] = {}
        self.dropped: set[str] = set()

    def need(self, name: str, rows: int) -> TensorInfo:
        """The source tensor ``name``, whose rows must be ``rows`` (as the config implies)."""
        info = self.ckpt.tensors[name]
        if info.shape[0] != rows:
            raise Mha2GqaError(
                f"{name} has {info.shape[0]} rows, but the config implies {rows} ({self.dims.num_kv_heads} KV heads "
                f"x head_dim {self.dims.head_dim} in the K/V part); check head_dim in config.json"
            )
        return info

    def computed(self, name: str, shape: tuple[int, ...], produce) -> None:
        self.rules[name] = OutputTensor(name, self.ckpt.tensors[name].dtype, shape, produce)

    def fresh(self, name: str, shape: tuple[int, ...], kind: str) -> None:
        tensor_seed = self.seed * 1_000_003 + int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
        self.computed(
            name, shape, partial(fresh_tensor, shape, self.ckpt.tensors[name].dtype, kind, self.std, tensor_seed)
        )

    def layer_merge(self, layer: int) -> None:
        """q/k/v/o of ``layer`` merged together."""
        d, kv, g = self.dims.head_dim, self.dims.num_kv_heads, self.plans[layer].kv_heads_after
        merge = LayerMerge(self.ckpt, self.family, self.dims, self.plans[layer], self.stats, self.method)
        for role, name in merge.names().items():
            rows = self.ckpt.tensors[name].shape[0]
            if role in ("k", "k_bias", "v", "v_bias"):
                rows = self.need(name, kv * d).shape[0] // kv * g
            elif role.startswith("qkv"):
                self.need(name, (self.dims.num_heads + 2 * kv) * d)
                rows = (self.dims.num_heads + 2 * g) * d
            self.computed(name, (rows, *self.ckpt.tensors[name].shape[1:]), partial(merge.get, name))

    def projections(self, layer: int, reducer: Reducer | None) -> None:
        """K/V (or the fused qkv) of ``layer`` pooled by ``reducer``, or fresh when it is None."""
        d, kv, g, dims = self.dims.head_dim, self.dims.num_kv_heads, self.plans[layer].kv_heads_after, self.dims
        fam = self.family
        for module in (fam.qkv_proj,) if fam.fused else (fam.k_proj, fam.v_proj):
            for suffix in SUFFIXES:
                name = module.format(layer=layer) + suffix
                if name not in self.ckpt.tensors:
                    continue
                if fam.fused:
                    info = self.need(name, (dims.num_heads + 2 * kv) * d)
                    shape = ((dims.num_heads + 2 * g) * d, *info.shape[1:])
                    self.computed(name, shape, partial(self._fused, name, reducer, self.seed + layer * 7919, layer, g))
                elif reducer is None:
                    self.fresh(name, (g * d, *self.need(name, kv * d).shape[1:]), suffix[1:])
                else:
                    shape = (g * d, *self.need(name, kv * d).shape[1:])
                    self.computed(name, shape, partial(self._pooled, name, reducer, g))

    def k_norms(self, layer: int, reducer: Reducer | None) -> None:
        """Per-head key norms of ``layer`` (``rows`` or ``indexed`` layout) pooled, or fresh."""
        norm, d, kv = self.family.k_norm, self.dims.head_dim, self.dims.num_kv_heads
        g = self.plans[layer].kv_heads_after
        names = norm_names(self.family, layer, self.dims.num_heads, kv).get("k_norm", [])
        if norm is not None and norm.layout == "rows":
            name = names[0]
            if name in self.ckpt.tensors:
                self.need(name, kv * d)
                if reducer is None:
                    self.fresh(name, (g * d,), "norm")
                else:
                    self.computed(name, (g * d,), partial(self._pooled, name, reducer, g))
        elif norm is not None and norm.layout == "indexed" and all(n in self.ckpt.tensors for n in names):
            self.dropped.update(names[g:])
            for h in range(g):
                shape = self.ckpt.tensors[names[h]].shape
                if reducer is None:
                    self.fresh(names[h], shape, "norm")
                else:
                    self.computed(names[h], shape, partial(self._pooled_indexed, names, h, reducer, g))

    def _pooled(self, name: str, reducer: Reducer, g: int) -> torch.Tensor:
        return reduce_rows(self.ckpt.load(name), g, self.dims.head_dim, reducer)

    def _fused(self, name: str, reducer: Reducer | None, seed: int, layer: int, g: int) -> torch.Tensor:
        """The fused qkv tensor ``name`` of ``layer`` with its q rows kept and its K/V rows pooled by
        ``reducer`` to ``g`` heads (fresh when it is None, as :func:`fresh_tensor` makes them)."""
        dims = self.dims
        lt = LayerTensors.of(self.ckpt.tensors, self.family, layer, dims.num_heads, dims.head_dim)
        q, k, v = lt.split_one(name, self.ckpt.load(name), dims.num_kv_heads)
        if reducer is None:
            shape, dtype = (g * dims.head_dim, *k.shape[1:]), from_torch(k.dtype).code
            kind = "weight" if name.endswith(".weight") else "bias"
            k, v = (fresh_tensor(shape, dtype, kind, self.std, seed + i) for i in range(2))
        else:
            k, v = reduce_rows(k, g, dims.head_dim, reducer), reduce_rows(v, g, dims.head_dim, reducer)
        return lt.join_one(q, k, v, g)

    def _pooled_indexed(self, names: list[str], head: int, reducer: Reducer, g: int) -> torch.Tensor:
        per = len(names) // g
        members = names[head * per : (head + 1) * per]
        return reduce_stacked([self.ckpt.load(n) for n in members], 1, reducer)[0]

    def outputs(self) -> list[OutputTensor]:
        """Every output tensor in source storage order: a rule, else a copy."""
        out: list[OutputTensor] = []
        for info in sorted(self.ckpt.tensors.values(), key=lambda t: (str(t.file), t.start or 0, t.name)):
            if info.name in self.dropped:
                continue
            if info.name in self.rules:
                out.append(self.rules[info.name])
            elif self.ckpt.format == "safetensors":
                out.append(OutputTensor(info.name, info.dtype, info.shape, info, copy=True))
            else:
                out.append(
                    OutputTensor(info.name, info.dtype, info.shape, partial(self.ckpt.load, info.name), copy=True)
                )
        return out


def tensor_sources(
    ckpt: Checkpoint, family: Family, dims: AttentionDims, plans: tuple[LayerPlan, ...], method: Method,
    stats: Any = None, seed: int = 0,
) -> list[OutputTensor]:  # fmt: skip
    """Every output tensor, in source storage order, as each layer's plan says
    (:func:`~mha2gqa.convert.plan.layer_plan.layer_plans`): byte copies except what ``method`` changes
    (K/V pooled or drawn anew; Q, K, V and O rewritten together for ``layer`` methods and under
    similarity grouping, from the calibration ``stats``).

    Tensor shapes (head_dim x KV heads rows) are checked here, so a wrong config fails before
    anything is written. A layer keeping its current count is an exact copy."""
    sources = _Sources(ckpt, family, dims, plans, method, stats, seed)
    for plan in plans:
        if plan.how == REWRITE:  # q/o move too
            sources.layer_merge(plan.layer)
        elif plan.how in (POOL, FRESH):
            reducer = method.reduce if plan.how == POOL else None
            sources.projections(plan.layer, reducer)
            sources.k_norms(plan.layer, reducer)
    return sources.outputs()


def rewritten(outputs: list[OutputTensor], family: Family) -> list[str]:
    """The tensors a conversion computes (everything else is copied), named by the family's
    templates (``model.layers.{layer}.self_attn.k_proj.weight``...); a name no template covers is
    listed as it is."""
    templates = [f"{m}{s}" for m in family.modules() for s in SUFFIXES]
    templates += [n.name for n in (family.q_norm, family.k_norm) if n]
    patterns = [
        (re.compile(re.escape(t).replace(r"\{layer\}", r"\d+").replace(r"\{head\}", r"\d+") + "$"), t)
        for t in templates
    ]
    out = set()
    for tensor in outputs:
        if not tensor.copy:
            out.add(next((t for regex, t in patterns if regex.match(tensor.name)), tensor.name))
    return sorted(out)
