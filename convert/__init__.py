"""MHA -> GQA checkpoint conversion (streaming, sharded, atomic).

Where things are: the methods in :mod:`mha2gqa.convert.methods` (one module each, registered in
its ``__init__``), their settings in :mod:`mha2gqa.convert.settings`, calibration in
:mod:`mha2gqa.convert.calibration`, where each output tensor comes from in :mod:`mha2gqa.convert.tensor_sources` and
the stages of a conversion in :mod:`mha2gqa.convert.converter`. Importing this package is cheap:
the converter (and torch) load on first use of its names.
"""

from __future__ import annotations

from mha2gqa.core.lazy import lazy_names

_LAZY = {
    "mha2gqa.convert.converter": ("ConversionResult", "convert_checkpoint"),
    "mha2gqa.convert.settings": ("ConvertSettings",),
    "mha2gqa.convert.methods": ("GROUPINGS", "METHODS"),
}

__all__ = sorted(name for names in _LAZY.values() for name in names)
__getattr__ = lazy_names(__name__, _LAZY)
