"""Layer-wise refitting after the merge (``--refit``): each changed decoder layer, in order, gets its
projections fitted so that, reading the *converted* model's own hidden states, it reproduces what
the *original* layer gives on the original's hidden states (so later layers also correct what
earlier ones lost). No training of the model as a whole: one small regression per layer.

Streamed like calibration, through the layer engine (:mod:`mha2gqa.convert.engine.layers`): the model is built on
``meta``, the embeddings run once, then each layer is loaded once (float32), runs the original
stream (its outputs are the targets), is fitted on the converted stream and runs it again with the
fitted weights, and is emptied. Memory: one layer (plus Adam's two moments of the fitted
projections) and two streams of hidden states ``[windows, seq, hidden]`` float32 (three with the
attention target: the original's stream after attention), which go to memory-mapped files when they
exceed ``--refit-memory``.

The converted layer runs as the *source* layer class reading the new K/V heads each repeated over
the source heads it replaced (a GQA layer with ``G`` groups is exactly the MHA layer whose K/V heads
are equal within each group, :mod:`~mha2gqa.convert.engine.layer_view`): separate K/V projections are swapped for
:class:`~mha2gqa.convert.engine.layer_view.RepeatedHeads`,
which repeat their outputs; a fused projection gets repeated weights. So every family's own
attention, RoPE, biases and per-head norms run as transformers wrote them, and the gradient of a
shared K/V head is the sum over its group: tied parameters stay tied by construction. Per-head norms
and everything outside the projections stay as the merge left them.

What the fit reproduces (``--refit-target``): by default the residual stream after the attention
block, ``x + attn(x)``, where the layer reads its input only through it (a pre-norm layer; checked on
each layer by :func:`reads_after_attention`), so a step runs the layer only as far as its attention
(a hook stops it there) and neither runs nor differentiates the MLP; matching that stream matches
everything after it. Layers of other shapes (attention beside the MLP, normed after) are fitted on
their output, as is every layer with ``layer``.

The fit: Adam on the error of that target as the rest of the model reads it, each token's stream
over its own root mean square (:mod:`~mha2gqa.convert.refit.objective`: a real model's few huge tokens
and hidden dimensions would otherwise be nearly all of a plain squared error, though no norm after
them sees it), each projection's step sized to its own RMS (so that a rescaled model is fitted the
same way: :func:`relative_steps`), over
``--refit-batch`` windows per step; one window in :data:`HELDOUT_EVERY` (at least one) is held out
and checked :data:`CHECKS` times per layer; the best held-out weights are kept, the fit stops after
:data:`PATIENCE` checks that took off less than :data:`MIN_GAIN` of it (not before half its steps),
and a layer whose held-out error did not fall keeps its merged weights (bit for bit). A layer whose
error starts at zero (an exact conversion) is not touched. Where what the fit matches is linear in the
output projection's output (the stream after attention; a parallel layer's output), that projection
then gets its closed-form solution given the fitted q/k/v (:func:`solve_output`), shrunk toward Adam's
and kept only where it lowers the held-out error.
"""

from mha2gqa.convert.engine.layers import batched
from mha2gqa.convert.refit.fit import (
    CHECKS,
    HELDOUT_EVERY,
    MIN_GAIN,
    PATIENCE,
    PROBE,
    FitData,
    FitResult,
    FitSteps,
    chunks,
    fit_layer,
    heldout_error,
    probe_near,
    relative_steps,
    solve_output,
    split_windows,
)
from mha2gqa.convert.refit.layerwise import refit
from mha2gqa.convert.refit.objective import PLAIN, Objective
from mha2gqa.convert.refit.stops import after_attention, reads_after_attention
from mha2gqa.convert.refit.streams import CALL_TOKENS, HiddenStates, call_tokens

__all__ = [
    "CALL_TOKENS",
    "CHECKS",
    "HELDOUT_EVERY",
    "MIN_GAIN",
    "PATIENCE",
    "PLAIN",
    "PROBE",
    "FitData",
    "FitResult",
    "FitSteps",
    "HiddenStates",
    "Objective",
    "after_attention",
    "batched",
    "call_tokens",
    "chunks",
    "fit_layer",
    "heldout_error",
    "probe_near",
    "reads_after_attention",
    "refit",
    "relative_steps",
    "solve_output",
    "split_windows",
]
