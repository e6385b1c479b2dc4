"""The benchmark scripts run (their smoke modes), so they never rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, requires_fixtures

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_gpu_suite_cpu_smoke_mode_writes_its_table_and_json(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_suite.py"), "--out", str(tmp_path), "--device", "cpu", "--tiny"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_suite.json").read_text())
    speed = results["speed"]
    ppl = speed["perplexity"]
    assert abs(ppl["mha2gqa"]["ppl"] / ppl["plain"]["ppl"] - 1) < 1e-4  # same perplexity both ways
    decode = speed["decode"]
    assert {(r["kv_heads"], r["batch"]) for r in decode} == {(kv, b) for kv in (8, 2, 1) for b in (1, 4)}
    assert all(r["kv_matches_plan"] and r["decode_tokens_per_second"] > 0 for r in decode)
    by = {(r["kv_heads"], r["batch"]): r["kv_cache_bytes"] for r in decode}
    assert by[(2, 4)] * 4 == by[(8, 4)] and by[(1, 1)] * 8 == by[(8, 1)]  # the cache shrinks as H/G
    assert speed["calibration"]["seconds_per_layer"] > 0 and speed["attention"]["ours"]["wall"] > 0
    refit = speed["refit"]
    assert len(refit["steps"]) == refit["shape"]["layers"] and all(0 < n <= refit["max_steps"] for n in refit["steps"])
    assert 0 < refit["seconds_per_step"] < refit["seconds_per_layer"] <= refit["refit_seconds"] < refit["seconds"]
    allocation = speed["allocation"]  # 2 KV heads per layer on average, from 1, 2, 4 or 8
    assert len(allocation["chosen"]) == 2 and sum(allocation["chosen"]) <= 4 and allocation["cost"] == "logits"
    table = (tmp_path / "gpu_suite.md").read_text()
    assert "perplexity tok/s" in table and "decode, 1 KV heads, batch 4" in table and "`svd --refit` 8 -> 1" in table
    assert "`svd --per-layer auto` (logits cost)" in table


def test_gpu_suite_measures_only_the_figures_asked_for_and_refuses_unknown_ones(tmp_path):
    run = [sys.executable, str(BENCHMARKS / "gpu_suite.py"), "--out", str(tmp_path), "--device", "cpu", "--tiny"]
    proc = subprocess.run([*run, "--figures", "calibration"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(json.loads((tmp_path / "gpu_suite.json").read_text())["speed"]) == {"calibration"}
    assert "svd calibration" in (tmp_path / "gpu_suite.md").read_text()
    proc = subprocess.run([*run, "--figures", "calibration,speed"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--figures 'calibration,speed': give some of tests," in proc.stderr


@requires_fixtures("stories260K/tokenizer.json")
def test_ctranslate2_check_runs_a_conversion_with_the_kv_heads_written():
    pytest.importorskip("ctranslate2")
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "ctranslate2_check.py"),
            "--cases",
            "mistral",
            "gpt2-mqa",
            "--tokenizer",
            str(FIXTURES / "stories260K"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in proc.stdout.splitlines()}
    for case, model, kv in (("mistral", "mean -> 2", "2 / 2"), ("gpt2-mqa", "mean -> 1", "1 / 1")):
        line = rows[(case, model)]
        assert f"| {kv} |" in line and "100% of" in line, line
        assert float(line.split("|")[4].split()[0]) < 1e-3  # the logits agree with transformers


def test_the_attention_step_benchmark_times_every_arithmetic_and_their_gradients_agree():
    args = ["--rounds", "1", "--windows", "1", "--heads", "2", "--tokens", "64", "--head-dim", "16"]
    script = str(BENCHMARKS / "attention_step.py")
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.rsplit(None, 4) for line in proc.stdout.splitlines() if line.startswith(("float32", "bf"))]
    assert [r[0] for r in rows] == ["float32", "bfloat16", "bf16, f32 backward"]
    assert float(rows[0][4]) == 0.0 and all(float(r[4]) < 0.05 for r in rows)  # bf16 rounding, not another result


def test_the_distillation_loss_benchmark_times_both_and_finds_them_equal():
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "distill_loss.py"), "--rounds", "1", "--tokens", "40", "--vocab", "300"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(("float32", "bfloat16"))]
    assert [r[0] for r in rows] == ["float32", "bfloat16"]
    assert all(float(r[4]) < 1e-5 and float(r[5]) < 1e-5 for r in rows)  # the same loss and gradient


def test_the_head_blocks_benchmark_measures_both_ways_to_the_same_figures():
    cmd = [sys.executable, str(BENCHMARKS / "head_blocks.py"), "--tokens", "40", "--rounds", "1", "--hidden", "64"]
    proc = subprocess.run([*cmd, "--vocab", "300", "--candidates", "2"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] == ["40"]]
    assert len(rows) == 1 and float(rows[0][1]) > 0 and float(rows[0][2]) > 0
    assert float(rows[0][-1]) < 1e-5  # the same KL and top-1 sums, a block at a time
