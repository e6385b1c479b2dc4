"""Exactness at real scale, on SmolLM2-135M (30 layers, 9 query / 3 KV heads, head_dim 64, built from
the fixtures' GGUF once into mha2gqa's cache): its MHA form (each KV head copied over its group)
converts back to the real model bit for bit, one KV head is the same from either form, and the
activation-aware merge of equal heads leaves the logits as they were. Skipped without the fixture
or the ``gguf`` package."""

import pytest
import torch
from conftest import FIXTURES, FIXTURES_ABSENT, load, logits
from real_fixtures import Unavailable, smollm2, wikitext_split
from test_convert import read_all

from mha2gqa.convert import convert_checkpoint


@pytest.fixture(scope="module")
def smol():
    try:
        return smollm2(FIXTURES)
    except Unavailable as e:
        pytest.skip(f"{FIXTURES_ABSENT}: {e}")


def test_the_mha_form_converts_back_to_the_model_bit_for_bit(smol, tmp_path):
    model, mha = smol
    out = convert_checkpoint(mha, tmp_path / "gqa3", 3, "mean", progress=False).output
    got, want = read_all(out), read_all(model)
    assert got.keys() == want.keys() and len(got) == 272
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, different[:5]


def test_one_kv_head_is_the_same_from_either_form(smol, tmp_path):
    model, mha = smol
    a = read_all(convert_checkpoint(mha, tmp_path / "from9", 1, "mean", progress=False).output)
    b = read_all(convert_checkpoint(model, tmp_path / "from3", 1, "mean", progress=False).output)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
    assert a["model.layers.0.self_attn.k_proj.weight"].shape == (64, 576)


def test_svd_of_equal_heads_keeps_the_logits_at_real_depth(smol, tmp_path):
    model, mha = smol
    calib, _ = wikitext_split(FIXTURES, tmp_path)
    out = convert_checkpoint(
        mha, tmp_path / "svd3", 3, "svd", calibration=str(calib), calibration_tokens=1024, progress=False
    ).output
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 7042, 30, 378, 3842, 282, 4649, 314]])
    want, got = logits(load(model), ids), logits(load(out), ids)
    assert float((got - want).abs().max()) < 2e-2 * float(want.abs().max())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
