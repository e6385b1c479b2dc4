"""The closed-form last step of a layer's refit: the output projection by ridge regression.

With the refit's target the residual stream right after attention (``--refit-target attention``), the
fitted stream is ``x + o(A)``; a parallel layer fitted on its output gives ``x + o(A) + mlp(x)``. With
q/k/v fixed, the input of ``o_proj``, ``A`` ``[tokens, in]`` (the heads' values, concatenated), does not
depend on ``o_proj``, and either is linear in ``o_proj``'s weight ``W`` ``[out, in]`` (and bias
``b``). So, given the Adam fit's q/k/v, the weight that best reproduces the target on the fitted windows
is a least-squares solution, one regression per output dimension, each token weighted as the refit's
error weighs it to first order (:mod:`~mha2gqa.convert.refit.objective`: ``1 / rms(x)²``, the target
token's size as the next norm divides by it; the held-out check then judges the solution by the error
itself). The fitted tokens come in a few dozen correlated windows, and on a real model the plain
solution overfits them (docs/methods.md): it is shrunk toward the Adam fit's weights ``W0``,

    W^T = (AᵀDA + λ m I)^(-1) (AᵀDR + λ m W0^T),   m = the mean of AᵀDA's diagonal,

(``R``: what ``o(A)`` should be, the target less the rest; ``D``: the tokens' weights), with ``λ``
chosen on the held-out windows among :data:`RIDGES` by the caller. ``λ → ∞`` gives ``W0`` back;
``λ → 0``, the least-squares weight. A bias is one more input column of ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: ridges tried, as shares of the mean square of the projection's inputs (``λ`` above)
RIDGES = (0.01, 0.1, 1.0)


@dataclass
class NormalEquations:
    """``AᵀA`` ``[in(+1), in(+1)]`` and ``AᵀR`` ``[in(+1), out]`` (float64), summed over tokens; with
    ``bias``, ``A`` has a last column of ones."""

    bias: bool
    gram: torch.Tensor | None = None
    rhs: torch.Tensor | None = None
    tokens: int = 0

    def add(self, inputs: torch.Tensor, wanted: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Add tokens: ``inputs`` ``[..., in]`` the projection's inputs, ``wanted`` ``[..., out]`` what
        its outputs should be, ``weights`` ``[..., 1]`` each token's weight in the squared error (None:
        ones)."""
        a = inputs.reshape(-1, inputs.shape[-1]).double()
        r = wanted.reshape(-1, wanted.shape[-1]).double()
        if self.bias:
            a = torch.cat([a, a.new_ones(len(a), 1)], 1)
        if weights is not None:
            root = weights.reshape(-1, 1).double().sqrt()
            a, r = a * root, r * root
        gram, rhs = a.T @ a, a.T @ r
        self.gram = gram if self.gram is None else self.gram + gram
        self.rhs = rhs if self.rhs is None else self.rhs + rhs
        self.tokens += len(a)

    def solve(self, weight: torch.Tensor, bias: torch.Tensor | None, ridge: float) -> tuple[torch.Tensor, ...]:
        """``(weight, bias)`` (``bias`` None without one) minimising the squared error plus
        ``ridge * m`` times the squared distance to ``weight`` ``[out, in]`` / ``bias`` ``[out]`` (see
        the module doc), in their dtypes."""
        if self.gram is None:
            raise ValueError("no tokens added")
        if ridge <= 0:
            raise ValueError(f"ridge {ridge}: must be above zero")
        start = weight.double().T
        if self.bias:
            start = torch.cat([start, bias.double()[None]], 0)
        lam = ridge * float(self.gram.diagonal().mean())
        rhs = torch.add(self.rhs, start.to(self.gram.device), alpha=lam)
        del start
        system = self.gram.clone()
        system.diagonal().add_(lam)
        factor, info = torch.linalg.cholesky_ex(system)  # positive definite where any input is not zero
        del system
        if int(info) != 0:  # all inputs zero (or not finite): no output depends on the weight, keep it
            return weight, bias
        solved = torch.cholesky_solve(rhs, factor).T
        w = solved[:, : weight.shape[1]].to(weight)
        return (w.contiguous(), solved[:, -1].to(bias).contiguous() if self.bias else None)
