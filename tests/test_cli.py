"""The command line: summary line, quiet mode, help, and the offline demo end to end."""

import json
from pathlib import Path

from click.testing import CliRunner

from mha2gqa.cli import main


def test_convert_prints_one_summary_line(tiny_checkpoint, tmp_path):
    result = CliRunner().invoke(main, ["convert", str(tiny_checkpoint("llama")), str(tmp_path / "out"), "-g", "2"])
    assert result.exit_code == 0, result.output
    summary = result.stdout.strip().splitlines()
    assert len(summary) == 1
    assert "KV heads 4 -> 2" in summary[0] and "KV cache 512 -> 256 bytes/token (F32)" in summary[0]


def test_quiet_prints_the_result_only(tiny_checkpoint, tmp_path):
    result = CliRunner().invoke(
        main, ["convert", str(tiny_checkpoint("llama")), str(tmp_path / "out"), "-g", "1", "-q"]
    )
    assert result.exit_code == 0 and len(result.output.splitlines()) == 1 and "KV heads 4 -> 1" in result.output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_key_value_heads"] == 1


def test_env_var_options(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("MHA2GQA_CONVERT_NUM_KV_HEADS", "2")
    result = CliRunner().invoke(main, ["convert", str(tiny_checkpoint("qwen2")), str(tmp_path / "out"), "-q"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_key_value_heads"] == 2


def test_help_lists_commands():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0 and "convert" in result.output and "demo" in result.output


def test_demo_runs_the_whole_pipeline_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("MHA2GQA_CACHE", str(tmp_path))
    args = [
        *["demo", "--steps", "3", "-g", "2", "--method", "mean", "--uptrain-steps", "4", "--output-dir"],
        str(tmp_path / "run"),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    rows = {ln.split()[0]: ln for ln in result.stdout.splitlines() if ln.startswith(("original", "mean"))}
    assert rows["original"].split()[-1] == "1.00x" and "mean -> 2 KV heads" in result.stdout
    assert (tmp_path / "run" / "report.html").is_file() and (tmp_path / "run" / "results" / "mean-g2.json").is_file()
    assert f"report: {tmp_path / 'run' / 'report.html'}" in result.stdout
    assert "mean+uptrain -> 2 KV heads" in result.stdout  # the conversion, then uptrained, both evaluated
    assert (tmp_path / "run" / "results" / "mean-g2-uptrained.json").is_file()
    assert "## Uptraining recovery" in (tmp_path / "run" / "report.md").read_text()
    folder = next(tmp_path.glob("demo-*"))
    assert (folder / "mha" / "model.safetensors").is_file() and (folder / "heldout-unseen.txt").is_file()
    again = CliRunner().invoke(main, [*args, "--overwrite"])  # its own earlier run: replaced when asked
    assert again.exit_code == 0 and "training the demo" not in again.output  # cached


def test_a_jobs_uptraining_that_hurts_is_undone_and_its_row_says_so(tmp_path, monkeypatch):
    """A job's uptraining at a learning rate that wrecks the model: its guard publishes the conversion as
    it was, the row is labelled undone and scores what the conversion scores, and the log says why."""
    from mha2gqa.jobs import DemoRequest, run_job

    monkeypatch.setenv("MHA2GQA_CACHE", str(tmp_path))
    job = DemoRequest(steps=3, num_kv_heads=(2,), methods=("svd",), uptrain_steps=4).job()
    job.uptrain = {**job.uptrain, "lr": 1.0, "eval_every": 2}
    lines: list[str] = []
    result = run_job(job, tmp_path / "run", log=lines.append)
    converted, uptrained = result.rows
    assert (converted.method, uptrained.method) == ("svd", "svd+uptrain(undone)")
    assert (uptrained.kl_mean, uptrained.top1) == (converted.kl_mean, converted.top1)
    assert any("guard: undone - held-out KL" in line for line in lines)


def test_a_jobs_refit_says_each_layer_and_the_guards_decisions_in_its_log(tmp_path, monkeypatch):
    """A job's conversion with ``--refit`` is not silent: each refitted layer and each decision of the
    stage guard reach the job's log (the demo's terminal) as they come, with its progress bars off."""
    from mha2gqa.jobs import DemoRequest, run_job

    monkeypatch.setenv("MHA2GQA_CACHE", str(tmp_path))
    job = DemoRequest(steps=3, num_kv_heads=(2,), methods=("svd+refit",), uptrain_steps=0).job()
    job.convert = {**job.convert, "refit_steps": 4}
    lines: list[str] = []
    run_job(job, tmp_path / "run", log=lines.append)
    layers = [line for line in lines if line.startswith("  layer ") and "held-out error" in line]
    assert len(layers) == 4, lines  # the demo model's 4 layers, one line each
    assert any(line.startswith("  guard: refit:") for line in lines), lines
    converted = next(i for i, line in enumerate(lines) if line.startswith("converted svd+refit-g2"))
    assert all(lines.index(line) < converted for line in layers)  # said while it ran, not after


def test_every_waiting_stage_of_a_job_says_so_within_5_seconds(tmp_path, monkeypatch):
    """A job logs each stage as it starts (conversion, uptraining set-up and evaluations, each
    evaluation's scoring, attention and samples, the report, comparison by comparison), so no line
    comes more than 5 s of work after the one before. Work is this process's CPU seconds over the
    threads torch uses, so that other jobs sharing the machine do not stretch the gaps."""
    import itertools
    import time

    import torch

    from mha2gqa.jobs import DemoRequest, run_job

    monkeypatch.setenv("MHA2GQA_CACHE", str(tmp_path))
    job = DemoRequest(steps=3, num_kv_heads=(2,), methods=("svd",), uptrain_steps=4).job()

    def stamp(line: str) -> tuple[float, float, str]:
        return time.process_time() / torch.get_num_threads(), time.monotonic(), line

    stamps = [stamp("start")]
    run_job(job, tmp_path / "run", log=lambda line: stamps.append(stamp(line)))
    stamps.append(stamp("end"))
    gaps = [(b[0] - a[0], b[1] - a[1], a[2]) for a, b in itertools.pairwise(stamps)]
    assert max(gaps)[0] < 5, max(gaps)  # (work, wall seconds, the line before the gap)
    text = "\n".join(line for _, _, line in stamps)
    for stage in ("converted svd-g2", "loading the student", "step 4/4: held-out perplexity", "evaluating svd-g2",
                  "scoring the converted model", "attention similarity", "sample generation", "verdict: ",
                  "rendering the report", "report: svd-g2-uptrained"):  # fmt: skip
        assert stage in text, stage


def test_the_demo_runs_on_a_pythia_style_gpt_neox_through_phi(tmp_path, monkeypatch):
    monkeypatch.setenv("MHA2GQA_CACHE", str(tmp_path))
    args = [
        *[
            "demo",
            "--architecture",
            "gpt_neox",
            "--steps",
            "3",
            "-g",
            "2",
            "--method",
            "svd",
            "--uptrain-steps",
            "0",
            "--output-dir",
        ],
        str(tmp_path / "run"),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    source = json.loads((next(tmp_path.glob("demo-*")) / "mha" / "config.json").read_text())
    assert source["architectures"] == ["GPTNeoXForCausalLM"]
    record = json.loads(next((tmp_path / "run").rglob("mha2gqa_conversion.json")).read_text())["conversion"]
    assert record["retarget"]["target_class"] == "PhiForCausalLM" and record["num_kv_heads_after"] == 2
    assert "svd -> 2 KV heads" in result.stdout


def test_every_shipped_job_file_loads(tmp_path):
    from mha2gqa.demo import DemoSettings
    from mha2gqa.jobs import load_job, shipped_jobs

    jobs = shipped_jobs()
    assert {"demo", "llama2-7b-gqa8"} <= set(jobs)
    for path in jobs.values():
        job = load_job(path)
        assert job.num_kv_heads and job.methods and job.eval.data
    demo = load_job(jobs["demo"])
    assert demo.source == "demo" and demo.demo == DemoSettings() and demo.num_kv_heads == (4, 1)
    assert demo.methods == ("mean", "svd", "svd+refit") and demo.convert["calibration"] == "demo-train"
    assert demo.uptrain["data"] == "demo-train" and demo.uptrain["max_steps"] > 0
    text = "wikitext:wikitext-2-raw-v1:train"
    assert demo.recipe(4, "svd+refit", text).convert.refit and not demo.recipe(4, "svd", text).convert.refit


def test_shipped_jobs_for_real_models_follow_the_readmes_advice():
    """Every shipped job of a real model converts with the recipe the README recommends, calibrated on
    other text than it is evaluated on, and gates no looser than the verdict's borderline bounds."""
    from mha2gqa.eval.verdict import THRESHOLDS
    from mha2gqa.jobs import RECOMMENDED, load_job, shipped_jobs

    method, _, step = RECOMMENDED.partition("+")
    advice = (Path(__file__).parents[1] / "README.md").read_text().split("## Which method to use")[1].split("\n## ")[0]
    assert f"--method {method} --calibration TEXT" in advice and f"`--{step}`" in advice
    bounds = {t.figure: t.borderline for t in THRESHOLDS}
    real = {name: load_job(path) for name, path in shipped_jobs().items() if name != "demo"}
    assert real
    for name, job in real.items():
        assert job.methods == (RECOMMENDED,), name
        assert job.convert["calibration"] and job.convert["calibration"] != job.eval.data, name
        g = job.gates
        assert g.max_ppl_ratio is not None and g.max_ppl_ratio <= bounds["ppl_ratio"], name
        assert g.max_kl is not None and g.max_kl <= bounds["kl_mean"], name
        assert g.min_top1 is not None and g.min_top1 >= bounds["top1_agreement"], name


def test_bad_job_files_are_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    for text, message in [
        (
            "source: demo\neval: {data: demo-heldout}\nconvert: {num_kv_heads: 2, methodz: [mean]}\n",
            "unknown key 'convert.methodz'",
        ),
        ("eval: {data: demo-heldout}\nconvert: {num_kv_heads: 2}\n", "'source' is required"),
        (
            "source: demo\neval: {data: demo-heldout}\nconvert: {num_kv_heads: 2, methods: [magic]}\n",
            "convert.methods 'magic': choose one of",
        ),
        (
            "source: demo\ndemo: {hidden: 3}\neval: {data: demo-heldout}\nconvert: {num_kv_heads: 2}\n",
            "unknown key 'demo.hidden'",
        ),
        (
            "source: demo\neval: {data: demo-heldout}\nconvert: {num_kv_heads: 2}\nuptrain: {max_steps: 3}\n",
            "uptrain.data is required",
        ),
        (
            "source: demo\neval: {data: demo-heldout}\nconvert: {num_kv_heads: 2}\n"
            "uptrain: {data: demo-train, output: y}\n",
            "unknown key 'uptrain.output'",
        ),
        (  # every entry of the sweep is checked, not only the first: auto allocation and given counts clash
            "source: demo\neval: {data: demo-heldout}\nconvert: {num_kv_heads: [2, '2,1,2,1'], per_layer: auto, "
            "calibration: demo-train, methods: [svd]}\n",
            "auto chooses each layer's count",
        ),
        (  # settings the job decides itself (job=False on their spec) are not job-file keys
            "source: demo\neval: {data: demo-heldout, progress: false}\nconvert: {num_kv_heads: 2}\n",
            "unknown key 'eval.progress'",
        ),
        (
            "source: demo\neval: {data: demo-heldout}\nconvert: {num_kv_heads: 2}\n"
            "uptrain: {data: demo-train, resume: true}\n",
            "unknown key 'uptrain.resume'",
        ),
    ]:
        bad.write_text(text)
        result = CliRunner().invoke(main, ["run", str(bad)])
        assert result.exit_code == 1 and message in result.output, result.output


def test_a_job_file_is_checked_whole_before_anything_is_written(tmp_path):
    """Values of every section are checked against the same settings as the command line, and a
    bad one is reported (named as the job file names it) before any model is trained or written."""
    out = tmp_path / "out"
    base = "source: demo\nconvert: {num_kv_heads: [2], methods: [mean]}\neval: {data: demo-heldout}\n"
    for extra, message in [
        ("eval: {data: demo-heldout, seq_len: long}\n", "eval.seq_len must be an integer"),
        ("uptrain: {data: demo-train, lr: fast}\n", "uptrain.lr must be a number"),
        ("uptrain: {data: demo-train, weight_decay: .nan}\n", "uptrain.weight_decay must be a finite number"),
        ("eval: {data: demo-heldout, protocols: disjoint}\n", "eval.protocols must be a list"),
        ("convert: {num_kv_heads: [4, 0]}\n", "convert.num_kv_heads must be at least 1"),
        ("convert: {num_kv_heads: 2, calibration_tokens: 0}\n", "convert.calibration_tokens must be at least 1"),
        ("convert: {num_kv_heads: 2, methods: [svd]}\n", "needs calibration text: pass convert.calibration"),
        ("gates: {max_kl: -1}\n", "gates.max_kl must be at least 0"),
        ("demo: {steps: 0}\n", "demo.steps must be at least 1"),
        ("report: maybe\n", "'report' must be true or false"),
    ]:
        job = tmp_path / "job.yaml"
        job.write_text(base + extra)
        result = CliRunner().invoke(main, ["run", str(job), "--output-dir", str(out)])
        assert result.exit_code == 1 and message in result.output, (extra, result.output)
        assert not out.exists() and not list(tmp_path.glob("demo-*"))


def test_library_errors_name_the_setting_and_the_cli_its_flag(tiny_checkpoint, tmp_path):
    import pytest

    from mha2gqa.convert import convert_checkpoint
    from mha2gqa.core.errors import SettingError

    src = tiny_checkpoint("llama")
    with pytest.raises(SettingError, match=r"^calibration_tokens must be at least 1") as e:
        convert_checkpoint(src, tmp_path / "o", 2, "svd", calibration="x", calibration_tokens=0)
    assert e.value.setting == "calibration_tokens"
    result = CliRunner().invoke(
        main, ["convert", str(src), str(tmp_path / "o"), "-g", "2", "--calibration-tokens", "-1"]
    )
    assert result.exit_code == 1 and "--calibration-tokens must be at least 1 (got -1)" in result.output
    assert not (tmp_path / "o").exists()


def test_a_job_rerun_replaces_its_previous_run_wholly(tmp_path, monkeypatch):
    """A re-run needs --overwrite, and with other settings never leaves the previous run's results
    beside the new ones."""
    monkeypatch.setenv("MHA2GQA_CACHE", str(tmp_path))
    out = tmp_path / "run"
    base = ["demo", "--steps", "3", "--uptrain-steps", "0", "--output-dir", str(out)]
    assert CliRunner().invoke(main, [*base, "-g", "2", "--method", "mean"]).exit_code == 0
    assert (out / "results" / "mean-g2.json").is_file()
    again = CliRunner().invoke(main, [*base, "-g", "4", "--method", "first"])  # careful as convert: refused ...
    assert again.exit_code == 1 and "exists and is not empty: pass --overwrite" in again.output
    assert sorted(p.name for p in (out / "results").iterdir()) == ["mean-g2.json"]
    assert CliRunner().invoke(main, [*base, "-g", "4", "--method", "first", "--overwrite"]).exit_code == 0
    assert sorted(p.name for p in (out / "results").iterdir()) == ["first-g4.json"]
    assert sorted(p.name for p in (out / "models").iterdir()) == ["first-g4"]
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    result = CliRunner().invoke(
        main, ["demo", "--steps", "3", "--uptrain-steps", "0", "-g", "2", "--output-dir", str(foreign), "--overwrite"]
    )
    assert result.exit_code == 1 and "was not written by mha2gqa" in result.output
    assert (foreign / "notes.txt").read_text() == "keep"


def test_a_job_says_each_note_once_however_many_stages_repeat_it():
    from mha2gqa.jobs import _NotesOnce

    lines: list[str] = []
    log = _NotesOnce(lines.append)
    for tag in ("mean-g4", "svd-g4"):
        log("note: training windows of 128 tokens do not reach positions 128-255", f"  {tag}: ")
        log("step 0/30: held-out perplexity 1.0", f"  {tag}: ")
    assert lines == [
        "  mean-g4: note: training windows of 128 tokens do not reach positions 128-255",
        "  mean-g4: step 0/30: held-out perplexity 1.0",
        "  svd-g4: step 0/30: held-out perplexity 1.0",
    ]


def test_a_model_refused_for_what_it_is_is_refused_for_that_before_its_missing_weights(tmp_path):
    folder = tmp_path / "foo"
    folder.mkdir()
    config = {"architectures": ["FooForCausalLM"], "model_type": "foo", "num_attention_heads": 8, "hidden_size": 64}
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    text = tmp_path / "t.txt"
    text.write_text("some text " * 50)
    conv = CliRunner().invoke(main, ["convert", str(folder), str(tmp_path / "out"), "-g", "1"])
    assert conv.exit_code == 1 and "unsupported model family (FooForCausalLM)" in conv.output
    assert "no model.safetensors" not in conv.output
    for argv in (["eval", "--original", str(folder), "--data", str(text)],
                 ["uptrain", str(folder), "--data", str(text), "--output", str(tmp_path / "up")]):  # fmt: skip
        res = CliRunner().invoke(main, argv)
        assert res.exit_code == 1 and "not a model type this transformers knows" in res.output, res.output
        assert "no model.safetensors" not in res.output and len(res.output) < 300
