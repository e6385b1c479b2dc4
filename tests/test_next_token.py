"""The one next-token comparison (core.next_token) that the stage guard, the allocation cost and the
evaluation share: hand-computed values, the p = 0 convention, and the guard's head-blockwise sums
equal to the evaluation's per-token figures on the same logits."""

from __future__ import annotations

import math

import torch

from mha2gqa.core.next_token import log_probs_, same_top, token_kl


def test_token_kl_is_the_hand_computed_kl_per_token():
    p = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]])
    q = torch.tensor([[0.25, 0.25, 0.5], [0.1, 0.2, 0.7]])
    expected = 0.5 * math.log(2) + 0.25 * math.log(0.5)
    kl = token_kl(p.log(), q.log())
    assert kl.shape == (2,)
    assert math.isclose(kl[0].item(), expected, rel_tol=1e-6)
    assert kl[1].item() == 0.0  # the same distribution: exactly zero


def test_a_token_p_gives_no_mass_adds_nothing_whatever_q_gives_it():
    logp = torch.tensor([[0.0, float("-inf")]])  # p = (1, 0)
    assert token_kl(logp, logp).item() == 0.0  # 0 * (-inf + inf) must not be NaN
    half = torch.tensor([[math.log(0.5), math.log(0.5)]])
    assert math.isclose(token_kl(logp, half).item(), math.log(2), rel_tol=1e-6)
    assert token_kl(half, logp).item() == math.inf  # q's mass where p has none: infinite, not NaN


def test_blocks_do_not_change_a_token_s_figure():
    torch.manual_seed(0)
    a, b = torch.randn(100, 7).log_softmax(-1), torch.randn(100, 7).log_softmax(-1)  # 100 rows: several blocks
    by_rows = torch.stack([token_kl(a[i : i + 1], b[i : i + 1])[0] for i in range(100)])
    torch.testing.assert_close(token_kl(a, b), by_rows, rtol=1e-6, atol=0)
    torch.testing.assert_close(token_kl(a, b, a.exp()), token_kl(a, b), rtol=0, atol=0)


def test_log_probs_in_place_and_same_top():
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]])
    want = torch.log_softmax(logits, -1)
    got = log_probs_(logits)
    assert got.data_ptr() == logits.data_ptr()
    torch.testing.assert_close(got, want)
    other = torch.tensor([[0.0, 9.0, 1.0], [9.0, 0.0, 1.0]]).log_softmax(-1)
    assert same_top(got, other).tolist() == [True, False]
    assert same_top(got, other, torch.tensor([2, 0])).tolist() == [False, True]


def test_the_guard_sums_equal_the_evaluation_s_figures_on_the_same_logits():
    """``next_token_kl`` (the guard, the allocation cost) through a head against eval's per-token
    comparison of the same logits: one kernel, the same figures."""
    from mha2gqa.convert.engine.layers import ModelHead, next_token_kl
    from mha2gqa.eval.perplexity import AgreementSums, _compare

    torch.manual_seed(1)
    weight = torch.randn(11, 5)

    def head(hidden: torch.Tensor, as_tuple: bool) -> torch.Tensor:
        return hidden @ weight.T

    original, candidate = torch.randn(1, 40, 5), torch.randn(1, 40, 5)
    sums = next_token_kl(ModelHead(head, 11), False, original, [candidate])
    agree, nll = AgreementSums(), [0.0, 0.0]
    lo, lc = (head(x, False)[0].log_softmax(-1) for x in (original, candidate))
    _compare(lo, lc, torch.zeros(40, dtype=torch.long), nll, agree)
    assert math.isclose(sums[0, 0].item(), torch.cat(agree.kl).double().sum().item(), rel_tol=1e-6)
    assert sums[0, 1].item() == agree.top1_same
