"""Report, gates, KV-cache planner and decode benchmark."""

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import (
    FIXTURES,
    LLAMA2_7B,
    bench_argv,
    eval_argv,
    llama_with_tokenizer,
    requires_fixtures,
    story_text,
    tiny_config,
)

from mha2gqa.cli import main
from mha2gqa.convert import convert_checkpoint
from mha2gqa.core.units import parse_size
from mha2gqa.eval.gates import GATE_EXIT_CODE
from mha2gqa.eval.tables import OVERVIEW_COLUMNS
from mha2gqa.serving.sizing import capacity_rows, model_shape


def test_planner_matches_hand_calculations_for_llama2_7b():
    shape = model_shape(LLAMA2_7B)
    assert shape.parameters == 6_738_415_616  # Llama-2-7B
    rows = {r.num_kv_heads: r for r in capacity_rows(shape, parse_size("80GB"), 4096, "fp16", 2)}
    assert set(rows) == {32, 16, 8, 4, 2, 1}
    assert rows[32].kv_bytes_per_token == 524_288 and rows[8].kv_bytes_per_token == 131_072
    assert rows[32].kv_bytes_per_sequence == 524_288 * 4096
    # 8 KV heads remove 24 heads x 128 rows x 4096 of K and of V in each of 32 layers
    assert rows[32].weights_bytes - rows[8].weights_bytes == 2 * 32 * 24 * 128 * 4096 * 2
    assert rows[32].max_sequences == (80 * 10**9 - 6_738_415_616 * 2) // (524_288 * 4096)
    assert parse_size("24GiB") == 24 * 2**30 and parse_size("500MB") == 500 * 10**6


def test_throughput_estimate_matches_a_hand_calculation_and_plots(tmp_path):
    """Llama-2-7B, bf16 weights and KV cache, 80 GB at 3.35 TB/s, 4,096-token sequences."""
    from mha2gqa.serving.sizing import GPUS, throughput

    shape = model_shape(LLAMA2_7B)
    gpu = GPUS["h100-sxm"]
    assert (gpu.memory, gpu.bandwidth) == (80 * 10**9, 3.35e12)
    rows = capacity_rows(shape, gpu.memory, 4096, "bf16", 2)
    speed = {t.num_kv_heads: t for t in throughput(shape, rows, gpu, 4096, 0.5)}
    weights = 6_738_415_616 * 2  # 13.48 GB
    kv_read = 524_288 * 2048  # MHA: 512 KiB per token at the mean context of 2,048 tokens
    assert speed[32].max_batch == 30  # (80e9 - 13.48e9) // 2 GiB per sequence
    assert speed[32].step_seconds_batch1 == pytest.approx((weights + kv_read) / 3.35e12)  # 4.343 ms
    assert speed[32].tokens_per_second_batch1 == pytest.approx(230.2, abs=0.05)
    assert speed[32].tokens_per_second_aggregate_max == pytest.approx(30 * 3.35e12 / (weights + 30 * kv_read))
    assert speed[32].tokens_per_second_aggregate_max == pytest.approx(2199.7, abs=0.1)
    g8_weights = weights - 2 * 32 * 24 * 128 * 4096 * 2
    assert speed[8].tokens_per_second_batch1 == pytest.approx(3.35e12 / (g8_weights + kv_read / 4))
    # prefill: 2 x (parameters - the untied input embedding) x T + 2 x L x H x d x T^2 at 50% of 989 TFLOP/s
    flops = 2 * (6_738_415_616 - 32000 * 4096) * 4096 + 2 * 32 * 32 * 128 * 4096**2
    assert speed[32].prefill_seconds == pytest.approx(flops / (989e12 * 0.5))
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    out = CliRunner().invoke(main, ["plan", str(tmp_path), "--gpu", "h100-sxm", "--plot", str(tmp_path / "t.png")])
    assert out.exit_code == 0, out.output
    assert re.search(r"^\s+32\s.*\s30\s+230\.2\s+73\.3\s+2,200\s+118 ms$", out.output, re.M), out.output
    png = (tmp_path / "t.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert out.output.rstrip().endswith(f"plot: {tmp_path / 't.png'}")
    bad = CliRunner().invoke(main, ["plan", str(tmp_path), "--plot", str(tmp_path / "u.png")])
    assert bad.exit_code == 1 and "--gpu" in bad.output and "Traceback" not in bad.output


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "stablelm", "olmo2", "gemma"])
def test_parameter_count_per_kv_head_matches_the_real_model(family):
    cfg = tiny_config(family)
    shape = model_shape(json.loads(cfg.to_json_string()))
    smaller = json.loads(tiny_config(family, num_key_value_heads=1).to_json_string())
    assert shape.parameters_at(1) == model_shape(smaller).parameters


def test_inspect_and_plan_cli(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    out = CliRunner().invoke(main, ["inspect", str(tmp_path), "--json"])
    info = json.loads(out.output)
    assert info["kv_cache_bytes_per_token"]["fp16"] == 524_288 and info["parameters"] == 6_738_415_616
    text = CliRunner().invoke(main, ["plan", str(tmp_path), "--gpu-memory", "80GB", "--seq-len", "4096"]).output
    assert re.search(r"^\s+8\s+131,072\s+512\.00 MiB", text, re.M), text


def test_inspect_and_plan_size_for_the_models_own_positions(tmp_path):
    """A 256-position model is sized at 256 tokens a sequence, not at 4,096; a longer --seq-len is said."""
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA2_7B, "max_position_embeddings": 256}))
    info = json.loads(CliRunner().invoke(main, ["inspect", str(tmp_path), "--json"]).output)
    assert info["seq_len"] == 256 and info["kv_cache_bytes"]["fp16"] == 524_288 * 256
    longer = CliRunner().invoke(main, ["inspect", str(tmp_path), "--seq-len", "1000"]).output
    assert "note: 1,000-token sequences are longer than the model's 256 positions" in longer
    plan = CliRunner().invoke(main, ["plan", str(tmp_path), "--gpu-memory", "80GB"]).output
    assert "256-token sequences" in plan and "longer than" not in plan
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA2_7B, "max_position_embeddings": 32768}))
    assert json.loads(CliRunner().invoke(main, ["inspect", str(tmp_path), "--json"]).output)["seq_len"] == 4096


def eval_args(pair, *extra):
    src, conv, text = pair
    return eval_argv(src, conv, text, "64", "1200", "-q", *extra)


def test_gates_pass_and_fail_with_the_documented_exit_code(pair, tmp_path):
    ok = CliRunner().invoke(main, eval_args(pair, "--max-ppl-ratio", "1000", "--max-kl", "100", "--min-top1", "0"))
    assert ok.exit_code == 0 and ok.output.strip().splitlines()[-2].startswith("gates passed: ppl_ratio[disjoint]")
    out = tmp_path / "r.json"
    bad = CliRunner().invoke(
        main, eval_args(pair, "--max-ppl-ratio", "1.0000001", "--max-kl", "0", "--min-top1", "1", "--output", str(out))
    )
    assert bad.exit_code == GATE_EXIT_CODE == 3
    line = bad.output.strip().splitlines()[-2]  # the verdict follows, last
    assert bad.output.strip().splitlines()[-1].startswith("verdict: ")
    assert line.startswith("GATES FAILED: ") and all(
        g in line for g in ("ppl_ratio[disjoint]", "kl_mean", "top1_agreement")
    )
    record = json.loads(out.read_text())["gates"]
    assert record["passed"] is False and len(record["checks"]) == 3
    one_failing = CliRunner().invoke(main, eval_args(pair, "--max-ppl-ratio", "1000", "--min-top1", "1"))
    gates_line = next(line for line in one_failing.output.splitlines() if line.startswith("GATES FAILED"))
    assert one_failing.exit_code == 3 and "kl_mean" not in gates_line and "top1_agreement" in gates_line
    src, _, text = pair
    alone = CliRunner().invoke(main, ["eval", "--original", str(src), "--data", str(text), "--max-kl", "1"])
    assert alone.exit_code == 1 and "pass --converted" in alone.output


def test_report_has_every_section_and_image(pair, tmp_path):
    out = tmp_path / "r.json"
    assert (
        CliRunner()
        .invoke(main, eval_args(pair, "--output", str(out), "--protocol", "disjoint", "--protocol", "rolling"))
        .exit_code
        == 0
    )
    html, md = tmp_path / "report.html", tmp_path / "report.md"
    result = CliRunner().invoke(main, ["report", str(out), str(out), "--html", str(html), "--md", str(md)])
    assert result.exit_code == 0, result.output
    page = html.read_text()
    for section in (
        *[
            "overview",
            "perplexity-0",
            "output-agreement-0",
            "kl-report-llama-cpp-style-0",
            "attention-per-layer-0",
            "kv-cache-0",
        ],
    ):
        assert f'id="{section}"' in page, section
    assert "<th>KL(converted ‖ original)</th>" in page and "correlation of per-token NLLs" in page
    figures = (
        *[
            "attention_kl",
            "head_output_error",
            "entropy",
            "hidden_cosine",
            "head_similarity_curve",
            "head_similarity",
            "head_sharing",
        ],
    )
    for fig in figures:
        m = re.search(rf'<figure id="{fig}-0"><img alt="{fig}" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
        assert m and len(m.group(1)) > 1000, fig
    assert page.count("<img ") == 2 * len(figures) + 1  # two results x the figures, and the quality-vs-KV chart
    assert '<figure id="quality"><img alt="quality"' in page
    overview = page[page.index('id="overview"') : page.index('id="result-0"')]  # the first screen
    for column in OVERVIEW_COLUMNS:
        assert re.search(rf'<th( class="text")?>{re.escape(column)}</th>', overview), column
    assert ">gates</th>" not in overview  # no gate was asked for
    assert overview.count('<a href="#result-0">') >= 1 and '<a href="#result-1">' in overview
    assert "worst layers by attention KL" in overview and "worst heads by contribution error" in overview
    assert page.count("<details") == 2 and "<summary>" in page  # sections collapsed below the overview
    text = md.read_text()
    assert "| protocol | original PPL | converted PPL | ratio |" in text and "rolling" in text
    assert (tmp_path / "report_files" / "0_attention_kl.png").stat().st_size > 1000
    bogus = tmp_path / "bogus.json"
    bogus.write_text("{}")
    assert CliRunner().invoke(main, ["report", str(bogus)]).exit_code == 1


def test_kv_cache_table_saving(pair, tmp_path):
    from mha2gqa.eval.results import ModelInfo, Results
    from mha2gqa.eval.tables import kv_rows

    shape = {"num_layers": 32, "num_heads": 32, "head_dim": 128, "dtype": "bfloat16"}
    models = {
        "original": ModelInfo("a", num_kv_heads=32, **shape),
        "converted": ModelInfo("b", num_kv_heads=8, **shape),
    }
    rows = kv_rows(Results("mha2gqa.eval/1", "", {}, models, {}, {}, {}))
    assert rows[0][3] == "524,288" and rows[1][3] == "131,072" and rows[2][3] == "75.0%"


def test_bench_measures_a_cache_of_g_heads_as_planned(pair, tmp_path):
    src, conv, _ = pair
    out = tmp_path / "b.json"
    result = CliRunner().invoke(
        main,
        bench_argv(src, conv, out, "--prompt-len 32 --new-tokens 8 --repeats 2"),
    )
    assert result.exit_code == 0, result.output
    b = json.loads(out.read_text())
    for name, heads in (("original", 4), ("converted", 2)):
        kv = b["models"][name]["kv_cache"]
        assert b["models"][name]["num_kv_heads"] == heads
        assert abs(kv["measured_bytes"] / kv["planned_bytes"] - 1) < 0.05
        assert kv["bytes_per_token"] == 2 * 2 * heads * 8 * 4  # K and V, 2 layers, head_dim 8, fp32
    assert b["converted_vs_original"]["kv_cache_ratio"] == pytest.approx(0.5, rel=0.05)
    # plan --bench puts the measurement beside the roofline estimate of the same model
    text = CliRunner().invoke(
        main, ["plan", str(src), "--bandwidth", "50GB/s", "--seq-len", "64", "--dtype", "fp32", "--bench", str(out)]
    )
    assert text.exit_code == 0, text.output
    assert re.search(r"original \(4 KV heads\): measured [\d,.]+ tok/s, estimate [\d,.]+ tok/s", text.output)
    assert "converted (2 KV heads)" in text.output
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(LLAMA2_7B))
    wrong = CliRunner().invoke(main, ["plan", str(other), "--bandwidth", "50GB", "--bench", str(out)])
    assert wrong.exit_code == 1 and "is not this model" in wrong.output


#: A ``bench --output`` file as mha2gqa wrote it before the record was typed (commit 420da7d).
BENCH_WRITTEN_BEFORE = {
    "schema": "mha2gqa.bench/1",
    "settings": {"prompt_len": 32, "new_tokens": 8, "batch_size": 1, "repeats": 2, "warmup": 1, "device": "cpu",
                 "dtype": "torch.float32", "device_name": "CPU"},
    "models": {
        "original": {"path": "/m/src", "prefill_seconds": {"median": 0.01, "min": 0.009, "max": 0.012},
                     "decode_tokens_per_second": {"median": 250.0, "min": 240.0, "max": 260.0},
                     "kv_cache": {"measured_bytes": 10240, "planned_bytes": 10240, "cached_tokens": 40,
                                  "bytes_per_token": 256.0, "dtype_bytes": 4},
                     "num_kv_heads": 4, "parameters": 123456},
    },
}  # fmt: skip


def test_a_bench_file_written_before_reads_and_bad_values_are_refused_in_one_line(tmp_path):
    from mha2gqa.core.bench_record import BenchRecord
    from mha2gqa.core.errors import Mha2GqaError
    from mha2gqa.eval.bench import bench_lines

    path = tmp_path / "b.json"
    path.write_text(json.dumps(BENCH_WRITTEN_BEFORE))
    record = BenchRecord.load(path)
    assert record.models["original"].kv_cache.planned_bytes == 10240
    assert record.settings.device_name == "CPU" and record.converted_vs_original is None
    assert "250.0 [240.0-260.0]" in "\n".join(bench_lines(record))
    assert {k: v for k, v in record.to_dict().items() if v is not None} == BENCH_WRITTEN_BEFORE  # same file back
    for where, bad, says in (
        (("settings", "batch_size"), 0, "settings.batch_size is 0, not positive"),
        (("settings", "prompt_len"), "32", "settings.prompt_len is not an integer"),
        (("models", "original", "decode_tokens_per_second", "median"), float("nan"), "median is nan, not positive"),
        (("models", "original", "num_kv_heads"), None, "models.original.num_kv_heads is not an integer"),
    ):
        data = json.loads(json.dumps(BENCH_WRITTEN_BEFORE))
        node = data
        for key in where[:-1]:
            node = node[key]
        node[where[-1]] = bad
        path.write_text(json.dumps(data))
        with pytest.raises(Mha2GqaError) as e:
            BenchRecord.load(path)
        assert str(path) in str(e.value) and says in str(e.value) and "\n" not in str(e.value), str(e.value)


#: An uptraining run's log as mha2gqa wrote it before its records were typed (commit 8e98ff6: stopped
#: at step 2, resumed, finished), and the run's uptraining record (settings shortened).
RUN_LOG_WRITTEN_BEFORE = [
    {
        "type": "start",
        "created": "2026-11-26T04:45:48+00:00",
        "student": "/tmp/oldlog/student",
        "teacher": "/work/shared/fixtures/stories260K-mha-expanded",
        "settings": {
            "objective": "mix",
            "train": "all",
            "max_steps": 4,
            "seq_len": 64,
            "batch_size": 2,
            "lr": 0.0001,
            "data": "/tmp/oldlog/train.txt",
            "eval_data": "/tmp/oldlog/held.txt",
            "teacher": "/work/shared/fixtures/stories260K-mha-expanded",
        },
        "windows": 148,
        "tokens_per_step": 128,
        "total_steps": 4,
        "trainable_parameters": 260032,
        "parameters": 260032,
        "num_heads": 8,
        "num_kv_heads": 4,
        "processes": 1,
        "device": "cpu",
        "mixed_precision": "no",
        "eval_seq_len": 64,
    },
    {
        "nll": 2.093757992699033,
        "eval_tokens": 63,
        "ppl": 8.115355377690307,
        "teacher_ppl": 8.115355377690307,
        "ppl_ratio": 1.0,
        "kl_mean": 0.0,
        "top1_agreement": 1.0,
        "type": "eval",
        "step": 0,
        "tokens": 0,
        "seq_len": 64,
    },
    {
        "type": "train",
        "step": 2,
        "tokens": 256,
        "epoch": 0.027,
        "loss": 0.8314338028430939,
        "ce": 1.6624085903167725,
        "kd": 0.0004589935124386102,
        "lr": 5.500000000000001e-05,
        "grad_norm": 3.2500643730163574,
        "tokens_per_second": 2197.6435065569294,
        "step_seconds": 0.05824420549470233,
        "peak_memory_mib": [509.6],
    },
    {
        "nll": 2.0863499717106895,
        "eval_tokens": 63,
        "ppl": 8.05545878624849,
        "teacher_ppl": 8.115355377690307,
        "ppl_ratio": 0.9926193507672533,
        "kl_mean": 0.0010883621765338878,
        "top1_agreement": 1.0,
        "type": "eval",
        "step": 2,
        "tokens": 256,
        "seq_len": 64,
    },
    {
        "type": "resume",
        "step": 2,
        "created": "2026-11-26T04:46:00+00:00",
        "from": "/tmp/oldlog/run/checkpoints/step-0000002",
    },
    {
        "type": "train",
        "step": 4,
        "tokens": 512,
        "epoch": 0.0541,
        "loss": 0.8365761637687683,
        "ce": 1.6716087460517883,
        "kd": 0.0015435704262927175,
        "lr": 1e-05,
        "grad_norm": 2.8312723636627197,
        "tokens_per_second": 2119.527595954687,
        "step_seconds": 0.060390815502614714,
        "peak_memory_mib": [505.7],
    },
    {
        "nll": 2.085477072095114,
        "eval_tokens": 63,
        "ppl": 8.048430247421395,
        "teacher_ppl": 8.115355377690307,
        "ppl_ratio": 0.9917532717725592,
        "kl_mean": 0.0015257090788275542,
        "top1_agreement": 1.0,
        "type": "eval",
        "step": 4,
        "tokens": 512,
        "seq_len": 64,
    },
    {"type": "end", "step": 4, "tokens": 512, "created": "2026-11-26T04:46:01+00:00", "seconds": 1.3226108599992585},
]
UPTRAIN_RECORD_WRITTEN_BEFORE = {
    "schema": "mha2gqa.uptrain/1",
    "uptrain": {
        "student": "/tmp/oldlog/student",
        "settings": {**RUN_LOG_WRITTEN_BEFORE[0]["settings"], "min_lr_ratio": 0.1},  # as the log has them
        "steps": 4,
        "tokens": 512,
        "warmup_steps": 0,
        "trainable_parameters": 260032,
        "processes": 1,
        "mixed_precision": "no",
        "first_eval": RUN_LOG_WRITTEN_BEFORE[1],  # the log's eval records, as the record embeds them
        "last_eval": RUN_LOG_WRITTEN_BEFORE[-2],
    },
    "mha2gqa_version": "0.1.0",
    "created": "2026-11-26T04:46:00+00:00",
}


def test_a_run_log_written_before_reads_typed_and_writes_back_the_same_records(tmp_path):
    from mha2gqa.core.errors import Mha2GqaError
    from mha2gqa.core.runlog import RunEval, RunHistory, RunLog, RunResume, RunStart, RunTrain, read_log, to_json
    from mha2gqa.eval.tables import overview_table, recovery_table
    from mha2gqa.uptrain.record import UptrainRecord

    run = tmp_path / "run-old"
    run.mkdir()
    log = run / "uptrain_log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in RUN_LOG_WRITTEN_BEFORE))
    records = read_log(log)
    assert [type(r) for r in records[:3]] == [RunStart, RunEval, RunTrain] and isinstance(records[4], RunResume)
    assert records[0].objective == "mix" and records[0].num_kv_heads == 4 and records[2].parts.keys() == {"ce", "kd"}
    assert records[4].from_.endswith("step-0000002") and records[2].peak_memory_mib == [509.6]
    assert [to_json(r) for r in records] == RUN_LOG_WRITTEN_BEFORE  # every key and value as written
    history = RunHistory.read(run)
    assert history.label == "run-old" and history.steps == 4 and [e.step for e in history.evals] == [0, 2, 4]
    row = recovery_table([history]).markdown()
    assert "| run-old | mix | all | 4 / 4 | 512 | 8.115 → 8.048 (63 tok) | 1.000x → 0.992x | 0.0000 → 0.0015 |" in row
    assert (
        "| [run-old](#uptraining) | uptrain | 4 | - | 8.115 → 8.048 | 63 | 0.992x | 0.0015 |"
        in overview_table([], [history]).markdown()
    )
    with pytest.warns(UserWarning):  # a resume at step 2 keeps what was whole up to it, as written
        with log.open("a") as f:
            f.write('{"type": "tra')
        RunLog(log, keep_until_step=2)
    assert [json.loads(x) for x in log.read_text().splitlines()] == RUN_LOG_WRITTEN_BEFORE[:5]
    record = UptrainRecord.from_dict(UPTRAIN_RECORD_WRITTEN_BEFORE, "old.json")
    assert record.last_eval == records[-2] and "×0.992 the teacher, KL 0.0015" in record.card(None)
    log.write_text(log.read_text().replace('"ppl": 8.05545878624849', '"ppl": "8.06"'))
    with pytest.raises(Mha2GqaError, match=r"uptrain_log.jsonl: line 4 \(eval\)\.ppl is not a number"):
        RunHistory.read(run)
    for bad, says in (("NaN", "ppl is nan, not a positive number"), ("-8.06", "ppl is -8.06, not a positive number")):
        log.write_text(log.read_text().replace('"ppl": "8.06"', f'"ppl": {bad}').replace('"ppl": NaN', f'"ppl": {bad}'))
        with pytest.raises(Mha2GqaError, match=f"line 4 \\(eval\\)\\.{says}"):
            RunHistory.read(run)


def test_a_results_file_written_before_reads_and_writes_back_the_same(tmp_path):
    """``tests/data/results_written_before.json``: every section (three protocols, the llama.cpp-style
    agreement, attention with head similarity, samples, the reference cache, an int8 yardstick, gates,
    the verdict) as the harness wrote it before evaluate() returned Results."""
    from mha2gqa.eval.report import render
    from mha2gqa.eval.results import Results
    from mha2gqa.eval.summary import summary_lines

    path = Path(__file__).parent / "data" / "results_written_before.json"
    written = json.loads(path.read_text())
    r = Results.load(path)

    def present(x):  # a null and an absent optional field read the same
        if isinstance(x, dict):
            return {k: present(v) for k, v in x.items() if v is not None}
        return [present(v) for v in x] if isinstance(x, list) else x

    assert present(r.to_dict()) == present(written)
    assert Results.from_dict(r.to_dict(), str(path)) == r
    alone = {k: v for k, v in written.items() if k not in ("agreement", "attention", "samples", "reference")}
    alone = {**alone, "quantization": {}, "gates": None, "verdict": None}  # (a lone model has none of them)
    alone["models"] = {"original": written["models"]["original"]}
    alone["protocols"] = {
        n: {k: v for k, v in p.items() if k not in ("converted", "ppl_ratio")} for n, p in written["protocols"].items()
    }
    assert set(Results.from_dict(alone, "alone.json").to_dict()) == {k for k, v in alone.items() if v}
    assert r.attention.layers[0].heads[0].js == written["attention"]["layers"][0]["heads"][0]["js"]
    assert r.reference.form == "exact" and r.gates.passed and r.quantization["int8"].agreement.kl.count > 0
    assert any(line.startswith("agreement: KL mean") for line in summary_lines(r))
    pages = render([r], tmp_path / "r.html", tmp_path / "r.md")
    assert "Overview" in pages["md"].read_text()


@requires_fixtures("stories260K-mha-expanded", "text")
def test_report_renders_for_a_real_fixture_pair(tmp_path):
    src = FIXTURES / "stories260K-mha-expanded"
    conv = convert_checkpoint(src, tmp_path / "g2", 2, progress=False).output
    out = tmp_path / "r.json"
    data = FIXTURES / "text" / "tinystories_train_head.txt"
    args = eval_argv(src, conv, data, "256", "4096", "--output", out, "-q")
    assert CliRunner().invoke(main, args).exit_code == 0
    assert CliRunner().invoke(main, ["report", str(out), "--html", str(tmp_path / "r.html")]).exit_code == 0
    page = (tmp_path / "r.html").read_text()
    assert page.count("<img ") == 8 and "g2 vs stories260K-mha-expanded" in page


def test_the_first_screen_gives_the_gate_verdict(pair, tmp_path):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    assert CliRunner().invoke(main, eval_args(pair, "--output", str(good), "--max-ppl-ratio", "1000")).exit_code == 0
    assert CliRunner().invoke(main, eval_args(pair, "--output", str(bad), "--max-kl", "0")).exit_code == 3
    html = tmp_path / "r.html"
    assert CliRunner().invoke(main, ["report", str(good), "--html", str(html)]).exit_code == 0
    assert '<div class="verdict pass">All gates passed (1 comparison)</div>' in html.read_text()
    assert CliRunner().invoke(main, ["report", str(good), str(bad), "--html", str(html), "--overwrite"]).exit_code == 0
    page = html.read_text()
    first = page[: page.index('id="result-0"')]
    assert '<div class="verdict fail">GATES FAILED in 1 of 2: ' in first and "(kl_mean)" in first
    assert '<td class="text pass">pass</td>' in first and '<td class="text fail">FAIL: kl_mean</td>' in first
    assert '<th class="text">gates</th>' in first
    samples = page[page.index('id="sample-generations-0"') :]  # text columns: left-aligned
    assert '<th class="text">prompt</th><th class="text">original</th><th class="text">converted</th>' in samples


def test_bench_defaults_fit_a_short_model(tmp_path):
    """512 prompt + 64 new tokens do not fit 64 positions: the defaults shrink to fit."""
    text = story_text(tmp_path / "t.txt")
    src = llama_with_tokenizer(tmp_path / "mha", text, max_positions=64)
    out = tmp_path / "b.json"
    result = CliRunner().invoke(main, ["bench", "--original", str(src), "--repeats", "1", "--output", str(out)])
    assert result.exit_code == 0, result.output
    settings = json.loads(out.read_text())["settings"]
    assert settings["prompt_len"] + settings["new_tokens"] <= 64 and settings["new_tokens"] >= 2
    too_long = ["bench", "--original", str(src), "--prompt-len", "60", "--new-tokens", "8"]
    assert "exceeds the model's 64 positions" in CliRunner().invoke(main, too_long).output


def test_plan_and_inspect_of_a_well_known_hub_id_work_offline(monkeypatch):
    """The hub unreachable: the shipped copy of a well-known model's config plans it, and says so."""
    from mha2gqa.serving.sizing import known_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = CliRunner().invoke(main, ["plan", "meta-llama/Llama-2-7b-hf", "--gpu", "h100-sxm"])
    assert out.exit_code == 0 and "mha2gqa's copy of its config" in out.output
    assert re.search(r"^\s+8\s+131,072", out.output, re.M), out.output  # the same sizes as its real config
    info = json.loads(CliRunner().invoke(main, ["inspect", "meta-llama/Llama-2-7b-hf", "--json"]).stdout)
    assert info["parameters"] == 6_738_415_616
    assert model_shape(known_config("google/gemma-7b")).dims.head_dim == 256
    unknown = CliRunner().invoke(main, ["plan", "someone/not-a-known-model"])
    assert unknown.exit_code == 1 and "cannot be fetched from the hub" in unknown.output


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        (("protocols", "disjoint", "converted", "ppl"), "NaN", r"protocols.disjoint.converted.ppl is nan"),
        (("protocols", "disjoint", "original", "nll"), "-1.5", r"protocols.disjoint.original.nll is -1.5"),
        (("agreement", "kl", "mean"), "Infinity", r"agreement.kl.mean is inf"),
        (("agreement", "top1_agreement"), "1.7", r"agreement.top1_agreement is 1.7"),
        (("protocols", "disjoint", "ppl_ratio"), "0", r"protocols.disjoint.ppl_ratio is 0"),
    ],
)
def test_report_refuses_a_results_file_holding_numbers_eval_never_writes(field, value, pattern, tmp_path):
    """A results file with a NaN perplexity, an infinite KL or a sign edited in: ``report`` (and a
    gate) refuse it in one line naming the file and the field, instead of a page showing "nan"."""
    import re

    written = json.loads((Path(__file__).parent / "data" / "results_written_before.json").read_text())
    node = written
    for key in field[:-1]:
        node = node[key]
    node[field[-1]] = "@@"
    damaged = tmp_path / "damaged.json"
    damaged.write_text(json.dumps(written).replace('"@@"', value))
    result = CliRunner().invoke(main, ["report", str(damaged), "--html", str(tmp_path / "r.html")])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    (line,) = result.output.strip().splitlines()
    assert line.startswith(f"Error: {damaged}: ") and re.search(pattern, line), line
    assert "eval never writes" in line and not (tmp_path / "r.html").exists()


def test_a_report_says_what_it_joins_and_draws_apart_what_it_cannot(pair, tmp_path):
    """Results against another original or another text: the header names each basis and warns, the
    quality chart draws them as separate series; one basis reads as one line; recipes with the very
    same points share one line of the chart (named together), so none hides under another."""
    import copy

    from mha2gqa.eval.report import bases_lines, quality_points, render
    from mha2gqa.eval.results import Results

    out = tmp_path / "r.json"
    assert CliRunner().invoke(main, eval_args(pair, "--output", str(out), "-q")).exit_code == 0
    record = json.loads(out.read_text())
    same = Results.from_dict(record, "a.json")
    other = copy.deepcopy(record)
    other["data"] |= {"source": "/elsewhere/stories.txt", "sha256": "0" * 64, "stream_tokens": 999}
    moved = Results.from_dict(other, "b.json")
    assert bases_lines([same, same]) == [f"every result: {same.basis_line}"]
    lines = bases_lines([same, moved])
    assert (
        lines[0].startswith("these 2 results are measured on 2 different bases")
        and "stories.txt (999 tokens)" in lines[2]
    )
    series = {name for name, _, _ in quality_points([same, moved])}
    assert len(series) == 2 and any("stories.txt" in name for name in series)
    page = render([same, moved], tmp_path / "r.html")["html"].read_text()
    assert "different bases: compare within one" in page and "stories.txt (999 tokens)" in page
