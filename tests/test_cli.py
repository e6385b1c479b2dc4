"""The command line: summary line, quiet mode, help, and the offline demo end to end."""

import json

from click.testing import CliRunner

from mha2gqa.cli import main


def test_convert_prints_one_summary_line(tiny_checkpoint, tmp_path):
    result = CliRunner().invoke(main, ["convert", str(tiny_checkpoint("llama")), str(tmp_path / "out"), "-g", "2"])
    assert result.exit_code == 0, result.output
    summary = result.stdout.strip().splitlines()
    assert len(summary) == 1
    assert "KV heads 4 -> 2" in summary[0] and "KV cache 512 -> 256 bytes/token (F32)" in summary[0]


def test_quiet_prints_nothing(tiny_checkpoint, tmp_path):
    result = CliRunner().invoke(
        main, ["convert", str(tiny_checkpoint("llama")), str(tmp_path / "out"), "-g", "1", "-q"]
    )
    assert result.exit_code == 0 and result.output == ""
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_key_value_heads"] == 1


def test_env_var_options(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("MHA2GQA_CONVERT_NUM_KV_HEADS", "2")
    result = CliRunner().invoke(main, ["convert", str(tiny_checkpoint("qwen2")), str(tmp_path / "out"), "-q"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_key_value_heads"] == 2


def test_help_lists_commands():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0 and "convert" in result.output and "demo" in result.output


def test_demo_runs_offline_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("MHA2GQA_CACHE", str(tmp_path))
    result = CliRunner().invoke(main, ["demo", "--steps", "3", "-g", "2", "--method", "mean"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    rows = {ln.split()[0]: ln for ln in lines if ln.startswith(("original", "mean"))}
    assert rows["original"].endswith("1.00x") and rows["mean"].split()[-1].endswith("x")
    folder = next(tmp_path.glob("demo-*"))
    assert (folder / "mha" / "model.safetensors").is_file() and (folder / "gqa-mean-2" / "config.json").is_file()
    again = CliRunner().invoke(main, ["demo", "--steps", "3", "-g", "2", "--method", "mean"])
    assert "training the demo" not in again.output  # cached


def test_shipped_demo_job_loads_and_bad_job_files_are_refused(tmp_path):
    from mha2gqa.demo import DemoSettings, default_job_file, load_job

    job = load_job()
    assert default_job_file().name == "demo.yaml"
    assert job.settings == DemoSettings() and job.num_kv_heads == (4, 2, 1) and job.methods == ("mean", "first")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {hidden: 3}\ntrain: {}\nconvert: {}\n")
    result = CliRunner().invoke(main, ["demo", "--config", str(bad)])
    assert result.exit_code == 1 and "unknown settings ['hidden']" in result.output
