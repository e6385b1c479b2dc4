"""The generative probe (issue 70): greedy continuations of prompts cut across the evaluation text,
compared token by token with the original's, in the terminal, the results, the report and a gate; a
model against itself agrees everywhere, in memory and against the cached original alike."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import eval_argv

from mha2gqa.cli import main
from mha2gqa.eval.greedy import compare, probe_prompts


def test_the_figures_by_hand():
    original = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]])
    converted = torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4], [0, 6, 7, 8]])
    probe = compare(original, converted, prompt_tokens=7)
    assert (probe.prompts, probe.tokens, probe.prompt_tokens) == (3, 4, 7)
    assert probe.identical == pytest.approx(1 / 3) and probe.mean_agreeing_tokens == pytest.approx((4 + 1 + 0) / 3)
    with pytest.raises(ValueError, match="different shapes"):
        compare(original, converted[:2], 7)


def test_the_prompts_are_cut_across_the_whole_text():
    ids = torch.arange(1000)
    prompts = probe_prompts(ids, 5, seq_len=128, new=20)
    assert prompts.shape == (5, 32) and prompts[0, 0] == 0 and prompts[-1, -1] == 1000 - 20 - 1
    assert torch.equal(prompts, probe_prompts(ids, 5, seq_len=128, new=20))  # the same prompts every run
    assert probe_prompts(ids, 5, seq_len=64, new=20).shape == (5, 16)  # a quarter of a short window
    assert probe_prompts(ids, 0, 128, 20) is None and probe_prompts(ids[:40], 3, 128, 20) is None


@pytest.mark.parametrize("load_both", [False, True])
def test_a_model_against_itself_agrees_on_every_continuation(pair, tmp_path, load_both):
    src, _, text = pair
    out = tmp_path / "r.json"
    extra = ["--output", str(out), "--greedy-prompts", "12", "--greedy-tokens", "10", *(["--load-both"] * load_both)]
    result = CliRunner().invoke(main, eval_argv(src, src, text, "64", "1200", *extra))
    assert result.exit_code == 0, result.output
    assert "greedy: 100.0% of 12 continuations of 10 tokens identical to the original's" in result.output
    greedy = json.loads(out.read_text())["greedy"]
    assert greedy == {"prompts": 12, "prompt_tokens": 16, "tokens": 10, "identical": 1.0, "mean_agreeing_tokens": 10.0}


def test_a_conversion_is_probed_reported_and_gated(pair, tmp_path):
    from mha2gqa.eval.report import render
    from mha2gqa.eval.results import Results

    src, conv, text = pair
    out = tmp_path / "r.json"
    args = eval_argv(src, conv, text, "64", "1200", "--output", str(out), "--min-greedy-agreement", "1")
    gated = CliRunner().invoke(main, args)
    results = Results.load(out)
    assert results.greedy is not None and results.greedy.prompts == 32
    assert results.greedy.identical < 1 and 0 <= results.greedy.mean_agreeing_tokens < 32  # a lossy 4 -> 2 merge
    assert gated.exit_code == 3 and "greedy_agreement" in gated.output, gated.output
    page = render([results], tmp_path / "r.html")["html"].read_text()
    assert "Generative probe" in page and f"{results.greedy.identical:.1%}" in page
    no_probe = ["--greedy-prompts", "0", "--min-greedy-agreement", "0.5"]
    off = CliRunner().invoke(main, [*eval_argv(src, conv, text, "64", "1200"), *no_probe])
    assert off.exit_code == 1 and "--min-greedy-agreement reads the generative probe" in off.output
