"""Real checkpoints from ../shared/fixtures (skipped when the folder is absent)."""

import math

import pytest
import torch
from conftest import FIXTURES, FIXTURES_ABSENT, load, logits, requires_fixtures

from mha2gqa.convert import convert_checkpoint
from mha2gqa.eval.perplexity import disjoint_windows, score_windows


def disjoint_ppl(model, ids, seq_len: int, batch_size: int) -> float:
    res = score_windows([model], disjoint_windows(ids, seq_len), batch_size)
    return math.exp(res.nll_sum[0] / res.tokens)


def text_ids(model_dir, text, n):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok((FIXTURES / "text" / text).read_text(encoding="utf-8")[: n * 8], return_tensors="pt").input_ids[0][:n]


@pytest.mark.parametrize("name", ["stories260K", "babyllama105"])
def test_pooling_duplicated_heads_recovers_the_real_gqa_model(name, tmp_path):
    pytest.importorskip("transformers")
    if not (FIXTURES / f"{name}-mha-expanded").exists():
        pytest.skip(f"{FIXTURES_ABSENT}: {name}-mha-expanded")
    out = convert_checkpoint(FIXTURES / f"{name}-mha-expanded", tmp_path / "out", 4, "mean", progress=False).output
    ids = torch.randint(3, 100, (2, 96), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(load(out), ids), logits(load(FIXTURES / name), ids), atol=1e-5, rtol=0)


@requires_fixtures("stories260K")
@pytest.mark.parametrize("g", [2, 1])
def test_real_gqa_model_regroups(g, tmp_path):
    out = convert_checkpoint(FIXTURES / "stories260K", tmp_path / "out", g, "mean", progress=False).output
    model = load(out)
    gen = model.generate(
        torch.tensor([[1, 403, 407]]), max_new_tokens=8, min_new_tokens=8, do_sample=False, return_dict_in_generate=True
    )
    assert all(layer.keys.shape[1] == g for layer in gen.past_key_values.layers)


@requires_fixtures("aidreams260K")
@pytest.mark.parametrize("g", [2, 1])
def test_real_mha_model_converts_and_loads(g, tmp_path):
    out = convert_checkpoint(FIXTURES / "aidreams260K", tmp_path / "out", g, "mean", progress=False).output
    model = load(out)
    assert model.config.num_key_value_heads == g
    assert torch.isfinite(logits(model, torch.tensor([[1, 50, 60, 70]]))).all()


@requires_fixtures("stories260K-mha-expanded", "text")
def test_reference_perplexities_of_the_fixture_readme(tmp_path):
    """The fixtures README's mean-pooling table (first 100,000 TinyStories tokens, windows of 512)."""
    src = FIXTURES / "stories260K-mha-expanded"
    ids = text_ids(src, "tinystories_train_head.txt", 100_000)
    assert ids.numel() == 100_000
    assert math.isclose(disjoint_ppl(load(src), ids, 512, batch_size=8), 6.1990, abs_tol=6e-5)
    out = convert_checkpoint(src, tmp_path / "g2", 2, "mean", progress=False).output
    assert math.isclose(disjoint_ppl(load(out), ids, 512, batch_size=8), 145.80, abs_tol=6e-3)
