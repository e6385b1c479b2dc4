"""The conversion methods, one object each: what it is called, whether it needs calibration, which
projections it rewrites, which families it supports and where its merge lives. The converter, the
CLI's choices, job files, the conversion record and the model card all read :data:`METHODS` and
:data:`GROUPINGS`.

Importing this package imports no torch: a method's merge is imported when it runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mha2gqa.core.errors import SettingError
from mha2gqa.core.families import Family


@dataclass(frozen=True)
class Method:
    """One way of turning a layer's source KV heads into fewer."""

    name: str
    summary: str  # one line: what it does (help, model card)
    kind: str  # "pool": K/V pooled tensor by tensor; "fresh": K/V re-initialised; "layer": q/k/v/o merged together
    calibration: str  # "none", "optional" (better with it) or "required"
    rewrites: tuple[str, ...]  # projections it changes: "q", "k", "v", "o"
    merge: str  # "module:function" of its merge, imported on use
    per_head_norms: bool = True  # works on families that normalise q/k per head

    @property
    def layerwise(self) -> bool:
        return self.kind == "layer"

    def load(self) -> Callable[..., Any]:
        """The merge function (imported now)."""
        module, name = self.merge.split(":")
        return getattr(importlib.import_module(f"mha2gqa.convert.methods.{module}"), name)


@dataclass(frozen=True)
class Grouping:
    """Which source KV heads share a new KV head."""

    name: str
    summary: str
    calibration: str  # "none" or "required"
    reorders: bool  # realised by permuting query heads with their KV heads (rewrites q and o)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("mean", "the mean of each group's K/V heads (the GQA paper's conversion)", "pool", "none",
               ("k", "v"), "pooling:mean_heads"),
        Method("first", "the first K/V head of each group (the GQA paper's ablation)", "pool", "none",
               ("k", "v"), "pooling:first_heads"),
        Method("random", "fresh K/V projections as the model's own initialisation (seeded)", "fresh", "none",
               ("k", "v"), "fresh:fresh_tensor"),
        Method("svd", "activation-aware low-rank merge of each group, bases absorbed into q_proj/o_proj",
               "layer", "required", ("q", "k", "v", "o"), "svd:svd_merge_layer", per_head_norms=False),
        Method("aligned", "heads rotated onto each other (RoPE-compatible), then averaged; rotations absorbed "
               "into q_proj/o_proj", "layer", "optional", ("q", "k", "v", "o"), "aligned:aligned_merge_layer",
               per_head_norms=False),
    )
}  # fmt: skip

GROUPINGS: dict[str, Grouping] = {
    g.name: g
    for g in (
        Grouping("contiguous", "transformers' repeat_kv blocks: KV head j serves query heads [j*H/G, (j+1)*H/G)",
                 "none", False),
        Grouping("similarity", "equal groups of the heads that lose least when merged, per layer (calibrated)",
                 "required", True),
    )
}  # fmt: skip


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise SettingError("method", f"unknown {{name}} {name!r}: choose one of {', '.join(METHODS)}")
    return METHODS[name]


def get_grouping(name: str) -> Grouping:
    if name not in GROUPINGS:
        raise SettingError("grouping", f"unknown {{name}} {name!r}: choose one of {', '.join(GROUPINGS)}")
    return GROUPINGS[name]


def refusal(method: Method, grouping: Grouping, family: Family) -> str | None:
    """Why ``method`` with ``grouping`` cannot convert ``family`` (None: it can). Layer merges and
    regrouping need keys linear in the input and heads that can be reordered."""
    if (method.per_head_norms and not grouping.reorders) or (family.k_norm is None and family.q_norm is None):
        return None
    return (f"--method {method.name} / --grouping {grouping.name} need keys linear in the input and heads that "
            f"can be reordered, but {family.family} normalises q/k per head; use --method mean or first, "
            "contiguous")  # fmt: skip
