"""What the refit compares: a layer's stream against the original's, as the rest of the model reads it.

Every later layer, and the model's head, reads the residual stream through a normalisation (RMSNorm
or LayerNorm) that divides each token's vector by its own size. An error ``e`` on a token whose
stream has root mean square ``s`` moves what they read by about ``e / s``, and an error along the
token's own direction not at all. Real models put a few tokens (the first, a delimiter) hundreds of
times above the rest (SmolLM2-135M's first token: RMS ~1,000 against ~6 in its middle layers), so a
plain squared error is mostly those tokens' error, which no norm after them lets through: a fit that
lowers it can make the model worse (docs/methods.md, "The refit's error, as the model reads it"). The
refit's error is therefore that of the normalised streams, each hidden dimension weighted:

    error(y, x) = mean over tokens t and dimensions d of  s_d (y_t / rms(y_t) - x_t / rms(x_t))_d²,

``rms`` over the hidden dimension of each token, ``s_d`` = 1 / max(the dimension's mean square in the
normalised target, the average one): a few dimensions stay large in every token (SmolLM2's 507 and
247: ~10x the median) and count relative to their size, the rest as they are (:func:`scale_of`).
The error is a share of each token's size, the same for a stream scaled as a whole. The norms' own
weights are left out (a rescaling the model can move into the projections they feed), and LayerNorm's
centring too (one direction of the hidden dimension).

:data:`PLAIN` is the squared error (the fitter's default, for streams no norm reads). An objective's
:meth:`~Objective.weights` are what the closed-form solve of the output projection (linear least
squares) weights each token by: its error to first order, ``1 / rms(x)²``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: the smallest mean square a token's stream is divided by (an all-zero token's error stays finite)
TINY = 1e-30


def mean_square(x: torch.Tensor) -> torch.Tensor:
    """``[..., 1]``: each token's mean square over the hidden dimension (at least :data:`TINY`)."""
    return x.pow(2).mean(-1, keepdim=True).clamp_min(TINY)


def normalized(x: torch.Tensor) -> torch.Tensor:
    """``x / rms(x)`` ``[..., hidden]``: each token's vector over its root mean square."""
    return x * mean_square(x).rsqrt()


@dataclass(frozen=True)
class Objective:
    """The refit's error: of the streams (``normalize``: each over its tokens' RMS), each hidden
    dimension's squares times ``scale`` ``[hidden]`` (None: ones)."""

    normalize: bool = False
    scale: torch.Tensor | None = None

    def squares(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]``: the error's terms (their mean is the error)."""
        squares = (normalized(out) - normalized(target)) ** 2 if self.normalize else (out - target) ** 2
        return squares if self.scale is None else squares * self.scale

    def weights(self, target: torch.Tensor) -> torch.Tensor | None:
        """``[..., 1]``: each token's weight in a least-squares solve (its error to first order), None: ones."""
        return 1 / mean_square(target) if self.normalize else None


PLAIN = Objective()


def scale_of(mean_squares: torch.Tensor) -> torch.Tensor:
    """``s`` ``[hidden]`` from each dimension's mean square ``[hidden]`` (of the normalised target):
    1 / max(it, their average)."""
    return (1 / mean_squares.clamp_min(float(mean_squares.mean()))).float()
