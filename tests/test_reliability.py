"""Reliability as a hostile user tests it: races, signals, leftovers, damaged inputs, bad values,
full disks. Every case ends in one line and a non-zero exit, with nothing lost and nothing left."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import eval_argv, llama_with_tokenizer, story_text
from test_bad_input import assert_refused, rewrite_header, run_cli

from mha2gqa.cli import main
from mha2gqa.convert import convert_checkpoint
from mha2gqa.core.errors import Mha2GqaError


@pytest.fixture
def src(tiny_checkpoint, tmp_path):
    folder = tmp_path / "src"
    shutil.copytree(tiny_checkpoint("llama"), folder)
    return folder


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def kv_heads(folder: Path) -> int:
    return json.loads((folder / "config.json").read_text())["num_key_value_heads"]


# ---- data loss ------------------------------------------------------------------------------------


def test_a_concurrent_writer_that_finishes_first_wins_and_is_left_intact(src, tmp_path, monkeypatch):
    """Two conversions to one new DST: the one publishing second fails with one line and touches
    nothing of the winner (the race made deterministic: the rival runs while this one writes)."""
    import mha2gqa.convert.converter as converter

    dst = tmp_path / "out"
    real = converter.write_checkpoint
    rival: list[str] = []

    def write_with_a_rival(*args, **kwargs):
        if not rival:
            rival.append("started")
            convert_checkpoint(src, dst, 1, progress=False)  # another process gets there first
        return real(*args, **kwargs)

    monkeypatch.setattr(converter, "write_checkpoint", write_with_a_rival)
    with pytest.raises(Mha2GqaError, match="was created by another process while this one was writing"):
        convert_checkpoint(src, dst, 2, progress=False)
    assert kv_heads(dst) == 1 and (dst / "model.safetensors").is_file()
    assert leftovers(tmp_path) == []


def test_two_processes_racing_for_one_dst(src, tmp_path):
    dst = tmp_path / "out"
    cmd = [sys.executable, "-m", "mha2gqa.cli", "convert", str(src), str(dst), "-q", "-g"]
    procs = [subprocess.Popen([*cmd, g], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for g in "21"]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    assert sorted(rc for rc, _ in results) == [0, 1], results
    loser = next(err for rc, err in results if rc == 1)
    assert "another process" in loser or "exists and is not empty" in loser, loser
    winner = "21"[[rc for rc, _ in results].index(0)]
    assert kv_heads(dst) == int(winner) and leftovers(tmp_path) == []


def test_overwrite_never_replaces_a_folder_holding_an_input(src, tmp_path):
    dst = tmp_path / "out"
    assert run_cli("convert", src, dst, "-g", 2, "-q").exit_code == 0
    calibration = story_text(dst / "calibration.txt")
    assert_refused(
        run_cli("convert", src, dst, "-g", 1, "--method", "aligned", "--calibration", calibration, "--overwrite"),
        r"is \(or contains\) the --calibration text",
        tmp_path,
    )
    assert calibration.is_file() and kv_heads(dst) == 2


def test_overwrite_exchanges_in_one_step_and_falls_back_without_renameat2(src, tmp_path, monkeypatch):
    import mha2gqa.core.output as output

    dst = tmp_path / "out"
    for g in (2, 1):
        assert run_cli("convert", src, dst, "-g", g, "-q", "--overwrite").exit_code == 0
        assert kv_heads(dst) == g and leftovers(tmp_path) == []
    monkeypatch.setattr(output, "_renameat2", lambda: None)  # another OS: mkdir claim / move-aside
    assert run_cli("convert", src, dst, "-g", 2, "-q", "--overwrite").exit_code == 0
    assert run_cli("convert", src, tmp_path / "new", "-g", 2, "-q").exit_code == 0
    assert kv_heads(dst) == 2 and kv_heads(tmp_path / "new") == 2 and leftovers(tmp_path) == []


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    text = story_text(root / "t.txt")
    mha = llama_with_tokenizer(root / "mha", text, max_positions=64)
    return mha, convert_checkpoint(mha, root / "g2", 2, progress=False).output, text


def eval_args(pair, *extra):
    mha, conv, text = pair
    return eval_argv(mha, conv, text, 32, 200, "--no-attention", "-q", *extra)


def test_single_file_outputs_never_replace_inputs_or_foreign_files(pair, tmp_path):
    text = pair[2]
    before = text.read_bytes()
    assert_refused(
        run_cli(*eval_args(pair, "--output", text, "--overwrite")), r"is \(or contains\) the --data text", tmp_path
    )
    foreign = tmp_path / "notes.json"
    foreign.write_text('{"mine": true}')
    assert_refused(run_cli(*eval_args(pair, "--output", foreign)), r"exists: pass --overwrite", tmp_path)
    assert_refused(
        run_cli(*eval_args(pair, "--output", foreign, "--overwrite")), "was not written by mha2gqa", tmp_path
    )
    assert text.read_bytes() == before and foreign.read_text() == '{"mine": true}'
    out = tmp_path / "r.json"
    assert run_cli(*eval_args(pair, "--output", out)).exit_code == 0
    assert run_cli(*eval_args(pair, "--output", out, "--overwrite")).exit_code == 0  # ours: replaced
    assert_refused(run_cli("report", out, "--html", out), r"is \(or contains\) the input", tmp_path)
    html = tmp_path / "missing" / "deeper" / "r.html"  # a report into a folder that does not exist yet
    assert run_cli("report", out, "--html", html).exit_code == 0
    assert_refused(run_cli("report", out, "--html", html), r"exists: pass --overwrite", tmp_path)
    assert run_cli("report", out, "--html", html, "--overwrite").exit_code == 0
    assert json.loads(out.read_text())["schema"] == "mha2gqa.eval/1" and leftovers(tmp_path) == []


def test_a_dangling_symlink_dst_is_refused(src, tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    assert_refused(run_cli("convert", src, tmp_path / "link", "-g", 2), "dangling symbolic link", tmp_path)


# ---- signals and leftovers ------------------------------------------------------------------------

SLOW_CLI = """
import sys, time
import mha2gqa.convert.write.shard_writer as writer
real = writer._write_tensor
def slow(fd, t):
    time.sleep(0.25)
    real(fd, t)
writer._write_tensor = slow
from mha2gqa.cli import main
main(sys.argv[1:])
"""


def start_slow_conversion(src: Path, dst: Path) -> subprocess.Popen:
    """A conversion whose writer sleeps per tensor, so that a signal lands mid-write."""
    cmd = [sys.executable, "-c", SLOW_CLI, "convert", str(src), str(dst), "-g", "2", "-q"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not leftovers(dst.parent) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    assert leftovers(dst.parent), "the conversion never started writing"
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_mid_conversion_leaves_nothing(src, tmp_path, sig):
    if signal.getsignal(sig) is signal.SIG_IGN:  # a background job ignores SIGINT, nohup SIGHUP
        pytest.skip(f"{sig.name} is ignored in this session, and so in its children (a run under nohup keeps going)")
    proc = start_slow_conversion(src, tmp_path / "out")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "Traceback" not in err, err
    if sig != signal.SIGINT:
        assert proc.returncode == 128 + sig and f"stopped by {sig.name}" in err
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_a_killed_run_leaves_a_temporary_that_the_next_run_reports_and_removes(src, tmp_path):
    proc = start_slow_conversion(src, tmp_path / "out")
    proc.kill()  # SIGKILL: nothing can clean up
    proc.communicate(timeout=60)
    stale = leftovers(tmp_path)
    assert len(stale) == 1 and f".out.mha2gqa-tmp-{proc.pid}-" in stale[0]
    result = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out"), "-g", "2", "-q"])
    assert (
        result.exit_code == 0 and "left by a run that was killed" in result.output and "--remove-stale" in result.output
    )
    assert leftovers(tmp_path) == stale  # reported, not removed
    result = CliRunner().invoke(
        main, ["convert", str(src), str(tmp_path / "out"), "-g", "1", "-q", "--overwrite", "--remove-stale"]
    )
    assert result.exit_code == 0 and leftovers(tmp_path) == []


# ---- damaged inputs: one line, never a traceback -------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "pattern"),
    [
        (
            lambda h: h["lm_head.weight" if "lm_head.weight" in h else "model.norm.weight"].update(
                data_offsets=[float(x) for x in h["model.norm.weight"]["data_offsets"]]
            ),
            "not non-negative integers",
        ),
        (lambda h: h["model.norm.weight"].update(data_offsets=["0", "128"]), "not non-negative integers"),
        (lambda h: h["model.norm.weight"].update(shape=[-32]), "not non-negative integers"),
        (lambda h: h["model.norm.weight"].update(dtype=7), "unsupported dtype"),
    ],
)
def test_bad_header_values(src, tmp_path, edit, pattern):
    rewrite_header(src / "model.safetensors", edit)
    assert_refused(run_cli("convert", src, tmp_path / "out", "-g", 2), pattern, tmp_path)


@pytest.mark.parametrize("weight_map", [["model.safetensors"], {"model.norm.weight": None}, None])
def test_bad_shard_index(src, tmp_path, weight_map):
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert_refused(run_cli("convert", src, tmp_path / "out", "-g", 2), "shard index|weight_map", tmp_path)


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"num_key_value_heads": "4"}, "num_key_value_heads must be a positive integer"),
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
        ({"head_dim": 2.5}, "head_dim must be a positive integer"),
        ({"model_type": None, "architectures": None}, "unsupported model family"),
        ({"hidden_act": "swishy"}, "transformers cannot build this model"),
        ({"rope_parameters": "fast"}, "transformers cannot build this model"),
        ({"model_type": "llama-9000", "architectures": None}, "unsupported model family"),
        ({"num_hidden_layers": 1_000_000}, "config.json says 1000000 layers, but the weights have no"),
    ],
)
def test_bad_config_values(src, tmp_path, change, pattern):
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(change)
    (src / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    started = time.monotonic()
    assert_refused(run_cli("convert", src, tmp_path / "out", "-g", 2), pattern, tmp_path)
    assert time.monotonic() - started < 30 and not (tmp_path / "out").exists()


def test_a_pickle_refused_by_weights_only_says_it_is_unsafe(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    torch.save({"model.embed_tokens.weight": torch.zeros(2), "evil": Path("/")}, src / "pytorch_model.bin")
    (src / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 8,
                "num_attention_heads": 2,
                "num_hidden_layers": 1,
                "vocab_size": 4,
                "intermediate_size": 8,
            }
        )
    )
    result = run_cli("convert", src, tmp_path / "out", "-g", 1, "--allow-pickle")
    assert_refused(result, "refused as unsafe by torch.load\\(weights_only=True\\)", tmp_path)
    assert "weights_only=False" not in result.output


def test_text_that_is_not_utf8_is_named_as_such(pair, tmp_path):
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café au lait\n".encode("latin-1") * 50)
    binary = tmp_path / "blob.txt"
    binary.write_bytes(bytes(range(256)) * 8)
    for path in (latin, binary):
        args = eval_args(pair)
        args[args.index("--data") + 1] = path
        assert_refused(run_cli(*args), r"--data .*: file is not UTF-8 text \(byte \d+", tmp_path)
    mha, _, _ = pair
    assert_refused(
        run_cli("convert", mha, tmp_path / "o", "-g", 2, "--method", "svd", "--calibration", latin),
        r"--calibration .*: file is not UTF-8 text",
        tmp_path,
    )


def test_results_and_config_files_that_are_not_what_they_claim(tmp_path):
    partial = tmp_path / "r.json"
    partial.write_text(json.dumps({"schema": "mha2gqa.eval/1", "models": {"original": {"path": "x"}}}))
    assert_refused(
        run_cli("report", partial, "--html", tmp_path / "r.html"), r"models\.original\.\w+ is missing", tmp_path
    )
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    assert_refused(run_cli("inspect", bad), "not valid JSON", tmp_path)
    assert_refused(run_cli("plan", bad, "--gpu-memory", "inf"), "--gpu-memory", tmp_path)


# ---- bad values: refused, never reinterpreted -----------------------------------------------------


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--max-tokens", "0"], "--max-tokens must be at least 2"),
        (["--max-tokens", "-1"], "--max-tokens must be at least 2"),
        (["--stride", "0", "--protocol", "stride"], "--stride must be at least 1"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--max-ppl-ratio", "nan"], "--max-ppl-ratio must be a finite number"),
        (["--min-top1", "1.5"], "--min-top1 must be at most 1"),
        (["--max-kl", "-0.1"], "--max-kl must be at least 0"),
    ],
)
def test_bad_eval_values(pair, tmp_path, args, pattern):
    assert_refused(run_cli(*eval_args(pair, *args)), pattern, tmp_path)


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--lr", "inf"], "--lr must be a finite number"),
        (["--lr", "0"], "--lr must be greater than 0"),
        (["--weight-decay", "nan"], "--weight-decay must be a finite number"),
        (["--max-steps", "0"], "--max-steps must be at least 1"),
        (["--max-tokens", "-1"], "--max-tokens must be at least 1"),
        (["--kd-weight", "1.5"], "--kd-weight must be at most 1"),
        (["--seed", "-3"], "--seed must be at least 0"),
        (["--seq-len", "65"], "--seq-len 65 is longer than the model's 64 positions; use --seq-len 64 or less"),
        (["--eval-seq-len", "65"], "--eval-seq-len 65 is longer than the model's 64 positions"),
    ],
)
def test_bad_uptrain_values(pair, tmp_path, args, pattern):
    _, conv, text = pair
    out = tmp_path / "run"
    assert_refused(run_cli("uptrain", conv, "--data", text, "--output", out, "-q", *args), pattern, tmp_path)
    assert not out.exists()


@pytest.mark.parametrize("refit", [[], ["--refit"]])
def test_a_calibration_window_longer_than_the_model_is_refused_not_cut(pair, tmp_path, refit):
    """As eval's and uptrain's windows are: a length the user gave is never quietly made another."""
    mha, _, text = pair
    args = ["convert", mha, tmp_path / "out", "-g", 2, "--method", "svd", "--calibration", text, *refit]
    want = "--calibration-seq-len 65 is longer than the model's 64 positions; use --calibration-seq-len 64 or less"
    assert_refused(run_cli(*args, "--calibration-seq-len", 65), want, tmp_path)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("size", ["5XB", "0", "-1", "nan", "1e400GB"])
def test_bad_shard_sizes(src, tmp_path, size):
    assert_refused(
        run_cli("convert", src, tmp_path / "out", "-g", 2, "--max-shard-size", size), "--max-shard-size", tmp_path
    )


def test_training_stops_on_a_non_finite_loss(pair, tmp_path, monkeypatch):
    import mha2gqa.uptrain.trainer as trainer

    def poisoned(*args, **kwargs):
        return float("nan"), {}

    monkeypatch.setattr(trainer, "accumulate", poisoned)
    _, conv, text = pair
    result = run_cli(
        "uptrain", conv, "--data", text, "--output", tmp_path / "run", "-q", "--seq-len", 16, "--max-steps", 3
    )
    assert result.exit_code == 1 and "the loss became nan at step 1" in result.output
    assert not (tmp_path / "run" / "config.json").exists()


def test_a_torn_last_log_line_is_skipped_with_a_warning(tmp_path, monkeypatch):
    from mha2gqa.core.runlog import RunLog, RunTrain, read_log

    log = tmp_path / "uptrain_log.jsonl"
    writer = RunLog(log)
    for step in range(3):
        writer.write(RunTrain(step, 64 * step, 0.1 * step, 2.0, 1e-3, None, 100.0, parts={"ce": 2.0}))
    with log.open("a") as f:
        f.write('{"type": "train", "st')  # killed mid-write
    with pytest.warns(UserWarning, match="torn last line"):
        assert [r.step for r in read_log(log)] == [0, 1, 2]
    with pytest.warns(UserWarning):
        RunLog(log, keep_until_step=1)  # a resume keeps what is whole up to its checkpoint
    assert read_log(log) == [RunTrain(s, 64 * s, 0.1 * s, 2.0, 1e-3, None, 100.0, parts={"ce": 2.0}) for s in (0, 1)]
    whole = log.read_text()

    def disk_full(*_):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:  # the resume's rewrite goes beside the log and is renamed into place
        m.setattr("mha2gqa.core.output.os.replace", disk_full)
        with pytest.raises(OSError, match="No space"):
            RunLog(log, keep_until_step=0)
    assert log.read_text() == whole and [p.name for p in tmp_path.iterdir()] == [log.name]  # old log whole
    log.write_text('{"a": 1}\nnot json\n{"b": 2}\n')
    with pytest.raises(Mha2GqaError, match=r"line 1\.type None is not one of start, train"):
        read_log(log)
    log.write_text('{"type": "train", "step": 1}\nnot json\n{"b": 2}\n')
    with pytest.raises(Mha2GqaError, match=r"uptrain_log.jsonl: line 1 \(train\).tokens is missing"):
        read_log(log)


# ---- full disks ------------------------------------------------------------------------------------


def _mount_tmpfs(disk: Path, size: int) -> None:
    """A ``size``-byte tmpfs at ``disk`` (root only; the test is skipped where mounting is not allowed)."""
    disk.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a small tmpfs")
    options = f"size={-(-size // 4096) * 4096}"
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs is not allowed here")


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB tmpfs."""
    _mount_tmpfs(tmp_path / "disk", 64 * 1024)
    yield tmp_path / "disk"
    subprocess.run(["umount", "-l", str(tmp_path / "disk")], capture_output=True)


def test_a_disk_that_fills_while_the_optimizer_state_is_saved_is_one_line(pair, tmp_path):
    """The checkpoint's model fits, its optimizer state (twice the weights, written by torch's C++
    stream, which says only "iostream error") does not: one line, no traceback, no partial folder."""
    _, conv, text = pair
    disk = tmp_path / "half"
    _mount_tmpfs(disk, int((conv / "model.safetensors").stat().st_size * 2.2))
    try:
        result = run_cli(
            "uptrain", conv, "--data", text, "--output", disk / "run", "-q", "--seq-len", 16, "--max-steps", 2,
            "--save-every", 1,
        )  # fmt: skip
        assert result.exit_code == 1, result.output
        assert "disk full" in result.output and "Traceback" not in result.output, result.output
        assert not [p for p in (disk / "run").rglob("*") if p.name.startswith(".")]  # no half-written checkpoint
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_every_writer_reports_a_full_disk_in_one_line(pair, tiny_disk, tmp_path):
    mha, conv, text = pair
    filler = tiny_disk / "filler"
    filler.write_bytes(b"x" * 60_000)  # one page left
    results = tmp_path / "r.json"
    assert run_cli(*eval_args(pair, "--output", results)).exit_code == 0
    cases = [
        ("convert", mha, tiny_disk / "out", "-g", 2),
        ("report", results, "--html", tiny_disk / "r.html"),
        ("uptrain", conv, "--data", text, "--output", tiny_disk / "run", "-q", "--seq-len", 16, "--max-steps", 1),
        eval_args(pair, "--output", tiny_disk / "r.json"),
    ]
    for args in cases:
        result = run_cli(*args)
        assert result.exit_code == 1, (args, result.output)
        assert "disk full" in result.output and "Traceback" not in result.output, (args, result.output)
    # nothing partial left: the run folder of uptrain (resumable by design) holds no half-written file
    assert sorted(p.name for p in tiny_disk.iterdir() if p.name != "run") == ["filler"]
    assert not [p for p in (tiny_disk / "run").rglob("*") if p.name.startswith(".")]


def test_a_disk_that_fills_while_the_refit_spills_its_hidden_states_is_one_line(pair, tiny_disk):
    """The refit's hidden states beyond --refit-memory go to memory-mapped files beside DST; written into
    where the disk is full, such a file kills the process with SIGBUS. Reserved up front, a full disk is
    one line, and nothing is left on it."""
    mha, _, text = pair
    result = run_cli(
        "convert", mha, tiny_disk / "out", "-g", 1, "--method", "svd", "--calibration", text, "--refit",
        "--refit-memory", "1KB", "--calibration-seq-len", 32, "--calibration-tokens", 1024, "-q",
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "disk full while writing" in result.output and "--refit-memory" in result.output, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert list(tiny_disk.iterdir()) == []


def test_a_disk_that_fills_in_the_distillations_teacher_pass_is_one_line(pair, tmp_path):
    """``convert --distill``: the conversion fits, the teacher's cached log-probabilities do not."""
    mha, conv, text = pair
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, (conv / "model.safetensors").stat().st_size * 3 + 256 * 1024)  # the teacher's cache: 1 MB
    try:
        args = ["convert", mha, disk / "out", "-g", 1, "--calibration", text, "--calibration-seq-len", 32,
                "--calibration-tokens", 1024, "-q"]  # fmt: skip
        assert run_cli(*args, "--method", "svd").exit_code == 0  # the conversion alone fits
        shutil.rmtree(disk / "out")
        result = run_cli(*args, "--distill", "--distill-steps", 64)
        assert result.exit_code == 1, result.output
        assert "disk full while writing DST" in result.output and "Traceback" not in result.output, result.output
        # the machine's state, not the run's decision: the teacher's finished chunks are kept for --resume
        assert "the finished work is kept in" in result.output and len(result.output.strip().splitlines()) == 1
        assert [p.name for p in disk.iterdir()] == [".out.mha2gqa-resume"]  # the staged conversion went
        assert not [p for p in disk.rglob(".*") if p.name.endswith((".partial", ".tmp"))]  # nothing half-written
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_nan_in_source_weights_is_reported_and_refused_on_request(src, tmp_path):
    from safetensors.torch import load_file, save_file

    state = load_file(src / "model.safetensors")
    state["model.layers.0.self_attn.k_proj.weight"][0, 0] = float("nan")
    state["model.layers.1.mlp.up_proj.weight"][1, 1] = float("inf")
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    result = run_cli("convert", src, tmp_path / "out", "-g", 2, "-q")
    assert result.exit_code == 0 and "k_proj.weight holds NaN or Inf values" in result.output
    assert_refused(
        run_cli("convert", src, tmp_path / "out2", "-g", 2, "--check-finite"),
        r"k_proj.weight, model.layers.1.mlp.up_proj.weight hold NaN or Inf",
        tmp_path,
    )


def test_text_sources_are_checked_before_loading_and_hub_dataset_ids_pass():
    from mha2gqa.core.errors import SettingError
    from mha2gqa.core.text import check_text_source
    from mha2gqa.eval.settings import EvalSettings

    for name in ("wikitext:wikitext-2-raw-v1:test", "Salesforce/wikitext:wikitext-2-raw-v1:test", "org/name:train"):
        check_text_source(name)
        EvalSettings(data=name).check()
    for bad, message in [
        ("missing.txt", "no such file"),
        ("pyproject.toml", "unsupported file type"),
        ("just-a-word", "not a file, and not a datasets name"),
    ]:
        with pytest.raises(SettingError, match=message):
            check_text_source(str(Path(__file__).parents[1] / bad) if bad == "pyproject.toml" else bad)
