"""The refit's closed-form output projection: the ridge solve by hand, and its use after a fit."""

from __future__ import annotations

import pytest
import torch

from mha2gqa.convert.refit import PLAIN, FitData, FitResult, Objective, heldout_error, solve_output, split_windows
from mha2gqa.convert.refit.output_solve import RIDGES, NormalEquations

#: the refit's error with a weight for each of the 6 hidden dimensions
NORMALIZED = Objective(normalize=True, scale=torch.linspace(0.5, 2, 6))


def test_the_ridge_solve_by_hand():
    """One input, no bias: ``w = (Σ a r + λ m w0) / (Σ a² + λ m)``, ``m = Σ a²`` (the mean of a 1 x 1
    diagonal). a = (1, 2), r = (2, 4): Σ a r = 10, Σ a² = 5; from w0 = 0 at λ = 1: 10 / 10 = 1."""
    eq = NormalEquations(bias=False)
    eq.add(torch.tensor([[1.0], [2.0]]), torch.tensor([[2.0], [4.0]]))
    w, b = eq.solve(torch.zeros(1, 1), None, 1.0)
    assert b is None and w.item() == pytest.approx(1.0)
    assert eq.solve(torch.zeros(1, 1), None, 0.25)[0].item() == pytest.approx(10 / 6.25)
    assert eq.solve(torch.full((1, 1), 2.0), None, 1.0)[0].item() == pytest.approx(2.0)  # at the optimum: stays
    assert eq.tokens == 2


def test_the_solve_recovers_an_exact_projection_and_shrinks_to_the_start():
    """Outputs made by a known weight and bias: a tiny ridge finds them; a huge one stays at the start.
    Tokens added in pieces give the one-piece equations."""
    torch.manual_seed(0)
    a, w_true, b_true = torch.randn(3, 40, 5), torch.randn(4, 5), torch.randn(4)
    wanted = a @ w_true.T + b_true
    whole, pieces = NormalEquations(bias=True), NormalEquations(bias=True)
    whole.add(a, wanted)
    for i in range(3):
        pieces.add(a[i], wanted[i])
    torch.testing.assert_close(pieces.gram, whole.gram)
    torch.testing.assert_close(pieces.rhs, whole.rhs)
    w0, b0 = torch.zeros(4, 5), torch.zeros(4)
    w, b = whole.solve(w0, b0, 1e-9)
    torch.testing.assert_close(w, w_true, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b, b_true, atol=1e-5, rtol=1e-5)
    w, b = whole.solve(w0 + 1, b0 - 1, 1e9)
    torch.testing.assert_close(w, w0 + 1, atol=1e-5, rtol=0)
    torch.testing.assert_close(b, b0 - 1, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="above zero"):
        whole.solve(w0, b0, 0.0)
    with pytest.raises(ValueError, match="no tokens"):
        NormalEquations(bias=False).solve(w0, None, 1.0)


def test_inputs_all_zero_keep_the_start():
    """No input ever non-zero: no output depends on the weight, the system is singular (its ridge is
    a share of a zero diagonal), and the start comes back unchanged instead of a solver's error."""
    eq = NormalEquations(bias=False)
    eq.add(torch.zeros(8, 3), torch.randn(8, 2))
    w0 = torch.randn(2, 3)
    w, b = eq.solve(w0, None, 1.0)
    assert b is None and torch.equal(w, w0)


class _Block(torch.nn.Module):
    """An attention block stand-in: fixed mixing of its input, then ``o_proj`` (times ``gain``)."""

    def __init__(self, gain: float = 1.0) -> None:
        super().__init__()
        self.mix = torch.nn.Parameter(torch.randn(6, 5), requires_grad=False)
        self.mix_module = torch.nn.Linear(6, 6)  # a linear module the block never calls
        self.o_proj = torch.nn.Linear(5, 6)
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.o_proj(torch.tanh(x @ self.mix))
        return out if self.gain == 1.0 else out * self.gain


def _setup(gain: float = 1.0, layer: str = "after attention", objective: Objective = PLAIN):
    """A block, a forward (``layer``: the stream after it, ``x + o(A)``; a parallel layer's output,
    ``x + o(A) + mlp(x)``; a sequential one's, ``h + mlp(h)`` with ``h = x + o(A)``), a fit of ``o``
    short of the best, and the keywords of :func:`solve_output` (``objective``'s error)."""
    torch.manual_seed(1)
    block = _Block(gain).requires_grad_(False)
    x, mlp = torch.randn(16, 8, 6), torch.randn(6, 6)
    w_true, b_true = torch.randn(6, 5), torch.randn(6)
    targets = x + torch.tanh(x @ block.mix) @ w_true.T + b_true + 0.01 * torch.randn(16, 8, 6)
    targets = targets + torch.tanh(x @ mlp) if layer == "parallel" else targets

    def forward(values, w):
        params = {"o_proj.weight": values["o"], "o_proj.bias": values["o_bias"]}
        h = x[w] + torch.func.functional_call(block, params, (x[w],))
        if layer == "parallel":
            return h + torch.tanh(x[w] @ mlp)
        return h + torch.tanh(h @ mlp) if layer == "sequential" else h

    start = {"o": w_true + 0.3 * torch.randn(6, 5), "o_bias": b_true + 0.3, "q": torch.ones(2)}
    kw = {"targets": lambda w: targets[w], "per_call": 3, "objective": objective}
    after = heldout_error(forward, start, windows=split_windows(16)[1], **kw)
    return block, forward, FitResult(start, 2 * after, after, False, 10), kw


@pytest.mark.parametrize("objective", [PLAIN, NORMALIZED], ids=["plain", "normalized"])
@pytest.mark.parametrize("layer", ["after attention", "parallel"])
def test_the_solved_projection_lowers_the_heldout_error(layer, objective):
    """Where the output is the rest plus ``o_proj``'s (the stream after attention; a parallel layer's
    output, its MLP reading the layer's input); by plain squares and by the refit's normalised error,
    each hidden dimension weighted (the tokens weighted as that error weighs them)."""
    block, forward, fit, kw = _setup(layer=layer, objective=objective)
    solved = solve_output(fit, forward, FitData(windows=16, **kw), block.o_proj)
    assert solved.ridge in RIDGES and not solved.kept and solved.steps == fit.steps
    assert solved.loss_after < fit.loss_after / 10  # the outputs are within noise of a linear map
    assert solved.loss_after == heldout_error(forward, solved.values, windows=split_windows(16)[1], **kw)
    assert solved.values["q"] is fit.values["q"]  # only the output projection moves


def test_no_solve_where_the_output_is_not_the_rest_plus_the_projections_or_nothing_was_fitted():
    block, forward, fit, kw = _setup(gain=2.0)  # the block scales o_proj's output
    assert solve_output(fit, forward, FitData(windows=16, **kw), block.o_proj) is fit
    block, forward, fit, kw = _setup(layer="sequential")  # an MLP reads it
    assert solve_output(fit, forward, FitData(windows=16, **kw), block.o_proj) is fit
    block, forward, fit, kw = _setup()
    exact = FitResult(fit.values, 0.0, 0.0, True, 0)
    assert solve_output(exact, forward, FitData(windows=16, **kw), block.o_proj) is exact
    assert solve_output(fit, forward, FitData(windows=16, **kw), block.mix_module) is fit  # not run
    block.o_proj.bias = None
    with_bias = FitResult(fit.values, 1.0, 0.5, False, 10)  # a fitted bias the module lacks
    assert solve_output(with_bias, forward, FitData(windows=16, **kw), block.o_proj) is with_bias
    conv = torch.nn.Conv1d(5, 6, 1)  # not a plain linear map of its last dimension
    assert solve_output(fit, forward, FitData(windows=16, **kw), conv) is fit


def test_a_bias_the_fit_does_not_hold_stays_as_it_is():
    """``o_proj``'s bias is the module's own (not among the fitted values): only the weight is solved,
    for what the outputs should be less that bias."""
    block, forward, fit, kw = _setup()
    block.o_proj.bias = torch.nn.Parameter(fit.values.pop("o_bias"), requires_grad=False)

    def without_bias(values, w):
        return forward(values | {"o_bias": block.o_proj.bias}, w)

    start = heldout_error(without_bias, fit.values, windows=split_windows(16)[1], **kw)
    fit = FitResult(fit.values, 2 * start, start, False, 10)
    solved = solve_output(fit, without_bias, FitData(windows=16, **kw), block.o_proj)
    assert solved.ridge in RIDGES and "o_bias" not in solved.values and solved.loss_after < start / 2
