"""The stage guard: the figures it measures are what stock transformers computes on the written model;
a stage forced to hurt (a refit on shuffled targets, a distillation at a learning rate that wrecks it)
is undone, and the terminal, the record and the card say so; ``--guard fail`` stops instead; the
stages never read the guard's windows; a model rescaled without changing its function converts to
the same quality (steps sized to each projection)."""

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner
from conftest import llama_with_tokenizer, load, random_model, story_text, tiny_config
from test_convert import equalise_groups, read_all
from test_methods import with_tokenizer
from test_refit import source

from mha2gqa.cli import main
from mha2gqa.convert import convert_checkpoint
from mha2gqa.convert.guard import prefix_cuts, score_of
from mha2gqa.convert.settings import GUARD_WINDOWS
from mha2gqa.core.conversion_record import KEPT, KEPT_IN_PART, MEASURED, UNDONE, read_conversion_record
from mha2gqa.core.records import CONVERSION_RECORD, UPTRAIN_RECORD


def _independent(src, out, text, seq_len: int) -> tuple[float, float]:
    """``(KL, top-1)`` of ``out`` against ``src`` on the text's last GUARD_WINDOWS windows, both models
    loaded whole with stock transformers: what the guard must have measured."""
    from mha2gqa.core.models import load_tokenizer
    from mha2gqa.core.text import load_text, token_stream

    ids = token_stream(load_tokenizer(src), load_text(str(text)))[-GUARD_WINDOWS * seq_len :]
    ids = ids.reshape(GUARD_WINDOWS, seq_len)
    with torch.no_grad():
        p = torch.log_softmax(load(src)(ids).logits.float(), -1)
        q = torch.log_softmax(load(out)(ids).logits.float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean()), float((p.argmax(-1) == q.argmax(-1)).float().mean())


def _shuffle_refit_targets(monkeypatch) -> None:
    """Every layer's refit fitted (and checked) against another window's targets: a refit that lowers
    its own error and makes the model worse."""
    import mha2gqa.convert.refit.layerwise as refit_module  # where the refit calls them

    fit, solve = refit_module.fit_layer, refit_module.solve_output

    def other(targets, n):
        return lambda w: targets([(j + n // 2) % n for j in w])

    def shuffled(data):
        return dataclasses.replace(data, targets=other(data.targets, data.windows))

    def fit_layer(forward, start, trainable, data, how):
        return fit(forward, start, trainable, shuffled(data), how)

    def solve_output(result, forward, data, o_proj):
        return solve(result, forward, shuffled(data), o_proj)

    monkeypatch.setattr(refit_module, "fit_layer", fit_layer)
    monkeypatch.setattr(refit_module, "solve_output", solve_output)


def test_a_candidate_that_overflowed_scores_worst_and_is_recorded_as_json():
    import math

    from mha2gqa.core.conversion_record import GuardStage, StageGuard

    assert score_of(2.0, 3.0, 4) == score_of(2.0, 3.0, 4) and score_of(2.0, 3.0, 4).kl == 0.5
    assert score_of(-1e-9, 4.0, 4).kl == 0.0  # rounding below zero
    for bad in (math.inf, math.nan):
        worst = score_of(bad, 0.0, 4)
        assert worst.kl is None and worst.loss == math.inf and worst.loss > score_of(1e9, 0.0, 4).loss
        assert "KL inf" in str(worst)
        record = StageGuard("undo", 4, 256, "here", [GuardStage("merge", MEASURED, worst, worst)])
        assert "Infinity" not in json.dumps(dataclasses.asdict(record)) and "NaN" not in json.dumps(
            dataclasses.asdict(record)
        )


def test_prefix_cuts_split_the_refitted_layers_into_even_runs():
    assert prefix_cuts(list(range(8))) == [1, 3, 5, 7]
    assert prefix_cuts([0, 2, 3, 9, 10]) == [2, 3, 9, 10]  # ceil(5k/4): the 2nd, 3rd, 4th and 5th
    assert prefix_cuts([4, 6]) == [4, 6] and prefix_cuts([5]) == [5] and prefix_cuts([]) == []
    assert prefix_cuts(list(range(30)))[-1] == 29 and len(prefix_cuts(list(range(30)))) == 4


@pytest.mark.parametrize(
    ("family", "method", "extra"),
    [
        ("llama", "svd", {"refit": True, "refit_steps": 20}),
        ("phi3", "svd", {}),  # fused qkv
        ("phi", "svd", {"refit": True, "refit_steps": 20}),  # a parallel layer, partial rotary
        ("qwen3", "mean", {"refit": True, "refit_steps": 20}),  # per-head q/k norms
        ("gemma", "svd", {}),
        ("gemma2", "svd", {"refit": True, "refit_steps": 20}),  # sliding and full layers: masks by layer type
        ("gemma3", "mean", {"refit": True, "refit_steps": 20}),  # RoPE tables by layer type too
        ("mixtral", "svd", {"refit": True, "refit_steps": 20}),  # experts stored one per expert, fused in memory
        ("qwen2_moe", "svd", {}),
    ],
)
def test_the_guard_measures_what_stock_transformers_computes_on_the_written_model(
    family, method, extra, calib_text, tmp_path
):
    src = source(family, calib_text, tmp_path / "src")
    served = tmp_path / "served.txt"  # a --guard-data text: measured alike, in the same walk
    served.write_text("\n\n".join(f"a dog {i % 11} barked at {i % 3} birds in the old red barn" for i in range(300)))
    kw = {"calibration": str(calib_text), "calibration_tokens": 1024, "guard_data": (str(served),), "progress": False}
    out = convert_checkpoint(src, tmp_path / "out", 2, method, **kw, **extra)
    guard = out.facts.guard
    assert guard.windows == GUARD_WINDOWS and guard.tokens == GUARD_WINDOWS * 64 and guard.mode == "undo"
    assert guard.stages[0].stage == "merge" and guard.stages[0].outcome == MEASURED
    assert [s.stage for s in guard.stages] == ["merge", "refit"] if extra else ["merge"]
    kl, top1 = _independent(src, out.output, calib_text, 64)
    published = guard.stages[-1].published
    assert published.kl == pytest.approx(kl, rel=1e-3, abs=1e-5) and published.top1 == pytest.approx(top1, abs=2e-3)
    assert published.kl > 0  # a real loss measured, not a copy of the original
    kl, top1 = _first_windows(src, out.output, served, 64)
    (other,) = published.sources
    assert other.kl == pytest.approx(kl, rel=1e-3, abs=1e-5) and other.top1 == pytest.approx(top1, abs=2e-3)


def test_candidates_scored_together_score_as_each_alone_to_the_bit(calib_text, tmp_path):
    """The guard scores several candidates in one walk (the original's log-probabilities computed once
    a window for all of them): each one's figures are those it gets scored alone, to the bit, and
    what stock transformers computes on its written model; the original itself scores KL 0, top-1 1."""
    from mha2gqa.convert.guard import Guard, Weights, guard_windows
    from mha2gqa.convert.prepare import prepare
    from mha2gqa.convert.settings import ConvertSettings
    from mha2gqa.core.checkpoint import open_checkpoint

    src = source("llama", calib_text, tmp_path / "src")
    c = prepare(src, tmp_path / "unused", ConvertSettings(num_kv_heads=1))
    ids, _, _ = guard_windows(src, str(calib_text), 64)
    n = c.dims.num_layers
    plans = {"original": [None] * n}
    for g, method in ((2, "mean"), (1, "svd")):
        text = {"calibration": str(calib_text)} if method == "svd" else {}
        out = convert_checkpoint(src, tmp_path / f"g{g}", g, method, progress=False, **text)
        ckpt = open_checkpoint(str(out.output))
        plans[f"g{g}"] = [Weights(f"g{g}", ckpt.load, set(ckpt.tensors), (g,) * n)] * n
    together = Guard(c.ckpt, c.family, c.dims, ids, torch.device("cpu")).score(plans)
    for name, plan in plans.items():
        alone = Guard(c.ckpt, c.family, c.dims, ids, torch.device("cpu")).score({name: plan})[name]
        assert alone == together[name], name
    assert (together["original"].kl, together["original"].top1) == (0.0, 1.0)
    for g in (2, 1):  # what stock transformers computes on each written model
        kl, top1 = _independent(src, tmp_path / f"g{g}", calib_text, 64)
        assert kl > 0 and together[f"g{g}"].kl == pytest.approx(kl, rel=1e-4)
        assert together[f"g{g}"].top1 == pytest.approx(top1)


def test_a_refit_that_makes_the_model_worse_is_undone_and_every_output_says_so(calib_text, tmp_path, monkeypatch):
    src = source("llama", calib_text, tmp_path / "src", attention_bias=False)
    _shuffle_refit_targets(monkeypatch)
    args = ["convert", str(src), str(tmp_path / "out"), "-g", "1", "--method", "svd", "--calibration", str(calib_text),
            "--calibration-tokens", "1024", "--refit", "--refit-steps", "30", "-q"]  # fmt: skip
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 0, done.output
    assert "guard: refit: undone - held-out KL" in done.output, done.output
    record = json.loads((tmp_path / "out" / CONVERSION_RECORD).read_text())["conversion"]
    merge, refit = record["guard"]["stages"]
    assert refit["outcome"] == UNDONE and refit["after"]["kl"] > merge["after"]["kl"]
    assert refit["published"] == merge["after"] and refit["before"] == merge["after"]
    assert any(not layer["kept"] for layer in record["refit"]["layers"])  # the refit did run, and lowered its error
    card = (tmp_path / "out" / "README.md").read_text()
    assert "refit: undone - held-out KL" in card and "`svd+refit(undone)`" in card
    kl, _ = _independent(src, tmp_path / "out", calib_text, 64)  # what is published is the merge
    assert kl == pytest.approx(merge["after"]["kl"], rel=1e-3, abs=1e-5)
    # --guard fail: the same run stops, one line, nothing written
    failed = CliRunner().invoke(main, [*args[:2], str(tmp_path / "failed"), *args[3:], "--guard", "fail"])
    assert failed.exit_code != 0 and "--guard fail: refit: undone - held-out KL" in failed.output
    assert len(failed.output.strip().splitlines()) == 1, failed.output
    assert not (tmp_path / "failed").exists() and not list(tmp_path.glob(".failed*"))


def _loud_values(layers: int = 2, seed: int = 0):
    """A tiny Llama whose value dimensions that ``o_proj`` reads least are 16x louder (``v`` x 16,
    ``o`` / 16: the same function), which a plain value code chases and the output-weighted one sees through."""
    model = random_model(
        tiny_config("llama", vocab_size=300, attention_bias=False, num_hidden_layers=layers), seed=seed
    )
    with torch.no_grad():
        for layer in model.model.layers:
            heads, d = model.config.num_attention_heads, layer.self_attn.head_dim
            loud = torch.ones(d).index_fill_(0, torch.arange(d // 2), 16.0).repeat(heads)  # MHA: head h reads head h
            layer.self_attn.v_proj.weight.mul_(loud[:, None])
            layer.self_attn.o_proj.weight.div_(loud)
    return model


def test_an_undone_refit_publishes_svd_alone_where_its_merge_is_the_better(calib_text, tmp_path, monkeypatch):
    """With ``--refit``, ``svd`` merges from the values' principal subspace (a refit's better start);
    alone it publishes the output-weighted code. Here every value dimension ``o_proj`` reads least is
    made 16x louder (``v`` x 16, ``o`` / 16: the same function), which the plain code chases and the
    weighted one sees through. A refit forced to hurt is undone to the better merge: the very tensors
    of ``--method svd`` alone, so the recipe is never worse than it; the merge's line says which."""
    src = with_tokenizer(_loud_values(), tmp_path / "src", calib_text)
    kw = {"calibration": str(calib_text), "calibration_tokens": 1024, "progress": False}
    alone = convert_checkpoint(src, tmp_path / "alone", 1, "svd", **kw)
    _shuffle_refit_targets(monkeypatch)
    undone = convert_checkpoint(
        src, tmp_path / "undone", 1, "svd", refit=True, refit_steps=30, refit_precision="no", **kw
    )
    merge, refit = undone.facts.guard.stages
    assert refit.outcome == UNDONE and refit.before == merge.published == alone.facts.guard.stages[0].after
    start = float(merge.detail.split("the refit's start: KL ")[1].split(",")[0])
    assert merge.detail.startswith("the merge without --refit") and start > 1.1 * merge.after.kl, merge.detail
    a, b = read_all(alone.output), read_all(undone.output)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert f"guard: merge: measured - held-out {merge.after} (the merge without --refit" in undone.summary()


def test_a_refit_kept_in_part_takes_the_layers_after_it_from_the_better_merge(calib_text, tmp_path, monkeypatch):
    """The last two of four layers refitted against other windows' targets: the refit is published up
    to layer 1, and layers 2-3 are the better merge's (here ``svd`` alone's, the very tensors), not the
    refit's start."""
    import mha2gqa.convert.refit.layerwise as refit_module

    src = with_tokenizer(_loud_values(layers=4), tmp_path / "src", calib_text)
    kw = {"calibration": str(calib_text), "calibration_tokens": 1024, "progress": False}
    alone = read_all(convert_checkpoint(src, tmp_path / "alone", 1, "svd", **kw).output)
    good = refit_module.fit_layer, refit_module.solve_output
    _shuffle_refit_targets(monkeypatch)
    bad, calls = (refit_module.fit_layer, refit_module.solve_output), {"fit": 0, "solve": 0}

    def by_layer(what: str, n: int):  # layers 0-1 fitted as they are, 2-3 against shuffled targets
        def call(*args, **kwargs):
            calls[what] += 1
            return (good if calls[what] <= 2 else bad)[n](*args, **kwargs)

        return call

    monkeypatch.setattr(refit_module, "fit_layer", by_layer("fit", 0))
    monkeypatch.setattr(refit_module, "solve_output", by_layer("solve", 1))
    out = convert_checkpoint(src, tmp_path / "part", 1, "svd", refit=True, refit_steps=30, refit_precision="no", **kw)
    merge, refit = out.facts.guard.stages
    assert refit.outcome == KEPT_IN_PART and "layers up to 1" in refit.detail, refit.line()
    assert refit.published.loss < merge.published.loss and merge.detail.startswith("the merge without --refit")
    got = read_all(out.output)
    for name in got:
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if (layer is not None and layer >= 2) or ".self_attn." not in name:
            assert torch.equal(got[name], alone[name]), name
        elif name.endswith(("v_proj.weight", "o_proj.weight")):
            assert not torch.equal(got[name], alone[name]), name  # refitted


def test_a_refit_that_helps_is_kept_and_guard_off_measures_nothing(calib_text, tmp_path, monkeypatch):
    import mha2gqa.convert.calibration.streaming as streaming

    src = source("llama", calib_text, tmp_path / "src", attention_bias=False)
    kw = {"calibration": str(calib_text), "calibration_tokens": 1024, "refit": True, "progress": False}
    collect, asides = streaming.collect, []

    def spy(*args, **options):  # svd alone's code is kept aside only for the guard to score
        asides.append(args[3].weighted_aside)
        return collect(*args, **options)

    monkeypatch.setattr(streaming, "collect", spy)
    kept = convert_checkpoint(src, tmp_path / "kept", 1, "svd", **kw)
    merge, refit = kept.facts.guard.stages
    assert refit.outcome == KEPT and refit.published == refit.after and refit.after.loss < merge.after.loss
    assert "guard: refit: kept - held-out KL" in kept.summary() and kept.facts.recipe == "svd+refit"
    off = convert_checkpoint(src, tmp_path / "off", 1, "svd", guard="off", **kw)
    assert off.facts.guard is None and "guard" not in off.summary() and asides == [True, False]
    a, b = read_all(kept.output), read_all(off.output)  # kept whole: the same tensors as without the guard
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_stages_never_read_the_guard_windows(tmp_path):
    """A text too short for both: the stages read only the tokens before the guard's windows (the
    record says how many); a long one: they read what they were asked for."""
    from mha2gqa.core.models import load_tokenizer
    from mha2gqa.core.text import load_text, token_stream

    text = story_text(tmp_path / "short.txt", 60)
    src = llama_with_tokenizer(tmp_path / "src", text, max_positions=32)
    total = token_stream(load_tokenizer(src), load_text(str(text))).numel()
    assert GUARD_WINDOWS * 32 + 32 <= total < 4096
    out = convert_checkpoint(src, tmp_path / "out", 1, "svd", calibration=str(text), progress=False)
    assert out.record.settings["calibration_tokens"] == (total - GUARD_WINDOWS * 32) // 32 * 32  # whole windows
    assert out.facts.calibration.tokens <= total - GUARD_WINDOWS * 32
    tiny = story_text(tmp_path / "tiny.txt", 8)  # not enough for the windows and one more: not measured
    none = convert_checkpoint(src, tmp_path / "none", 1, "svd", calibration=str(tiny), progress=False)
    assert none.facts.guard.stages == [] and none.facts.guard.where.startswith("not measured")
    assert "guard: not measured" in none.summary()


def test_a_distillation_that_makes_the_model_worse_is_undone(tmp_path):
    """From an exact conversion (K/V heads equal in each group: the merge loses nothing), a
    distillation at a learning rate of 0.1 can only take the model away from SRC's: it is undone, and
    DST holds the conversion, bit for bit."""
    from mha2gqa.demo import build_tokenizer

    text = story_text(tmp_path / "calib.txt", 400)
    tok = build_tokenizer(text.read_text(), 300)
    model = random_model(tiny_config("llama", vocab_size=len(tok), max_position_embeddings=64), seed=5)
    equalise_groups(model, "llama", 1)
    model.save_pretrained(tmp_path / "src")
    tok.save_pretrained(tmp_path / "src")
    src = tmp_path / "src"
    common = ["convert", str(src), "-g", "1", "--method", "mean", "-q"]
    plain = CliRunner().invoke(main, [*common[:2], str(tmp_path / "plain"), *common[2:]])
    assert plain.exit_code == 0, plain.output
    calibration = ["--calibration", str(text), "--calibration-tokens", "2048", "--calibration-seq-len", "32"]
    distill = ["--distill", "--distill-steps", "8", "--distill-lr", "0.1"]
    done = CliRunner().invoke(main, [*common[:2], str(tmp_path / "dst"), *common[2:], *calibration, *distill])
    assert done.exit_code == 0, done.output
    assert "guard: distill: undone - held-out KL" in done.output, done.output
    assert "undone by the stage guard, DST holds the model before it" in done.output.splitlines()[-1]
    dst = tmp_path / "dst"
    assert (dst / "model.safetensors").read_bytes() == (tmp_path / "plain" / "model.safetensors").read_bytes()
    assert not (dst / UPTRAIN_RECORD).exists()  # the model published is the conversion
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt", "dst", "plain", "src"]  # no staging
    stages = json.loads((dst / CONVERSION_RECORD).read_text())["conversion"]["guard"]["stages"]
    assert [(s["stage"], s["outcome"]) for s in stages] == [("merge", MEASURED), ("distill", UNDONE)]
    assert stages[1]["published"] == stages[0]["after"] and stages[1]["after"]["kl"] > stages[0]["after"]["kl"]
    tries = stages[1]["detail"].split("; ")  # the rate, then a third of it, each worse; a ninth, worse too
    assert [t.split(":")[0] for t in tries] == ["--distill-lr 0.1", "--distill-lr 0.0333", "--distill-lr 0.0111"]
    assert "not below either (step " in tries[-1], tries  # with each checkpoint's KL
    assert "distill: undone - held-out KL" in (dst / "README.md").read_text()
    assert read_conversion_record(dst).conversion.recipe == "mean+distill(undone)"  # as every table names it
    failed = CliRunner().invoke(
        main, [*common[:2], str(tmp_path / "failed"), *common[2:], *calibration, *distill, "--guard", "fail"]
    )
    assert failed.exit_code != 0 and "--guard fail: distill: undone" in failed.output, failed.output
    assert not (tmp_path / "failed").exists()


def _rescaled(model) -> None:
    """The same function written differently, in every layer: v x 4 with o / 4; q x 2 with k / 2; the
    input norm's weight x 2 with q, k and v / 2 (powers of two: exact)."""
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn
            layer.input_layernorm.weight.mul_(2)
            for proj, scale in ((a.q_proj, 2 / 2), (a.k_proj, 1 / 4), (a.v_proj, 4 / 2)):
                proj.weight.mul_(scale)
            for proj, scale in ((a.q_proj, 2), (a.k_proj, 1 / 2), (a.v_proj, 4)):
                if proj.bias is not None:
                    proj.bias.mul_(scale)
            a.o_proj.weight.mul_(1 / 4)


def assert_converts_alike(src, rescaled, text, tmp_path, tolerance: float = 1e-4) -> None:
    """``rescaled`` computes ``src``'s logits (within ``tolerance``), and ``svd --refit`` to 1 KV head
    fits each of their layers to the same held-out error and the guard's KL alike (within 2%)."""
    ids = torch.tensor([[1, 5, 17, 33, 9, 60, 2, 41, 77, 12]])
    with torch.no_grad():
        torch.testing.assert_close(load(rescaled)(ids).logits, load(src)(ids).logits, atol=tolerance, rtol=tolerance)
    # float32: the invariance is the objective's; bf16 autocast (auto, on a CPU that multiplies bf16)
    # rounds the two streams apart, and a fit's learning-rate probe can amplify that past 2%
    kw = {
        "calibration": str(text),
        "calibration_tokens": 1024,
        "refit": True,
        "refit_precision": "no",
        "progress": False,
    }
    a, b = (convert_checkpoint(m, tmp_path / f"{m.name}-out", 1, "svd", **kw).facts for m in (src, rescaled))
    for x, y in zip(a.refit.layers, b.refit.layers, strict=True):  # each layer fitted alike
        assert y.loss_after == pytest.approx(x.loss_after, rel=0.02), (a.refit.layers, b.refit.layers)
    assert b.guard.stages[-1].published.kl == pytest.approx(a.guard.stages[-1].published.kl, rel=0.02)


def test_a_rescaled_model_converts_to_the_same_quality(calib_text, tmp_path):
    model = random_model(tiny_config("llama", vocab_size=300), seed=2)
    src = with_tokenizer(model, tmp_path / "src", calib_text)
    _rescaled(model)
    assert_converts_alike(src, with_tokenizer(model, tmp_path / "rescaled", calib_text), calib_text, tmp_path)


def test_a_per_layer_allocation_is_scored_against_uniform_counts_and_undone_when_worse(
    calib_text, tmp_path, monkeypatch
):
    """``--per-layer auto`` is a stage too: its merge against the merge at uniform counts within the same
    budget. An allocation forced to starve three of four layers (1, 1, 1, 4: 7 heads of the 8 that
    uniform 2 spends) loses, and the uniform conversion is published and loads with stock transformers."""
    src = source("llama", calib_text, tmp_path / "src", num_hidden_layers=4)
    kw = {"calibration": str(calib_text), "calibration_tokens": 1024, "per_layer": "auto", "progress": False}
    chosen = convert_checkpoint(src, tmp_path / "chosen", 2, "svd", **kw)
    stage = chosen.facts.guard.stage("allocation")
    assert stage is not None and stage.detail == "against 2 KV heads in every layer"
    assert stage.published.loss == min(stage.after.loss, stage.before.loss)
    monkeypatch.setattr("mha2gqa.convert.plan.allocation.allocate", lambda costs, budget: (1, 1, 1, 4))
    starved = convert_checkpoint(src, tmp_path / "starved", 2, "svd", **kw)
    stage = starved.facts.guard.stage("allocation")
    assert stage.outcome == UNDONE and stage.after.loss > stage.before.loss and stage.published == stage.before
    assert starved.facts.per_layer_allocation.chosen == [1, 1, 1, 4]  # what it chose, and undid
    assert starved.facts.num_kv_heads_per_layer is None and starved.facts.num_kv_heads_after == 2
    assert starved.facts.recipe == "svd/per-layer(auto, undone)" and "allocation: undone" in starved.summary()
    kl, _ = _independent(src, starved.output, calib_text, 64)
    assert kl == pytest.approx(stage.published.kl, rel=1e-3, abs=1e-5)


def test_a_distilled_model_evaluated_on_its_own_distillation_text_is_not_a_valid_verdict(tmp_path):
    """``mean --distill`` reads the text only for the distillation (its conversion record names no
    calibration): evaluated on that text, the verdict is NOT VALID all the same."""
    text = story_text(tmp_path / "calib.txt", 400)
    src = llama_with_tokenizer(tmp_path / "src", text, max_positions=64)
    args = ["convert", str(src), str(tmp_path / "dst"), "-g", "2", "--method", "mean", "--calibration", str(text),
            "--calibration-tokens", "2048", "--calibration-seq-len", "32", "--distill", "--distill-steps", "4",
            "-q"]  # fmt: skip
    assert CliRunner().invoke(main, args).exit_code == 0
    evaluated = CliRunner().invoke(
        main, ["eval", "--original", str(src), "--converted", str(tmp_path / "dst"), "--data", str(text),
               "--seq-len", "32", "--max-tokens", "512", "--no-attention", "-q"],
    )  # fmt: skip
    assert evaluated.exit_code == 0, evaluated.output
    verdict = [line for line in evaluated.output.splitlines() if line.startswith("verdict:")]
    assert verdict and verdict[0].startswith("verdict: NOT VALID (evaluated on the conversion's training text)"), (
        evaluated.output
    )


def test_a_budget_no_counts_can_spend_is_said_not_silently_halved(calib_text, tmp_path):
    """7 KV heads (divisors 1 and 7) in 2 layers with --kv-budget 2 (4 heads in all): only 1,1 fits,
    spending 2; the terminal warns and the summary says what was chosen against what was asked."""
    model = random_model(tiny_config("llama", vocab_size=300, hidden_size=28, num_attention_heads=7,
                                     num_key_value_heads=7), seed=0)  # fmt: skip
    src = with_tokenizer(model, tmp_path / "src", calib_text)
    args = ["convert", str(src), str(tmp_path / "out"), "--per-layer", "auto", "--kv-budget", "2", "--method",
            "svd", "--calibration", str(calib_text), "--calibration-tokens", "1024", "-q"]  # fmt: skip
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 0, done.output
    assert "no choice of 1, 7 KV heads per layer spends the budget of 4 KV heads; the best spends 2" in done.output
    assert "per-layer auto: chose 1,1, 2 of 4 KV heads" in done.output, done.output


def test_layers_of_two_kinds_in_one_family_are_measured_as_the_model_runs_them(calib_text, tmp_path):
    """Qwen2 with sliding-window attention in its first layer and full attention after it
    (``use_sliding_window``, ``max_window_layers``): each layer gets its own mask in the layer engine,
    so the guard's figures equal what stock transformers computes on the written model."""
    src = source("qwen2", calib_text, tmp_path / "src", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    from transformers import AutoConfig

    assert len(set(AutoConfig.from_pretrained(src).layer_types)) == 2  # the fixture has both kinds
    kw = {"calibration": str(calib_text), "calibration_tokens": 1024, "refit": True, "refit_steps": 20}
    out = convert_checkpoint(src, tmp_path / "out", 2, "svd", progress=False, **kw)
    kl, top1 = _independent(src, out.output, calib_text, 64)
    published = out.facts.guard.stages[-1].published
    assert published.kl == pytest.approx(kl, rel=1e-3, abs=1e-5) and published.top1 == pytest.approx(top1, abs=2e-3)


def test_the_models_head_runs_a_block_of_tokens_at_a_time_to_the_same_figures(calib_text, tmp_path, monkeypatch):
    """The stage guard and the ``logits`` allocation cost turn hidden states into next-token
    distributions a block of tokens at a time (``[rows, vocab]`` temporaries, never a window's whole
    logits: 2.5 GB a tensor at Qwen2's vocabulary and 4,096 tokens): at 5 tokens a call of the head
    (64-token windows, more streams than 5) the guard's figures and the allocation's costs are those
    of the whole windows at once."""
    from mha2gqa.convert.engine.layers import ModelHead

    src = source("llama", calib_text, tmp_path / "src", num_hidden_layers=4)
    kw = {"calibration": str(calib_text), "calibration_tokens": 1024, "progress": False}
    kw |= {"per_layer": "auto", "allocation_cost": "logits"}
    whole = convert_checkpoint(src, tmp_path / "whole", 2, "svd", **kw)
    widths: list[int] = []
    call = ModelHead.__call__

    def recorded(self, hidden: torch.Tensor, as_tuple: bool) -> torch.Tensor:
        widths.append(hidden.shape[1])
        return call(self, hidden, as_tuple)

    monkeypatch.setattr(ModelHead, "__call__", recorded)
    monkeypatch.setattr("mha2gqa.core.memory.HEAD_BLOCK", 4 * 300 * 5)  # float32 x vocab 300 x 5 tokens
    blocks = convert_checkpoint(src, tmp_path / "blocks", 2, "svd", **kw)
    assert widths and max(widths) <= 5  # calibration windows and guard windows alike: 64 tokens
    costs = blocks.record.conversion.per_layer_allocation.costs
    for layer, by_count in whole.record.conversion.per_layer_allocation.costs.items():
        assert costs[layer] == pytest.approx(by_count, rel=1e-5, abs=1e-9), layer
    stages, before = blocks.facts.guard.stages, whole.facts.guard.stages
    assert [(s.stage, s.outcome) for s in stages] == [(s.stage, s.outcome) for s in before]
    for stage, was in zip(stages, before, strict=True):  # the whole-window figures: stock transformers' (above)
        assert stage.published.kl == pytest.approx(was.published.kl, rel=1e-5) and stage.published.kl > 0
        assert stage.published.top1 == was.published.top1


def _first_windows(src, out, text, seq_len: int) -> tuple[float, float]:
    """``(KL, top-1)`` of ``out`` against ``src`` on the text's first GUARD_WINDOWS windows, with stock
    transformers: what the guard must have measured on a ``--guard-data`` text."""
    from mha2gqa.core.models import load_tokenizer
    from mha2gqa.core.text import load_text, token_stream

    ids = token_stream(load_tokenizer(src), load_text(str(text)))[: GUARD_WINDOWS * seq_len]
    ids = ids.reshape(GUARD_WINDOWS, seq_len)
    with torch.no_grad():
        p = torch.log_softmax(load(src)(ids).logits.float(), -1)
        q = torch.log_softmax(load(out)(ids).logits.float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean()), float((p.argmax(-1) == q.argmax(-1)).float().mean())


def test_a_guard_data_text_is_scored_on_its_own_after_every_stage(calib_text, tmp_path):
    """``--guard-data``: every stage's figures on the further text too, as stock transformers computes them
    on the written model; the calibration text's figures and the published tensors as without it (where
    the decisions agree); the record, the card and the terminal name the text."""
    src = source("llama", calib_text, tmp_path / "src", attention_bias=False)
    other = tmp_path / "texts" / "served.txt"
    other.parent.mkdir()
    other.write_text("\n\n".join(f"a dog {i % 11} barked at {i % 3} birds in the old red barn" for i in range(300)))
    kw = {"calibration": str(calib_text), "calibration_tokens": 1024, "refit": True, "progress": False}
    plain = convert_checkpoint(src, tmp_path / "plain", 1, "svd", **kw)
    guarded = convert_checkpoint(src, tmp_path / "guarded", 1, "svd", guard_data=(str(other),), **kw)
    g = guarded.facts.guard
    assert g.sources == [f"served.txt's first {GUARD_WINDOWS * 64:,} tokens ({GUARD_WINDOWS} windows of 64)"]
    for stage, alone in zip(g.stages, plain.facts.guard.stages, strict=True):
        assert [s.name for s in stage.after.sources] == ["served.txt"] and stage.after.sources[0].kl > 0
        assert (stage.after.kl, stage.after.top1) == (alone.after.kl, alone.after.top1)  # the same stage, run
    merge, refit = g.stages
    assert refit.outcome == (KEPT if refit.after.beats(merge.published) else UNDONE)  # served.txt decides too
    kl, top1 = _first_windows(src, guarded.output, other, 64)
    published = g.stages[-1].published.sources[0]
    assert published.kl == pytest.approx(kl, rel=1e-3, abs=1e-5) and published.top1 == pytest.approx(top1, abs=2e-3)
    if refit.outcome == plain.facts.guard.stages[-1].outcome:  # the same decisions: the same tensors
        a, b = read_all(plain.output), read_all(guarded.output)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "served.txt KL" in guarded.summary() and "served.txt's first" in (guarded.output / "README.md").read_text()
    assert str(other.parent) not in (guarded.output / CONVERSION_RECORD).read_text()
    recipe = guarded.output / "mha2gqa_recipe.yaml"
    assert "  guard_data:\n  - served.txt\n" in recipe.read_text()
    (guarded.output / "served.txt").write_bytes(other.read_bytes())  # the recipe finds its text beside it
    again = ["convert", str(src), str(tmp_path / "again"), "--recipe", str(recipe), "--calibration", str(calib_text)]
    result = CliRunner().invoke(main, [*again, "-q"])
    assert result.exit_code == 0, result.output
    a, b = read_all(guarded.output), read_all(tmp_path / "again")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_stage_that_makes_a_guard_data_text_worse_is_not_kept():
    """By hand: a stage is kept only with a lower calibration KL and no further text's KL more than
    SOURCE_TOLERANCE above it; the refit's published prefix is the best of those that qualify."""
    from mha2gqa.convert.guard import GuardRun
    from mha2gqa.core.conversion_record import SOURCE_TOLERANCE, GuardScore, SourceScore

    def score(kl: float, served: float) -> GuardScore:
        return GuardScore(kl, 0.5, [SourceScore("served.txt", served, 0.5)])

    before = score(1.0, 1.0)
    assert score(0.5, 1.0 + SOURCE_TOLERANCE / 2).beats(before) and not score(0.5, 1.0 + 2 * SOURCE_TOLERANCE).beats(
        before
    )
    assert not score(1.0, 0.5).beats(before) and score(0.5, 9.0).worse_on(before) == ["served.txt"]
    assert GuardScore(0.5, 0.5).beats(GuardScore(1.0, 0.5))  # no further text: the calibration's KL alone
    run = GuardRun("undo", None, 0, "")
    scores = {1: score(0.6, 1.001), 3: score(0.4, 1.5)}  # the whole refit is best here, and worse on served.txt
    stage, published = run._refit_stage(scores, [1, 3], [0, 1, 2, 3], before)
    assert (stage.outcome, published, stage.published) == (KEPT_IN_PART, 1, scores[1])
    assert "served.txt KL 1 -> 1.5 (worse)" in stage.line()
    stage, published = run._refit_stage({1: score(0.6, 2.0), 3: score(0.4, 1.5)}, [1, 3], [0, 1, 2, 3], before)
    assert (stage.outcome, published, stage.published) == (UNDONE, -1, before)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--guard-data", "{short}"], "--guard-data {short}: "),
        (["--guard-data", "{missing}"], "no such file"),
        (["--guard-data", "{short}", "--guard", "off"], "is scored by the stage guard"),
    ],
)
def test_a_bad_guard_data_text_is_refused_in_one_line_before_any_work(calib_text, tmp_path, args, says):
    src = source("llama", calib_text, tmp_path / "src", attention_bias=False)
    short = tmp_path / "short.txt"
    short.write_text("too short")
    fill = {"short": str(short), "missing": str(tmp_path / "nope.txt")}
    args = [a.format(**fill) for a in args]
    base = ["convert", str(src), str(tmp_path / "out"), "-g", "1", "--method", "svd", "--calibration", str(calib_text)]
    result = CliRunner().invoke(main, [*base, "--calibration-tokens", "1024", *args, "-q"])
    assert result.exit_code != 0 and says.format(**fill) in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()
