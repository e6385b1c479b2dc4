"""The tree stays ruff clean (lint and format), as CI and the style guide require."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff not installed (pip install -e '.[dev]')")
@pytest.mark.parametrize("args", [["check"], ["format", "--check"]])
def test_ruff(args):
    result = subprocess.run(["ruff", *args, str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
