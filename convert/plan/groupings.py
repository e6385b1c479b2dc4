"""Groupings: which source KV heads share a new KV head. Objects behind one interface
(:meth:`Grouping.choose`), as methods are; torch-free to import (each ``choose`` imports what it
needs), read by calibration, the methods' registry and the allocation alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mha2gqa.core.errors import SettingError


@dataclass(frozen=True)
class Grouping:
    """Which source KV heads share a new KV head: :meth:`choose` picks a layer's groups."""

    name: str
    summary: str
    calibration: str  # "none" or "required"
    reorders: bool  # realised by permuting query heads with their KV heads (rewrites q and o)

    def choose(self, full: Any, groups: int) -> list[list[int]]:
        """The source KV heads of each of ``groups`` new heads, from a layer's statistics over all
        source heads ``full`` (:class:`~mha2gqa.convert.calibration.stats.LayerStats`)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Contiguous(Grouping):
    """transformers' ``repeat_kv`` blocks: new head ``j`` pools source heads ``[j*r, (j+1)*r)``."""

    def choose(self, full: Any, groups: int) -> list[list[int]]:
        from mha2gqa.core.dims import contiguous_groups

        return contiguous_groups(full.k_plane_gram.shape[-1], groups)


@dataclass(frozen=True)
class Similarity(Grouping):
    """Equal groups of the heads that lose least when merged, chosen per layer on calibration text."""

    def choose(self, full: Any, groups: int) -> list[list[int]]:
        from mha2gqa.convert.calibration.grouping import least_residual_groups

        return least_residual_groups(full, groups)


GROUPINGS: dict[str, Grouping] = {
    g.name: g
    for g in (
        Contiguous("contiguous", "transformers' repeat_kv blocks: KV head j serves query heads [j*H/G, (j+1)*H/G)",
                   "none", False),
        Similarity("similarity", "equal groups of the heads that lose least when merged, per layer (calibrated)",
                   "required", True),
    )
}  # fmt: skip


def get_grouping(name: str) -> Grouping:
    if name not in GROUPINGS:
        raise SettingError("grouping", f"unknown {{name}} {name!r}: choose one of {', '.join(GROUPINGS)}")
    return GROUPINGS[name]
