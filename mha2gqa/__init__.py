"""mha2gqa: convert multi-head-attention checkpoints to grouped-query attention and measure the cost.

The conversion core lives in :mod:`mha2gqa.convert`, the evaluation harness in :mod:`mha2gqa.eval`
and the command line in :mod:`mha2gqa.cli`.
"""

from importlib.metadata import PackageNotFoundError, version

from mha2gqa.errors import Mha2GqaError

try:
    __version__ = version("mha2gqa")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["Mha2GqaError", "__version__"]
