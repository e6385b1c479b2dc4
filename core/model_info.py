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

#: Fields a description leaves out when they are None (a model that has none of them).
_OPTIONAL = ("kv_heads_per_layer", "config_sha256", "conversion", "uptrain_outcome")


@dataclass
class ModelInfo:
    """One evaluated model: what it is and its KV cache per token in the evaluated dtype."""

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
    kv_heads_per_layer: list[int] | None = None  # a per-layer checkpoint's count of each layer

    def __post_init__(self) -> None:
        if self.kv_cache_bytes_per_token is None:  # files from before the field was recorded
            dims = AttentionDims(self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim, 0)
            self.kv_cache_bytes_per_token = dims.kv_cache_bytes_per_token(None, by_name(self.dtype).bytes)

    @property
    def recipe(self) -> str:
        """The conversion's recipe (:attr:`Facts.recipe`), ``+uptrain`` when the model was uptrained
        after it (``+uptrain(undone)``: the guard published the model as it was before; ``+uptrain(in
        part)``: an earlier step's); empty for a model that was not converted."""
        recipe = self.conversion.recipe if self.conversion else ""
        return recipe + stage_name("uptrain", self.uptrain_outcome) if recipe and self.uptrained else recipe

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if self.conversion is not None:
            data["conversion"] = self.conversion.to_dict()
            data["recipe"] = self.recipe  # for readers of the JSON; recomputed from the record when read
        return {k: v for k, v in data.items() if not (k in _OPTIONAL and v is None)}
