"""MHA -> GQA checkpoint conversion (streaming, sharded, atomic), its folders in the order of the work:

- :mod:`~mha2gqa.convert.prepare`: every check before any work (the :class:`~mha2gqa.convert.prepare.Conversion`);
- :mod:`~mha2gqa.convert.calibration`: the statistics of the calibration text, streamed layer by layer;
- :mod:`~mha2gqa.convert.plan`: what each layer becomes (counts, the heads' order, each layer's plan);
- :mod:`~mha2gqa.convert.methods`: how a layer's heads are merged (one module a method);
- :mod:`~mha2gqa.convert.refit`: each changed layer refitted on the converted model's own stream;
- :mod:`~mha2gqa.convert.guard`: every stage kept only where it made the model better;
- :mod:`~mha2gqa.convert.write`: every output tensor's source, and the shards written;
- :mod:`~mha2gqa.convert.engine`: the layer engine all of them run on;

the stages in order in :mod:`~mha2gqa.convert.converter`, their settings in
:mod:`~mha2gqa.convert.settings`. Importing this package is cheap: the converter (and torch) load on
first use of its names.
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
