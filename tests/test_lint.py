"""The tree stays ruff clean (lint and format), as CI and the style guide require."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the ruff of this interpreter's environment (a venv need not be activated), else the one on PATH
_BESIDE = Path(sys.executable).parent / "ruff"
RUFF = str(_BESIDE) if _BESIDE.is_file() else shutil.which("ruff")


@pytest.mark.skipif(RUFF is None, reason="ruff not installed (pip install -e '.[dev]')")
@pytest.mark.parametrize("args", [["check"], ["format", "--check"]])
def test_ruff(args):
    result = subprocess.run([RUFF, *args, str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
