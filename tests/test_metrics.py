"""Hand-computed values for the divergence metrics."""

import math

import numpy as np
import pytest
import torch

from mha2gqa.eval.metrics import cosine, entropy, js_divergence, kl_divergence, summarize


def test_kl_of_identical_distributions_is_zero():
    logp = torch.log_softmax(torch.randn(5, 7), -1)
    assert torch.allclose(kl_divergence(logp, logp), torch.zeros(5), atol=1e-7)
    assert torch.allclose(js_divergence(logp, logp), torch.zeros(5), atol=1e-7)


def test_kl_of_a_known_pair_matches_the_closed_form():
    p, q = torch.tensor([0.5, 0.5]), torch.tensor([0.9, 0.1])
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert math.isclose(kl_divergence(p.log(), q.log()).item(), expected, rel_tol=1e-6)
    m = (p + q) / 2
    js = 0.5 * sum(p[i] * math.log(p[i] / m[i]) + q[i] * math.log(q[i] / m[i]) for i in range(2))
    assert math.isclose(js_divergence(p.log(), q.log()).item(), float(js), rel_tol=1e-6)


def test_masked_entries_count_as_zero_probability():
    p = torch.tensor([0.25, 0.75, 0.0])
    q = torch.tensor([0.5, 0.5, 0.0])
    kl = kl_divergence(p.log(), q.log()).item()
    assert math.isclose(kl, 0.25 * math.log(0.5) + 0.75 * math.log(1.5), rel_tol=1e-6)
    assert math.isclose(entropy(torch.full((4,), 0.25).log()).item(), math.log(4), rel_tol=1e-6)
    assert math.isclose(entropy(p.log()).item(), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), rel_tol=1e-6)
    assert math.isclose(
        js_divergence(torch.tensor([0.0, 1.0]).log(), torch.tensor([1.0, 0.0]).log()).item(), math.log(2), rel_tol=1e-6
    )


def test_cosine_and_quantiles_by_hand():
    assert math.isclose(
        cosine(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])).item(), 1 / math.sqrt(2), rel_tol=1e-6
    )
    values = torch.arange(1001, dtype=torch.float32)
    s = summarize(values)
    assert s["median"] == 500 and s["q90"] == 900 and s["q99_9"] == 999 and s["max"] == 1000 and s["count"] == 1001
    r = torch.rand(997)
    s = summarize(r)
    for q, key in [(0.9, "q90"), (0.95, "q95"), (0.99, "q99"), (0.999, "q99_9"), (0.5, "median")]:
        assert math.isclose(s[key], float(np.quantile(r.double().numpy(), q)), rel_tol=1e-9)


def test_js_is_finite_when_probabilities_underflow():
    logp = torch.tensor([0.0, -104.0, float("-inf")])  # exp(-104) is a float32 denormal
    logq = torch.tensor([-1e-3, -7.0, float("-inf")])
    assert torch.isfinite(js_divergence(logp, logq)).all()


def test_fused_row_stats_equal_the_reference_definitions():
    from mha2gqa.eval.metrics import row_stats

    allowed = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    lo = torch.log_softmax(torch.randn(3, 6, 6).masked_fill(~allowed, float("-inf")), -1)
    lc = torch.log_softmax(torch.randn(3, 6, 6).masked_fill(~allowed, float("-inf")), -1)
    s = row_stats(lo, lc, allowed)
    torch.testing.assert_close(s["kl"], kl_divergence(lo, lc))
    torch.testing.assert_close(s["js"], js_divergence(lo, lc))
    torch.testing.assert_close(s["cosine"], cosine(lo.exp(), lc.exp()))
    torch.testing.assert_close(s["entropy_p"], entropy(lo))
    torch.testing.assert_close(s["entropy_q"], entropy(lc))


def test_agreement_statistics_equal_an_independent_float64_computation():
    """llama.cpp's KL report from one scoring pass, against numpy in float64 from the same logits."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import random_model, tiny_config

    from mha2gqa.eval.harness import scored_pass
    from mha2gqa.eval.perplexity import disjoint_windows

    a, b = random_model(tiny_config("llama"), seed=1), random_model(tiny_config("llama"), seed=2)
    ids = torch.randint(0, 96, (300,), generator=torch.Generator().manual_seed(3))
    windows = disjoint_windows(ids, 64)
    scored = scored_pass([a, b], windows, batch_size=2)
    got = scored.agreement
    lo, lc, target = [], [], []
    with torch.no_grad():
        for inputs, targets in windows:
            keep = targets != -100
            lo.append(torch.log_softmax(a(inputs[None]).logits[0][keep].double(), -1).numpy())
            lc.append(torch.log_softmax(b(inputs[None]).logits[0][keep].double(), -1).numpy())
            target.append(targets[keep].numpy())
    lo, lc, target = np.concatenate(lo), np.concatenate(lc), np.concatenate(target)
    po, pc = np.exp(lo), np.exp(lc)
    kl, kl_rev = (po * (lo - lc)).sum(1), (pc * (lc - lo)).sum(1)
    rows = np.arange(len(target))
    dp = pc[rows, target] - po[rows, target]
    nll_o, nll_c = -lo[rows, target], -lc[rows, target]
    n = len(target)
    assert scored.tokens == n and scored.windows == len(windows)
    assert scored.nll(0) == pytest.approx(nll_o.mean(), rel=1e-5)
    assert scored.nll(1) == pytest.approx(nll_c.mean(), rel=1e-5)
    same = (lo.argmax(1) == lc.argmax(1)).mean()
    expected = {
        ("kl", "mean"): kl.mean(),
        ("kl", "std_error"): kl.std(ddof=1) / np.sqrt(n),
        ("kl", "median"): np.median(kl),
        ("kl", "q0_1"): np.quantile(kl, 0.001),
        ("kl", "q99_9"): np.quantile(kl, 0.999),
        ("kl", "min"): kl.min(),
        ("kl_reverse", "mean"): kl_rev.mean(),
        ("kl_reverse", "q90"): np.quantile(kl_rev, 0.9),
        ("delta_p", "mean"): dp.mean(),
        ("delta_p", "q1"): np.quantile(dp, 0.01),
        ("delta_p", "max"): dp.max(),
        ("delta_p", "rms"): np.sqrt((dp**2).mean()),
        ("delta_p", "rms_error"): (dp**2).std(ddof=1) / np.sqrt(n) / (2 * np.sqrt((dp**2).mean())),
        ("top1_agreement",): same,
        ("top1_error",): np.sqrt(same * (1 - same) / n),
        ("nll_delta",): (nll_c - nll_o).mean(),
        ("nll_delta_error",): (nll_c - nll_o).std(ddof=1) / np.sqrt(n),
        ("nll_correlation",): np.corrcoef(nll_o, nll_c)[0, 1],
    }
    assert got.tokens == n
    for key, value in expected.items():
        actual = getattr(got, key[0]) if len(key) == 1 else getattr(getattr(got, key[0]), key[1])
        assert abs(actual - value) < 1e-6, (key, actual, value)
