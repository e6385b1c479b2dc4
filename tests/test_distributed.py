"""Two processes (torchrun, gloo on CPU) give the same results as one: windows are split by rank,
sums and per-token KL values are gathered, only the main process writes."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import eval_argv, llama_with_tokenizer, story_text, torchrun

from mha2gqa.convert import convert_checkpoint


def test_two_processes_equal_one(tmp_path):
    text = story_text(tmp_path / "t.txt", 400)
    src = llama_with_tokenizer(tmp_path / "mha", text)
    conv = convert_checkpoint(src, tmp_path / "g1", 1, progress=False).output
    options = "--protocol disjoint --protocol rolling --doc-split paragraph --device cpu -q"
    args = ["-m", "mha2gqa.cli", *eval_argv(src, conv, text, 64, 3000, options=options)]
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    subprocess.run([sys.executable, *args, "--output", str(one)], check=True)
    run_ok([*torchrun(), *args, "--output", str(two)])
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert (a["device"]["processes"], b["device"]["processes"]) == (1, 2)
    for p in ("disjoint", "rolling"):
        for m in ("original", "converted"):
            assert a["protocols"][p][m]["tokens"] == b["protocols"][p][m]["tokens"]
            assert a["protocols"][p][m]["ppl"] == pytest.approx(
                b["protocols"][p][m]["ppl"], rel=1e-6
            )  # thread counts differ: float noise only
    for k in ("mean", "median", "q99", "max", "count"):
        assert a["agreement"]["kl"][k] == pytest.approx(
            b["agreement"]["kl"][k], rel=1e-6
        )  # thread counts differ: float noise only
    assert a["agreement"]["top1_agreement"] == pytest.approx(b["agreement"]["top1_agreement"], abs=1e-3)
    assert a["attention"]["summary"]["mean_kl"] == pytest.approx(
        b["attention"]["summary"]["mean_kl"], rel=1e-6
    )  # thread counts differ: float noise only


def run_ok(cmd: list[str]) -> str:
    """Run ``cmd``; its standard output. On failure the assertion shows what it printed (torchrun's
    ranks included)."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, "\n".join(
        ln for ln in (done.stdout + done.stderr).splitlines() if "rank1" in ln or "Error" in ln
    )[-6000:]
    return done.stdout


def test_uptraining_on_two_processes_follows_the_one_process_run(tmp_path):
    """DDP over 2 gloo processes, each reading half of every global batch, reaches the weights a
    single process reaches with the same --batch-size (gradients are averaged: float noise only)."""
    from safetensors.torch import load_file

    text = story_text(tmp_path / "t.txt", 400)
    src = llama_with_tokenizer(tmp_path / "mha", text)
    student = convert_checkpoint(src, tmp_path / "g2", 2, progress=False).output
    args = [
        "-m",
        "mha2gqa.cli",
        "uptrain",
        str(student),
        "--data",
        str(text),
        *["--seq-len", "32", "--batch-size", "4", "--max-steps", "6", "--lr", "3e-3", "--eval-data"],
        str(text),
        "--eval-tokens",
        "512",
        "--teacher",
        str(src),
        *["--objective", "mix", "--device", "cpu", "-q", "--mixed-precision", "no"],  # float32 on every machine
    ]
    subprocess.run([sys.executable, *args, "--output", str(tmp_path / "one")], check=True)
    run_ok([*torchrun(), *args, "--output", str(tmp_path / "two")])
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], load_file(student / "model.safetensors")[k]) for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    logs = [
        [json.loads(x) for x in (tmp_path / r / "uptrain_log.jsonl").read_text().splitlines()] for r in ("one", "two")
    ]
    assert (logs[0][0]["processes"], logs[1][0]["processes"]) == (1, 2)
    ev = [[r["ppl"] for r in log if r["type"] == "eval"] for log in logs]
    assert ev[0] == pytest.approx(ev[1], rel=1e-4)
