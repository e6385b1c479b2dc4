"""mha2gqa: convert multi-head-attention checkpoints to grouped-query attention and measure the cost.

The shared ground floor (families, dimensions, checkpoint I/O, text, model loading, records, units,
settings) is :mod:`mha2gqa.core`; the conversion is :mod:`mha2gqa.convert`, the evaluation harness
:mod:`mha2gqa.eval`, uptraining :mod:`mha2gqa.uptrain`, and the command line :mod:`mha2gqa.cli`.
"""

from mha2gqa.core.errors import Mha2GqaError, SettingError
from mha2gqa.core.records import version

__version__ = version()

__all__ = ["Mha2GqaError", "SettingError", "__version__"]
