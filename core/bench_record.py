"""The ``bench --output`` record: written by :mod:`mha2gqa.eval.bench`, read back by ``plan --bench``
(:mod:`mha2gqa.serving.capacity`), both through these types (the file's schema is
:data:`~mha2gqa.core.records.BENCH_SCHEMA`)."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.records import BENCH_SCHEMA
from mha2gqa.core.typed import RecordError, read

RERUN = "re-run `mha2gqa bench --output`"


@dataclass(frozen=True)
class Spread:
    """Median and range of repeated timings."""

    median: float
    min: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))


@dataclass(frozen=True)
class KvCache:
    """The KV cache measured after generation, and what the planner says it should be."""

    measured_bytes: int
    planned_bytes: int
    cached_tokens: int
    bytes_per_token: float
    dtype_bytes: int


@dataclass(frozen=True)
class BenchModel:
    """One model's figures: prefill seconds, decode tokens/s (over the batch), its KV cache."""

    num_kv_heads: int
    decode_tokens_per_second: Spread
    parameters: int | None = None
    prefill_seconds: Spread | None = None
    kv_cache: KvCache | None = None
    path: str | None = None


@dataclass(frozen=True)
class BenchRun:
    """The settings the figures were taken with (``device``/``dtype`` as resolved)."""

    prompt_len: int
    new_tokens: int
    batch_size: int
    repeats: int | None = None
    warmup: int | None = None
    device: str = ""
    dtype: str = ""
    device_name: str | None = None


@dataclass(frozen=True)
class Speedup:
    """A pair's converted model against its original."""

    decode_speedup: float
    kv_cache_ratio: float


@dataclass(frozen=True)
class BenchRecord:
    """A ``bench --output`` file: ``models`` maps ``original``/``converted`` to their figures."""

    settings: BenchRun
    models: dict[str, BenchModel] = field(default_factory=dict)
    converted_vs_original: Speedup | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"schema": BENCH_SCHEMA, **dataclasses.asdict(self)}

    @classmethod
    def load(cls, path: Path) -> BenchRecord:
        """The file at ``path``, every field checked (a damaged or foreign file is one line naming it)."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise Mha2GqaError(f"--bench {path}: not readable JSON ({e})") from None
        if not isinstance(data, dict) or data.get("schema") != BENCH_SCHEMA:
            raise Mha2GqaError(f"--bench {path}: not a `mha2gqa bench --output` file")
        try:
            record = read(cls, data, "bench")
        except RecordError as e:
            raise Mha2GqaError(f"--bench {path}: {str(e).removeprefix('bench.')}; {RERUN}") from None
        record._check(path)
        return record

    def _check(self, path: Path) -> None:
        """Values the types cannot say: positive lengths and figures, known model names."""
        if not self.models:
            raise Mha2GqaError(f"--bench {path}: it has no models; {RERUN}")
        if unknown := set(self.models) - {"original", "converted"}:
            raise Mha2GqaError(f"--bench {path}: models has entries {sorted(unknown)!r} besides original and converted")
        numbers = {f"settings.{k}": getattr(self.settings, k) for k in ("prompt_len", "new_tokens", "batch_size")}
        for name, m in self.models.items():
            numbers[f"models.{name}.decode_tokens_per_second.median"] = m.decode_tokens_per_second.median
            numbers[f"models.{name}.num_kv_heads"] = m.num_kv_heads
            if m.parameters is not None:
                numbers[f"models.{name}.parameters"] = m.parameters
        for where, value in numbers.items():
            if not math.isfinite(value) or value <= 0:
                raise Mha2GqaError(f"--bench {path}: {where} is {value}, not positive; {RERUN}")
