"""What an evaluated model is, as the results record it: shape, dtype, KV cache per token, hashes,
and its conversion record's facts. Written by :meth:`mha2gqa.core.models.LoadedModel.describe`, read
back (typed, validated) from results files and reference caches."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from mha2gqa.core.conversion_record import KEPT, KEPT_IN_PART, UNDONE, Facts, stage_name
from mha2gqa.core.dims import AttentionDims
from mha2gqa.core.dtypes import by_name
from mha2gqa.core.uptrain_guard import DISTILL_STAGE

#: Fields a description leaves out when they are None (a model that has none of them).
_OPTIONAL = (
    "kv_heads_per_layer", "config_sha256", "conversion", "uptrain_outcome", "uptrain_stage", "kv_cache_dtype",
    "cache_spans",
)  # fmt: skip


@dataclass
class ModelInfo:
    """One evaluated model: what it is, and its KV cache per token in the checkpoint's dtype
    (``kv_cache_dtype``, the one ``convert`` reports; results before it: the evaluated ``dtype``)."""

    path: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    architecture: str = ""
    parameters: int = 0
    max_positions: int | None = None
    kv_cache_bytes_per_token: int | None = None
    config_sha256: str | None = None
    conversion: Facts | None = None
    uptrained: bool = False
    #: ``uptrain --guard``'s decision on it (None: not uptrained, or not judged): an undone run
    #: published the student as given, "kept in part" an earlier step's model
    uptrain_outcome: Literal[KEPT, KEPT_IN_PART, UNDONE] | None = None
    #: which stage wrote its uptraining record: ``distill`` (``convert --distill``'s own run), None
    #: (``mha2gqa uptrain``, or not uptrained)
    uptrain_stage: Literal["distill"] | None = None
    kv_heads_per_layer: list[int] | None = None  # a per-layer checkpoint's count of each layer
    #: the checkpoint's dtype, in which the KV bytes are counted (None: results before it, the evaluated dtype)
    kv_cache_dtype: str | None = None
    #: per layer, the most tokens its cache holds (None: all): sliding windows (:mod:`~mha2gqa.core.cache_layers`)
    cache_spans: list[int | None] | None = None

    def __post_init__(self) -> None:
        if self.kv_cache_bytes_per_token is None:  # files from before the field was recorded
            self.kv_cache_bytes_per_token = self._dims().kv_cache_bytes_per_token(None, self.kv_element)

    def _dims(self) -> AttentionDims:
        per_layer = tuple(self.kv_heads_per_layer) if self.kv_heads_per_layer else None
        spans = tuple(self.cache_spans) if self.cache_spans and len(self.cache_spans) == self.num_layers else None
        return AttentionDims(
            self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim, 0,
            kv_heads_per_layer=per_layer, cache_spans=spans,
        )  # fmt: skip

    @property
    def kv_element(self) -> int:
        """Bytes of one KV element in the dtype the KV figures are counted in."""
        return by_name(self.kv_cache_dtype or self.dtype).bytes

    def kv_cache_bytes(self, tokens: int) -> int:
        """The KV cache one sequence of ``tokens`` tokens holds (sliding layers: their window)."""
        if not self.cache_spans:
            return self.kv_cache_bytes_per_token * tokens
        return self._dims().kv_cache_bytes(tokens, None, self.kv_element)

    @property
    def recipe(self) -> str:
        """The conversion's recipe (:attr:`Facts.recipe`), ``+uptrain`` when the model was uptrained
        after it (``+uptrain(undone)``: the guard published the model as it was before; ``+uptrain(in
        part)``: an earlier step's), ``+distill`` where the uptraining record is ``convert --distill``'s
        own (named there already where the stage guard judged it); empty for a model not converted."""
        recipe = self.conversion.recipe if self.conversion else ""
        if not recipe or not self.uptrained:
            return recipe
        if self.uptrain_stage == DISTILL_STAGE:
            return recipe if "+distill" in recipe else recipe + stage_name("distill", None)
        return recipe + stage_name("uptrain", self.uptrain_outcome)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if self.conversion is not None:
            data["conversion"] = self.conversion.to_dict()
            data["recipe"] = self.recipe  # for readers of the JSON; recomputed from the record when read
        return {k: v for k, v in data.items() if not (k in _OPTIONAL and v is None)}
