"""Every evaluation decides: the verdict (tiers, text, JSON, report), the quantization yardstick, and
the comparisons refused or flagged before any model is scored."""

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import (
    FIXTURES,
    FIXTURES_ENV,
    eval_argv,
    random_model,
    requires_fixtures,
    save,
    story_text,
    tiny_config,
)

from mha2gqa.cli import main
from mha2gqa.convert import convert_checkpoint
from mha2gqa.core.typed import RecordError
from mha2gqa.eval.plots import log_ticks
from mha2gqa.eval.quantization import SCHEMES, fake_quantize, quantize_model
from mha2gqa.eval.report import render
from mha2gqa.eval.results import Results
from mha2gqa.eval.verdict import THRESHOLDS, TIERS, Verdict, figures_of, judge


# -- the verdict ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ratios", "kl", "top1", "tier", "decided"),
    [
        ({"disjoint": 1.03}, 0.02, 0.95, "pass", "ppl_ratio[disjoint]"),  # closest to its bound
        ({"disjoint": 1.05}, 0.05, 0.90, "pass", None),  # bounds are inclusive
        ({"disjoint": 1.10}, 0.02, 0.95, "borderline", "ppl_ratio[disjoint]"),
        ({"disjoint": 1.03}, 0.30, 0.95, "fail", "kl_mean"),
        ({"disjoint": 1.03}, 0.02, 0.60, "fail", "top1_agreement"),
        ({"disjoint": 1.01, "rolling": 1.30}, 0.02, 0.95, "fail", "ppl_ratio[rolling]"),
        ({"disjoint": 1.25}, 0.30, 0.95, "fail", "kl_mean"),  # both fail: the one furthest past (0.2 vs 0.04)
    ],
)
def test_the_worst_figure_decides(ratios, kl, top1, tier, decided):
    v = judge(figures_of(ratios, kl, top1))
    assert v.tier == tier
    if decided:
        assert v.decided_by == decided
    assert {f.name for f in v.figures} == {*(f"ppl_ratio[{p}]" for p in ratios), "kl_mean", "top1_agreement"}
    assert v.thresholds == {t.figure: {"op": t.op, "pass": t.passing, "borderline": t.borderline} for t in THRESHOLDS}
    assert v.sentence().startswith(f"verdict: {tier.upper()} ({v.decided_by} ")
    assert Verdict.from_dict(json.loads(json.dumps(v.to_dict())), "verdict") == v


def test_a_damaged_verdict_is_refused():
    v = judge(figures_of({"disjoint": 1.1}, 0.1, 0.8)).to_dict()
    for damage in ({"tier": "great"}, {"decided_by": "nothing"}, {"value": "1.1"}):
        with pytest.raises(RecordError):
            Verdict.from_dict({**v, **damage}, "verdict")


# -- end to end on a tiny pair --------------------------------------------------------------------
def eval_args(pair, *extra):
    src, conv, text = pair
    return eval_argv(src, conv, text, "64", "1200", "--no-attention", "--samples", "0", *extra)


def test_the_verdict_is_the_last_line_and_in_the_json(pair, tmp_path):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(main, eval_args(pair, "--output", str(out)))
    assert res.exit_code == 0, res.output
    record = json.loads(out.read_text())
    verdict = Verdict.from_dict(record["verdict"], "verdict")
    assert verdict.tier in TIERS and res.output.strip().splitlines()[-1] == verdict.sentence()
    assert verdict.figures[0].value == pytest.approx(record["protocols"]["disjoint"]["ppl_ratio"])
    strict = CliRunner().invoke(main, eval_args(pair, "--strict", "-q"))
    assert strict.exit_code == (0 if verdict.tier == "pass" else 3)
    assert strict.output.strip().splitlines()[-1] == verdict.sentence()
    # gates still decide the exit code; the verdict follows their line
    gated = CliRunner().invoke(main, eval_args(pair, "-q", "--max-ppl-ratio", "1000"))
    assert gated.exit_code == 0 and gated.output.strip().splitlines()[-2:] == ["gates passed: " + gated.output.split(
        "gates passed: ")[1].splitlines()[0], verdict.sentence()]  # fmt: skip


def _with_numbers(record: dict, ratio: float, kl: float, top1: float) -> Results:
    r = copy.deepcopy(record)
    r.pop("verdict", None)  # judged again from the numbers, as for files written before verdicts
    r["protocols"]["disjoint"]["ppl_ratio"] = ratio
    r["agreement"]["kl"]["mean"] = kl
    r["agreement"]["top1_agreement"] = top1
    return Results.from_dict(r, "r.json")


@pytest.mark.parametrize(
    ("numbers", "tier"), [((1.01, 0.01, 0.97), "pass"), ((1.1, 0.1, 0.8), "borderline"), ((1.5, 0.4, 0.6), "fail")]
)
def test_the_report_opens_with_the_verdict(pair, tmp_path, numbers, tier):
    out = tmp_path / "r.json"
    assert CliRunner().invoke(main, eval_args(pair, "--output", str(out), "-q")).exit_code == 0
    results = _with_numbers(json.loads(out.read_text()), *numbers)
    page = render([results], tmp_path / "r.html", tmp_path / "r.md")["html"].read_text()
    first = page.index('<div class="verdict')
    assert page[first:].startswith(f'<div class="verdict {tier}">Verdict: {tier.upper()}')
    assert first < page.index('id="overview"')  # above the overview
    assert f'<td class="text {tier}">{tier}' in page  # the overview's verdict column
    several = render([results, _with_numbers(json.loads(out.read_text()), 1.5, 0.4, 0.6)], tmp_path / "s.html")
    page = several["html"].read_text()
    if tier == "fail":  # one tier: the banner is its colour
        assert '<div class="verdict fail">Verdicts: 2 fail</div>' in page
    else:  # a sweep of tiers: the best first, in no tier's colour, the tally after
        assert f'<div class="verdict mixed">Best: {results.title}, {tier}' in page
        assert f"Verdicts: 1 {tier}, 1 fail</div>" in page


# -- the quantization yardstick -------------------------------------------------------------------
def test_fake_quantization_by_hand():
    w = torch.tensor([[1.0, -0.5, 0.25], [0.1, 0.2, -0.4]])
    int8 = fake_quantize(w, SCHEMES["int8"])
    scale = torch.tensor([[1 / 127], [0.4 / 127]])
    torch.testing.assert_close(int8, (w / scale).round() * scale)
    assert int8[0, 0] == 1.0 and int8[1, 2] == pytest.approx(-0.4)  # absmax kept exactly
    # int4, groups of 128 over 130 inputs: the last group (2 columns) has its own min and max
    g = torch.linspace(-1, 1, 130)[None].repeat(2, 1)
    g[:, 128:] = torch.tensor([5.0, 6.0])
    q = fake_quantize(g, SCHEMES["int4"])
    torch.testing.assert_close(q[:, 128:], g[:, 128:])  # min and max of a group are levels
    step = 2 / 15
    assert (q[:, :128] - g[:, :128]).abs().max() <= step / 2 + 1e-6
    assert len(torch.unique(q[0, :128])) <= 16


def test_gpt2_conv1d_is_quantized_per_output_channel():
    model = random_model(tiny_config("llama"))  # nn.Linear
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=96, n_positions=32)).eval()
    before = gpt2.transformer.h[0].attn.c_attn.weight.clone()  # [in, out]
    head = gpt2.lm_head.weight.clone()
    assert quantize_model(gpt2, SCHEMES["int8"]) == 4 and quantize_model(model, SCHEMES["int8"]) == 14
    after = gpt2.transformer.h[0].attn.c_attn.weight
    assert not torch.equal(before, after)
    torch.testing.assert_close(after.abs().amax(0), before.abs().amax(0))  # each output column's absmax kept
    assert torch.equal(gpt2.lm_head.weight, head)  # the (tied) head and embeddings stay


def test_the_yardstick_equals_scoring_a_quantized_copy(pair, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, _, text = pair
    out = tmp_path / "r.json"
    res = CliRunner().invoke(main, eval_args(pair, "--compare-quantization", "int8,int4", "--output", str(out)))
    assert res.exit_code == 0, res.output
    results = Results.load(out)
    assert list(results.quantization) == ["int8", "int4"]
    assert "yardstick int4" in res.output and ("costs less than" in res.output or "costs more than" in res.output)
    assert results.verdict.yardstick == results.placement()
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    quantize_model(model, SCHEMES["int4"])
    model.save_pretrained(tmp_path / "int4")
    AutoTokenizer.from_pretrained(src).save_pretrained(tmp_path / "int4")
    by_hand = tmp_path / "h.json"
    argv = eval_argv(src, tmp_path / "int4", text, "64", "1200", "--no-attention", "--samples", "0", "-q")
    assert CliRunner().invoke(main, [*argv, "--output", str(by_hand)]).exit_code == 0
    hand, yard = Results.load(by_hand), results.quantization["int4"]
    assert math.isclose(yard.ppl_ratio["disjoint"], hand.headline.ppl_ratio, rel_tol=1e-9)
    assert math.isclose(yard.agreement.kl.mean, hand.agreement.kl.mean, rel_tol=1e-6, abs_tol=1e-12)
    assert yard.agreement.top1_agreement == hand.agreement.top1_agreement


@requires_fixtures("pydocs-mha-8h", "text/pydocs_heldout.txt")
def test_int8_is_closer_than_int4_on_a_real_model(tmp_path):
    src, text = FIXTURES / "pydocs-mha-8h", FIXTURES / "text" / "pydocs_heldout.txt"
    out = tmp_path / "r.json"
    argv = eval_argv(src, src, text, "256", "2048", "-q", "--no-attention", "--samples", "0")
    res = CliRunner().invoke(main, [*argv, "--compare-quantization", "int8", "--compare-quantization", "int4",
                                    "--output", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    q = Results.load(out).quantization
    assert 0 < q["int8"].agreement.kl.mean < q["int4"].agreement.kl.mean
    assert abs(q["int8"].ppl_ratio["disjoint"] - 1) < abs(q["int4"].ppl_ratio["disjoint"] - 1)
    assert q["int8"].agreement.top1_agreement > q["int4"].agreement.top1_agreement


# -- invalid comparisons, refused or flagged before work ------------------------------------------
def test_a_swapped_pair_is_refused(pair, tmp_path):
    src, conv, text = pair
    by_heads = CliRunner().invoke(main, eval_argv(conv, src, text, "64", "1200"))
    assert by_heads.exit_code == 1 and "swapped" in by_heads.output and "--original" in by_heads.output
    copy_ = convert_checkpoint(src, tmp_path / "g4", 4, progress=False).output  # same KV heads: the record tells
    by_record = CliRunner().invoke(main, eval_argv(copy_, src, text, "64", "1200"))
    assert by_record.exit_code == 1 and f"pass --original {src} --converted {copy_}" in by_record.output
    assert CliRunner().invoke(main, eval_argv(src, copy_, text, "64", "1200", "-q")).exit_code == 0


def test_different_vocabularies_are_refused_before_scoring(pair, tmp_path):
    src, _, text = pair
    save(random_model(tiny_config("llama", vocab_size=97, max_position_embeddings=128)), tmp_path / "other")
    res = CliRunner().invoke(main, eval_argv(src, tmp_path / "other", text, "64", "1200"))
    assert res.exit_code == 1 and "different vocabularies" in res.output and "scoring" not in res.output


def test_eval_on_the_calibration_text_is_flagged(pair, tmp_path):
    src, _, text = pair
    conv = convert_checkpoint(src, tmp_path / "svd", 2, "svd", calibration=str(text), progress=False).output
    out = tmp_path / "r.json"
    res = CliRunner().invoke(main, eval_argv(src, conv, text, "64", "1200", "--output", str(out), "--no-attention"))
    assert res.exit_code == 0 and "warning: the evaluation text is the same text as" in res.output
    record = json.loads(out.read_text())
    overlap = record["data"]["calibration_overlap"]
    assert overlap["same"] and overlap["flagged"] and overlap["use"] == "calibration"
    # the last line itself says the verdict is not valid, and what it would have been
    last = res.output.strip().splitlines()[-1]
    assert last.startswith("verdict: NOT VALID (evaluated on the conversion's calibration text) - would be ")
    assert record["verdict"]["invalid"] == "evaluated on the conversion's calibration text"
    page = render([Results.load(out)], tmp_path / "r.html")["html"].read_text()
    assert "Warning," in page and "calibration text" in page
    assert 'class="verdict not-valid"' in page and "Verdict: NOT VALID" in page
    # --strict and any gate fail on it; --allow-overlap judges it as measured
    base = eval_argv(src, conv, text, "64", "1200", "--no-attention", "-q")
    assert CliRunner().invoke(main, [*base, "--strict"]).exit_code == 3
    gated = CliRunner().invoke(main, [*base, "--max-ppl-ratio", "100"])
    assert gated.exit_code == 3 and "GATES FAILED: calibration_text_overlap 1 > 0" in gated.output
    allowed = CliRunner().invoke(main, [*base, "--max-ppl-ratio", "100", "--allow-overlap"])
    assert allowed.exit_code == 0 and "gates passed" in allowed.output and "NOT VALID" not in allowed.output
    # a results file written before verdicts could be invalid: read now, it is not valid either
    del record["verdict"]["invalid"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(record))
    assert Results.load(old).judge().sentence().startswith("verdict: NOT VALID")
    # a copy of part of it, with other text: the shared share is measured
    other = tmp_path / "o.txt"
    lines = [f"a different line number {i} about dogs and parks and rain, long enough" for i in range(300)]
    other.write_text("\n".join(lines[:150] + text.read_text().splitlines()[:100] + lines[150:]))
    part = tmp_path / "p.json"
    assert (
        CliRunner().invoke(main, eval_argv(src, conv, other, "64", "1200", "-q", "--output", str(part))).exit_code == 0
    )
    shared = json.loads(part.read_text())["data"]["calibration_overlap"]
    assert not shared["same"] and shared["flagged"] and 0 < shared["share"] < 1
    assert "of its lines with the calibration text" in Results.load(part).judge().invalid
    held = tmp_path / "h.txt"
    held.write_text("\n".join(lines))
    assert (
        CliRunner().invoke(main, eval_argv(src, conv, held, "64", "1200", "-q", "--output", str(part), "--overwrite"))
    ).exit_code == 0
    assert not json.loads(part.read_text())["data"]["calibration_overlap"]["flagged"]
    assert Results.load(part).judge().invalid is None


def test_calibration_for_a_method_that_ignores_it_is_refused(pair, tmp_path):
    src, _, text = pair
    res = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "x"), "-g", "2", "--calibration", str(text)])
    assert res.exit_code == 1 and "did you mean --method svd" in res.output and not (tmp_path / "x").exists()


def test_short_calibration_warns_with_both_numbers(pair, tmp_path):
    src, _, text = pair
    argv = ["convert", str(src), str(tmp_path / "x"), "-g", "2", "--method", "svd", "--calibration", str(text),
            "--calibration-tokens", "1000000", "-q"]  # fmt: skip
    res = CliRunner().invoke(main, argv)
    assert res.exit_code == 0, res.output
    assert "1,000,000 asked for" in res.output and "warning: --calibration" in res.output


def test_quantization_yardstick_needs_a_pair_one_at_a_time(pair):
    src, _, text = pair
    alone = CliRunner().invoke(main, ["eval", "--original", str(src), "--data", str(text), "--compare-quantization",
                                      "int8"])  # fmt: skip
    assert alone.exit_code == 1 and "pass --converted" in alone.output
    both = CliRunner().invoke(main, eval_args(pair, "--compare-quantization", "int4", "--load-both"))
    assert both.exit_code == 1 and "drop --load-both" in both.output


def test_a_job_gives_its_calibration_to_the_methods_that_read_it(tmp_path):
    from mha2gqa.core.errors import Mha2GqaError
    from mha2gqa.jobs import load_job

    text = story_text(tmp_path / "t.txt")
    job = tmp_path / "j.yaml"
    job.write_text(f"source: x\nconvert: {{num_kv_heads: [2], methods: [mean, svd], calibration: {text}}}\n"
                   f"eval: {{data: {text}}}\n")  # fmt: skip
    parsed = load_job(job)
    assert parsed.recipe(2, "mean", str(text)).convert.calibration is None
    assert parsed.recipe(2, "svd", str(text)).convert.calibration == str(text)
    job.write_text(f"source: x\nconvert: {{num_kv_heads: [2], methods: [mean], calibration: {text}}}\n"
                   f"eval: {{data: {text}}}\n")  # fmt: skip
    with pytest.raises(Mha2GqaError, match="no method of the sweep"):
        load_job(job)


# -- charts and fresh clones ----------------------------------------------------------------------
@pytest.mark.parametrize("values", [[1, 8.2], [1.0, 1.03], [1.0, 1.45, 2.4], [0.004, 0.35], [1, 13.4], [5.2, 40.1]])
def test_log_axes_cover_their_points_with_labelled_ticks(values):
    ticks = log_ticks(values)
    assert ticks[0] <= min(values) and ticks[-1] >= max(values) and 2 <= len(ticks) <= 8
    assert ticks == sorted(ticks)


def test_a_run_without_fixtures_says_how_many_were_skipped(tmp_path):
    tests = Path(__file__).parent
    env = {**__import__("os").environ, FIXTURES_ENV: str(tmp_path / "nowhere")}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests / "test_real_fixtures.py")],
        capture_output=True, text=True, env=env, cwd=tests.parent,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:]
    assert f"real-model test(s) skipped: no fixtures at {tmp_path / 'nowhere'}" in out.stdout
    assert f"set {FIXTURES_ENV}=" in out.stdout


# -- smaller points -------------------------------------------------------------------------------
def test_plan_of_a_per_layer_checkpoint_plans_its_own_counts(tmp_path):
    from mha2gqa.serving.capacity import plan_capacity
    from mha2gqa.serving.sizing import PlanSettings

    save(random_model(tiny_config("llama", num_hidden_layers=3)), tmp_path / "src")
    out = convert_checkpoint(tmp_path / "src", tmp_path / "pl", None, num_kv_heads_per_layer="4,1,2", progress=False)
    rows = plan_capacity(str(out.output), PlanSettings(gpu_memory="1GB")).rows
    assert [r.label for r in rows if r.kv_heads_per_layer] == ["4,1,2"]


def test_a_folder_given_as_text_says_so(pair):
    src, conv, text = pair
    res = CliRunner().invoke(main, eval_argv(src, conv, text.parent, "64", "1200"))
    assert res.exit_code == 1 and "is a folder: give one text file" in res.output


def test_uptraining_runs_seen_only_through_their_logs_join_the_overview():
    from mha2gqa.core.runlog import RunHistory, from_json
    from mha2gqa.eval.tables import overview_table

    start = {"type": "start", "created": "2026-11-26T00:00:00+00:00", "student": "s", "teacher": "t",
             "settings": {"objective": "kd", "train": "all", "max_steps": 4}, "windows": 8, "tokens_per_step": 64,
             "total_steps": 4, "trainable_parameters": 10, "parameters": 10, "num_heads": 4, "num_kv_heads": 2,
             "processes": 1, "device": "cpu", "mixed_precision": "no"}  # fmt: skip
    evals = [{"type": "eval", "step": s, "tokens": 64 * s, "nll": 2.0, "ppl": p, "teacher_ppl": 10.0,
              "ppl_ratio": p / 10, "kl_mean": k, "eval_tokens": 512}
             for s, p, k in ((0, 14.0, 0.4), (4, 10.4, 0.04))]  # fmt: skip
    run = RunHistory("g2-uptrained", tuple(from_json(r, "record") for r in [start, *evals]))
    table = overview_table([], [run])
    (row,) = table.rows
    assert row[0] == "g2-uptrained" and row[1] == "uptrain" and row[2] == "2" and row[6] == "1.040x"
    assert row[-1] == "pass" and table.html().count('href="#uptraining"') == 1


def test_a_stopped_uptraining_points_at_resume(pair, tmp_path, monkeypatch):
    import signal

    from mha2gqa.core.signals import Terminated
    from mha2gqa.uptrain import trainer

    def stopped(*args, **kwargs):
        raise Terminated(signal.SIGINT)

    monkeypatch.setattr(trainer._Trainer, "train", stopped)
    _, conv, text = pair
    argv = ["uptrain", str(conv), "--data", str(text), "--output", str(tmp_path / "up"), "--max-steps", "2"]
    res = CliRunner().invoke(main, argv)
    assert res.exit_code == 128 + signal.SIGINT
    assert "stopped by SIGINT; the checkpoints written so far stay in" in res.output and "--resume" in res.output
    assert "nothing partial" not in res.output


def test_an_evals_log_to_a_file_is_lines_not_redraws(pair, tmp_path):
    """stderr and stdout to a file (a CI log): no carriage-return redraws, a few dozen lines at most."""
    import subprocess
    import sys

    src, conv, text = pair
    log = tmp_path / "eval.log"
    argv = eval_argv(src, conv, text, "64", "4000", "--attention-windows", "2")
    with open(log, "w") as f:
        done = subprocess.run(
            [sys.executable, "-c", "from mha2gqa.cli import main; main()", *argv], stdout=f, stderr=f, timeout=600
        )
    out = log.read_text()
    assert done.returncode == 0 and "verdict:" in out.splitlines()[-1], out[-2000:]
    assert "\r" not in out and len(out.splitlines()) <= 60, out


def test_progress_off_a_terminal_is_a_line_every_few_seconds(monkeypatch):
    import io

    from mha2gqa.core import progress

    stream = io.StringIO()  # not a terminal
    monkeypatch.setattr(progress.sys, "stderr", stream)
    with progress.bar(total=10_000, desc="scoring") as bar:
        for _ in range(10_000):
            bar.update(1)
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and 1 <= len(lines) <= 3 and "10000/10000" in lines[-1], lines
