"""The conversion methods, one object each (mergekit's merge-method classes are the model): its name,
summary, calibration need, the projections it rewrites and the families it supports are data; its
merge is a method. The converter, the CLI's choices, job files, the conversion record and the model
card all read :data:`METHODS` and :data:`GROUPINGS`.

Importing this package imports no torch: a method's merge imports its module when it runs.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import Any, ClassVar

from mha2gqa.convert.plan.groupings import Grouping
from mha2gqa.core.dims import AttentionDims
from mha2gqa.core.errors import SettingError
from mha2gqa.core.families import Family

#: One layer's projections by role: ``q``, ``k``, ``v`` ``[heads*d, hidden]``, ``o`` ``[hidden, H*d]``
#: and optional ``q_bias``/``k_bias``/``v_bias`` (float32 or float64 tensors).
Layer = dict[str, Any]


@dataclass(frozen=True)
class HeadShape:
    """The heads of one layer's merge: ``num_heads`` query heads, ``num_kv_heads`` KV heads before,
    ``groups`` after, each ``head_dim`` wide with ``rotary_dim`` rotary dimensions."""

    num_heads: int
    num_kv_heads: int
    groups: int
    head_dim: int
    rotary_dim: int

    @classmethod
    def of(cls, dims: AttentionDims, groups: int) -> HeadShape:
        return cls(dims.num_heads, dims.num_kv_heads, groups, dims.head_dim, dims.rotary)

    @property
    def share(self) -> int:
        """Source KV heads per new KV head."""
        return self.num_kv_heads // self.groups


@dataclass(frozen=True)
class Method:
    """One way of turning a layer's source KV heads into fewer."""

    name: str
    summary: str  # one line: what it does (help, model card)
    calibration: str  # "none", "optional" (better with it) or "required"
    rewrites: tuple[str, ...]  # projections it changes: "q", "k", "v", "o"
    per_head_norms: bool = True  # works on families that normalise q/k per head

    #: q/k/v/o are merged together (otherwise K/V alone, tensor by tensor)
    layerwise: ClassVar[bool] = False
    #: K/V are made anew rather than from the source heads
    fresh: ClassVar[bool] = False
    #: its value code weighs each direction by how the output projection passes it on; a refit starts
    #: from the plain principal subspace instead, with this merge kept beside it for the stage guard
    weighs_values: ClassVar[bool] = False

    def merge_layer(self, w: Layer, stats: Any, *, shape: HeadShape) -> Layer:
        """One layer's projections (heads already permuted into their groups) merged to
        ``shape.groups`` KV heads; ``stats`` are the layer's calibration statistics."""
        raise NotImplementedError(f"--method {self.name} does not merge layers")

    def reduce(self, x: Any, groups: int) -> Any:
        """``[G_src, *per_head]`` -> ``[groups, *per_head]`` (float32): K/V pooled head by head."""
        raise NotImplementedError(f"--method {self.name} does not pool heads")


class _Pool(Method):
    """K/V pooled within each group; q/o kept (a layer merge only permutes them)."""

    def merge_layer(self, w: Layer, stats: Any, *, shape: HeadShape) -> Layer:
        from mha2gqa.convert.methods.layer import pool_merge_layer

        return pool_merge_layer(w, shape.groups, shape.head_dim, self.reduce)


class MeanPool(_Pool):
    def reduce(self, x: Any, groups: int) -> Any:
        from mha2gqa.convert.methods.pooling import mean_heads

        return mean_heads(x, groups)


class FirstHead(_Pool):
    def reduce(self, x: Any, groups: int) -> Any:
        from mha2gqa.convert.methods.pooling import first_heads

        return first_heads(x, groups)


class FreshInit(Method):
    """K/V re-initialised as the model's own initialisation would (seeded); nothing is merged."""

    fresh: ClassVar[bool] = True


class SvdMerge(Method):
    layerwise: ClassVar[bool] = True
    weighs_values: ClassVar[bool] = True

    def merge_layer(self, w: Layer, stats: Any, *, shape: HeadShape) -> Layer:
        from mha2gqa.convert.methods.svd import svd_merge_layer

        return svd_merge_layer(w, stats, shape=shape)


class AlignedMerge(Method):
    layerwise: ClassVar[bool] = True

    def merge_layer(self, w: Layer, stats: Any, *, shape: HeadShape) -> Layer:
        from mha2gqa.convert.methods.aligned import aligned_merge_layer

        return aligned_merge_layer(w, stats, shape=shape)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        MeanPool("mean", "the mean of each group's K/V heads (the GQA paper's conversion)", "none", ("k", "v")),
        FirstHead("first", "the first K/V head of each group (the GQA paper's ablation)", "none", ("k", "v")),
        FreshInit("random", "fresh K/V projections as the model's own initialisation (seeded)", "none", ("k", "v")),
        SvdMerge("svd", "activation-aware low-rank merge of each group, bases absorbed into q_proj/o_proj",
                 "required", ("q", "k", "v", "o"), per_head_norms=False),
        AlignedMerge("aligned", "heads rotated onto each other (RoPE-compatible), then averaged; rotations absorbed "
                     "into q_proj/o_proj", "optional", ("q", "k", "v", "o"), per_head_norms=False),
    )
}  # fmt: skip


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise SettingError("method", f"unknown {{name}} {name!r}: choose one of {', '.join(METHODS)}")
    return METHODS[name]


def incompatibility(
    method: Method, grouping: Grouping, family: Family, tensors: Container[str] | None = None
) -> str | None:
    """Why ``method`` with ``grouping`` cannot convert ``family`` (None: it can). Layer merges and
    regrouping need keys linear in the input and heads that can be reordered. ``tensors``: the
    checkpoint's names, where a config of the family may leave its per-head norms out (StableLM 2
    1.6B has none; its 12B has them); None: the family's norms are taken as present."""
    if method.per_head_norms and not grouping.reorders:
        return None
    norms = [n.name.format(layer=0, head=0) for n in (family.q_norm, family.k_norm) if n is not None]
    if not norms or (tensors is not None and not any(n in tensors for n in norms)):
        return None
    return (
        f"{{name}} {method.name} with {grouping.name} grouping needs keys linear in the input and heads that "
        f"can be reordered, but {family.family} normalises q/k per head; use --method mean or first, contiguous"
    )
