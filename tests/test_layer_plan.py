"""Each layer's plan (core.conversion_record.LayerPlan, made by convert.plan.layer_plan): decided once,
after calibration and before any tensor is written, read by the writer, the refit and the record."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from conftest import random_model, tiny_config
from test_methods import calibrated, with_tokenizer

from mha2gqa.convert.methods import get_method
from mha2gqa.convert.plan.layer_plan import layer_plans
from mha2gqa.core.conversion_record import COPY, FRESH, POOL, REWRITE, LayerPlan, read_conversion_record
from mha2gqa.core.dims import AttentionDims
from mha2gqa.core.typed import RecordError, read

DIMS = AttentionDims(num_layers=3, num_heads=8, num_kv_heads=4, head_dim=16, hidden_size=128)


def _stats(*perms):
    return SimpleNamespace(layers={i: SimpleNamespace(perm=p) for i, p in enumerate(perms)})


@pytest.mark.parametrize(("method", "how"), [("mean", POOL), ("first", POOL), ("random", FRESH), ("svd", REWRITE)])
def test_each_method_s_layers_are_planned_as_it_writes_them(method, how):
    plans = layer_plans(DIMS, (2, 4, 1), get_method(method))
    assert [p.how for p in plans] == [how, COPY, how]  # the layer that keeps its 4 KV heads: a byte copy
    assert [(p.kv_heads_before, p.kv_heads_after) for p in plans] == [(4, 2), (4, 4), (4, 1)]
    assert [p.changed for p in plans] == [True, False, True]
    assert all(p.refit == () and p.refit_target is None and not p.solve_output for p in plans)


def test_a_regrouped_layer_is_rewritten_and_an_identity_order_is_pooled():
    stats = _stats([0, 2, 1, 3], [0, 1, 2, 3], [3, 2, 1, 0])
    plans = layer_plans(DIMS, (2, 2, 4), get_method("mean"), stats)
    assert [p.how for p in plans] == [REWRITE, POOL, COPY]  # q/o move with a new order; none for its own
    assert plans[0].permutation == (0, 2, 1, 3) and plans[0].regrouped
    assert plans[1].permutation == (0, 1, 2, 3) and not plans[1].regrouped
    assert plans[2].permutation is None  # a copied layer has no order to keep


def test_the_refit_s_part_is_planned_for_every_changed_layer_alone():
    plans = layer_plans(DIMS, (1, 4, 1), get_method("svd"), None, ("q", "k", "v", "o"), "attention")
    assert [p.refit for p in plans] == [("q", "k", "v", "o"), (), ("q", "k", "v", "o")]
    assert [p.refit_target for p in plans] == ["attention", None, "attention"]
    assert [p.solve_output for p in plans] == [True, False, True]
    kv_only = layer_plans(DIMS, (1, 1, 1), get_method("svd"), None, ("k", "v"), "layer")
    assert all(p.refit == ("k", "v") and p.refit_target == "layer" and not p.solve_output for p in kv_only)


def test_a_plan_reads_back_through_its_type_and_a_bad_one_is_refused():
    plan = LayerPlan(0, 4, 2, REWRITE, (1, 0, 3, 2), ("k", "v"), "attention", False)
    data = json.loads(json.dumps(dataclasses.asdict(plan)))
    assert read(LayerPlan, data, "plan") == plan
    with pytest.raises(RecordError, match="how"):
        read(LayerPlan, {**data, "how": "melt"}, "plan")
    for bad in ({"permutation": [0, 0, 1, 2]}, {"permutation": [0, 1, 2]}, {"permutation": [0, 1, 2, 4]},
                {"kv_heads_after": 3}, {"kv_heads_after": 0}, {"layer": -1}):  # fmt: skip
        with pytest.raises(RecordError, match=r"^plan has "):
            read(LayerPlan, {**data, **bad}, "plan")


def test_the_conversion_record_holds_the_plan_the_writer_followed(calib_text, tmp_path):
    """Under similarity grouping with strided equal heads the plan says which layers were regrouped, and
    the written tensors are what that plan says: q/o rewritten where regrouped, copies where kept."""
    from safetensors.torch import load_file
    from test_convert import equalise_groups

    from mha2gqa.convert import convert_checkpoint

    model = random_model(tiny_config("llama", vocab_size=300, num_hidden_layers=3), seed=13)
    equalise_groups(model, "llama", 2, strided=True)
    src = with_tokenizer(model, tmp_path / "src", calib_text)
    out = convert_checkpoint(
        src, tmp_path / "out", None, num_kv_heads_per_layer="2,4,2",
        **calibrated(calib_text, "mean", grouping="similarity"),
    ).output  # fmt: skip
    plans = read_conversion_record(out).conversion.layer_plans
    assert [p.how for p in plans] == [REWRITE, COPY, REWRITE]
    assert [p.permutation for p in plans] == [(0, 2, 1, 3), None, (0, 2, 1, 3)]
    source, written = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    for plan in plans:
        q = f"model.layers.{plan.layer}.self_attn.q_proj.weight"
        assert torch.equal(source[q], written[q]) == (plan.how == COPY)


def test_the_refit_refuses_a_conversion_that_was_never_planned(calib_text, tmp_path):
    """The plan is made once, before any tensor is written: a caller that skips it gets one clear error,
    not a refit that decides each layer again."""
    from mha2gqa.convert.prepare import prepare
    from mha2gqa.convert.refit import refit
    from mha2gqa.convert.settings import ConvertSettings

    s = ConvertSettings(num_kv_heads=2, refit=True, **calibrated(calib_text, "svd"))
    src = with_tokenizer(random_model(tiny_config("llama", vocab_size=300)), tmp_path / "src", calib_text)
    c = prepare(src, tmp_path / "dst", s)
    with pytest.raises(ValueError, match="planned conversion"):
        refit(c, [], tmp_path / "work")
    assert len(c.planned(None).plans) == c.dims.num_layers
