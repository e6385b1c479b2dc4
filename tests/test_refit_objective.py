"""The refit's error is the model's: each token's stream over its own root mean square, what every
norm after it reads (:mod:`mha2gqa.convert.refit.objective`). Hand-computed values; the closed-form
output projection weights tokens as the error does; and a model with a massive activation (a unit
of its first MLP that fires on one frequent token, hundreds of times louder than the rest), where
the squared error of the stream fell in every layer while the model's KL rose, converts with every
layer's refit kept and the model closer to the original."""

import pytest
import torch
from conftest import random_model, tiny_config
from test_guard import assert_converts_alike
from test_methods import with_tokenizer

from mha2gqa.convert import convert_checkpoint
from mha2gqa.convert.refit import PLAIN, Objective
from mha2gqa.convert.refit.objective import scale_of
from mha2gqa.convert.refit.output_solve import NormalEquations
from mha2gqa.core.conversion_record import KEPT, KEPT_IN_PART, NORMALIZED_ERROR

NORMALIZED = Objective(normalize=True)


def test_the_error_is_the_normalized_streams_difference_by_hand():
    target = torch.tensor([[3.0, 4.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])  # rms 2.5 and 50
    out = torch.tensor([[3.0, 4.0, 0.0, 5.0], [200.0, 0.0, 0.0, 0.0]])  # rms sqrt(12.5) and 100
    squares = NORMALIZED.squares(out, target)
    first = out[0] / 12.5**0.5 - target[0] / 2.5
    torch.testing.assert_close(squares[0], first**2)
    assert squares[1].abs().max() == 0  # along the token's own direction: no norm sees it
    assert PLAIN.squares(out, target)[1, 0] == 100.0**2
    torch.testing.assert_close(NORMALIZED.squares(8 * out, 8 * target), squares)  # a stream scaled as a whole
    torch.testing.assert_close(NORMALIZED.weights(target), torch.tensor([[1 / 6.25], [1 / 2500]]))
    assert torch.isfinite(NORMALIZED.squares(out, torch.zeros_like(out))).all()  # an all-zero token
    assert PLAIN.weights(target) is None
    scale = scale_of(torch.tensor([1.0, 1.0, 2.0, 12.0]))  # the average is 4: only the last is louder
    torch.testing.assert_close(scale, torch.tensor([0.25, 0.25, 0.25, 1 / 12]))
    weighted = Objective(normalize=True, scale=scale).squares(out, target)
    torch.testing.assert_close(weighted, squares * scale)


def test_the_normal_equations_weight_each_token():
    """``weights`` d: the solve minimises sum_t d_t |a_t W^T + b - r_t|², least squares on rows times sqrt(d_t)."""
    g = torch.Generator().manual_seed(0)
    a, r, d = (torch.randn(2, 7, n, generator=g, dtype=torch.float64) for n in (3, 4, 1))
    d = d.abs()
    weighted = NormalEquations(bias=True)
    weighted.add(a, r, d)
    rows = (torch.cat([a, torch.ones(2, 7, 1, dtype=a.dtype)], -1) * d.sqrt()).flatten(0, 1)
    torch.testing.assert_close(weighted.gram, rows.T @ rows)
    torch.testing.assert_close(weighted.rhs, rows.T @ (r * d.sqrt()).flatten(0, 1))
    w, b = weighted.solve(torch.zeros(4, 3, dtype=a.dtype), torch.zeros(4, dtype=a.dtype), 1e-12)
    solution = torch.linalg.lstsq(rows, (r * d.sqrt()).flatten(0, 1)).solution
    torch.testing.assert_close(torch.cat([w, b[:, None]], 1), solution.T, atol=1e-8, rtol=1e-8)


def _massive(model, token: int, loudness: float = 50.0, sharpness: float = 20.0):
    """``model`` with one unit of layer 0's MLP firing on ``token`` (gate and up along its embedding,
    ``sharpness`` times the norm's scale) and writing ``loudness`` times a random direction: the
    stream at that token, and by what the unit half-reads elsewhere, hundreds of times the rest."""
    with torch.no_grad():
        mlp, norm = model.model.layers[0].mlp, model.model.layers[0].post_attention_layernorm
        e = model.model.embed_tokens.weight[token]
        reads = sharpness * e / e.norm() / norm.weight / e.numel() ** 0.5
        mlp.gate_proj.weight[0], mlp.up_proj.weight[0] = reads, reads
        d = torch.randn(e.numel(), generator=torch.Generator().manual_seed(100))
        mlp.down_proj.weight[:, 0] = loudness * d / d.norm()
    return model


@pytest.fixture
def massive_source(tmp_path):
    """``(folder, calibration text)``: a 3-layer Llama (hidden 64, 4 heads) with :func:`_massive` on "the"."""
    from mha2gqa.demo import build_tokenizer

    text = tmp_path / "calibration.txt"
    line = "the {} cats sat on {} mats while {} dogs ran and {} birds flew"
    text.write_text("\n\n".join(line.format(i % 9, i % 4, i % 7, i % 13) for i in range(600)))
    the = build_tokenizer(text.read_text(), 300)("the", add_special_tokens=False).input_ids[0]  # with_tokenizer's
    config = tiny_config(
        "llama", vocab_size=300, num_hidden_layers=3, hidden_size=64, intermediate_size=128, max_position_embeddings=64
    )
    return with_tokenizer(_massive(random_model(config), the), tmp_path / "src", text), text


def test_a_model_with_a_massive_activation_is_closer_with_every_layer_refitted(massive_source, tmp_path):
    src, text = massive_source
    kw = {"calibration": str(text), "calibration_tokens": 4096, "calibration_seq_len": 64, "progress": False}
    facts = convert_checkpoint(src, tmp_path / "out", 1, "svd", refit=True, **kw).facts
    assert facts.refit.error == NORMALIZED_ERROR
    assert all(r.loss_after < r.loss_before for r in facts.refit.layers), facts.refit.layers
    stage = facts.guard.stage("refit")
    # every layer's error fell, and so did the model's KL: refitting all three layers is as good as the
    # best prefix (by the squared error of the stream, layers 1 and 2 took the KL from 0.29 to 0.43)
    assert stage.outcome in (KEPT, KEPT_IN_PART) and stage.after.kl <= 1.05 * stage.published.kl, stage.line()
    assert stage.published.kl < 0.75 * stage.before.kl, stage.line()


def test_a_stream_scaled_as_a_whole_converts_to_the_same_quality(tmp_path):
    """The embedding and every projection that writes to the residual stream (o_proj, down_proj, their
    biases) x 4: the same function (every norm divides the factor out), a stream 4 times larger."""
    text = tmp_path / "calibration.txt"
    text.write_text("\n\n".join(f"the {i % 9} cats sat on {i % 4} mats while {i % 7} dogs ran" for i in range(400)))
    config = tiny_config("llama", vocab_size=300, tie_word_embeddings=False)
    src = with_tokenizer(random_model(config, seed=4), tmp_path / "src", text)
    model = random_model(config, seed=4)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(4)
        for projection in [p for layer in model.model.layers for p in (layer.self_attn.o_proj, layer.mlp.down_proj)]:
            projection.weight.mul_(4)
            if projection.bias is not None:
                projection.bias.mul_(4)
    assert_converts_alike(src, with_tokenizer(model, tmp_path / "louder", text), text, tmp_path, tolerance=1e-3)
