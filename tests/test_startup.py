"""Start-up: help, planning, inspection and reports never import torch or transformers' modeling code,
and a mistake in an option is reported before anything heavy is imported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner
from conftest import LLAMA2_7B, eval_argv, llama_with_tokenizer, story_text

from mha2gqa.cli import main


def modules_after(*argv: str) -> dict:
    """Run the CLI in a fresh interpreter; returns its exit code and which heavy modules it loaded."""
    code = (
        "import sys, json\nfrom mha2gqa.cli import main\ntry:\n    main(sys.argv[1:])\n"
        "finally:\n    heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith('transformers.models'))\n"
        "    print('MODULES', json.dumps(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("MODULES"))
    return {"rc": out.returncode, "heavy": json.loads(line.split(" ", 1)[1]), "out": out.stdout + out.stderr}


@pytest.fixture(scope="module")
def results_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("startup")
    text = story_text(root / "t.txt")
    src = llama_with_tokenizer(root / "mha", text, max_positions=64)
    out = root / "r.json"
    args = eval_argv(src, src, text, "32", "300", "--output", out, "-q")
    assert CliRunner().invoke(main, args).exit_code == 0
    return out


def test_help_plan_inspect_and_report_do_not_import_torch(tmp_path, results_file):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA2_7B))
    report = ["report", str(results_file), "--html", str(tmp_path / "r.html")]
    for argv in (
        ["--help"],
        ["convert", "--help"],
        ["plan", str(config)],
        ["plan", str(tmp_path)],
        ["inspect", str(config)],
        report,
    ):
        ran = modules_after(*argv)
        assert ran["rc"] == 0 and ran["heavy"] == [], (argv, ran)
    assert (tmp_path / "r.html").stat().st_size > 10_000


def test_bad_options_are_refused_before_torch_loads(tmp_path):
    for argv, message in [
        (
            ["convert", str(tmp_path), str(tmp_path / "o"), "-g", "2", "--calibration-tokens", "0"],
            "--calibration-tokens must be at least 1",
        ),
        (["convert", str(tmp_path), str(tmp_path / "o"), "-g", "2", "--max-shard-size", "5XB"], "--max-shard-size"),
        (["convert", str(tmp_path), str(tmp_path / "o"), "-g", "2", "--seed", str(2**64)], "--seed must be at most"),
        (["eval", "--original", "x", "--data", "y", "--seq-len", "0"], "--seq-len must be at least 2"),
        (["eval", "--original", "x", "--data", "y", "--max-kl", "nan"], "--max-kl must be a finite number"),
        (
            ["uptrain", "x", "--data", "y", "--output", str(tmp_path / "u"), "--weight-decay", "nan"],
            "--weight-decay must be a finite number",
        ),
        (["plan", "x", "--seq-len", "0"], "--seq-len must be at least 1"),
        (["bench", "--original", "x", "--batch-size", "0"], "--batch-size must be at least 1"),
    ]:
        ran = modules_after(*argv)
        assert ran["rc"] != 0 and message in ran["out"] and ran["heavy"] == [], (argv, ran)
        assert "Traceback" not in ran["out"] and ran["out"].count("Error: ") == 1
