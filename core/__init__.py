"""The ground floor: facts and I/O every part of mha2gqa shares.

Nothing here imports :mod:`mha2gqa.convert`, :mod:`mha2gqa.eval`, :mod:`mha2gqa.uptrain` or the CLI
(``tests/test_layering.py`` enforces it), and importing this package costs nothing: modules that need
torch import it themselves.
"""
