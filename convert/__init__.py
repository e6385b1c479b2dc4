"""MHA -> GQA checkpoint conversion (streaming, sharded, atomic).

Where things are: the methods in :mod:`mha2gqa.convert.methods` (one module each, registered in
its ``__init__``), their settings in :mod:`mha2gqa.convert.settings`, calibration in
:mod:`mha2gqa.convert.calibration`, the per-tensor plan in :mod:`mha2gqa.convert.tensor_plan` and
the stages of a conversion in :mod:`mha2gqa.convert.converter`. Importing this package is cheap:
the converter (and torch) load on first use of its names.
"""

from __future__ import annotations

from mha2gqa.core.lazy import lazy_names

_LAZY = {
    "ConversionResult": "mha2gqa.convert.converter",
    "convert_checkpoint": "mha2gqa.convert.converter",
    "ConvertSettings": "mha2gqa.convert.settings",
    "METHODS": "mha2gqa.convert.methods",
    "GROUPINGS": "mha2gqa.convert.methods",
}

__all__ = sorted(_LAZY)
__getattr__ = lazy_names(__name__, _LAZY)
