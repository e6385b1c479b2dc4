"""Every family × every conversion feature, in process on tiny random models (every weight, bias and
norm random): each cell either converts to a model that stock transformers (or, for per-layer counts,
mha2gqa's loader) loads with the asked KV heads in its config, its weights and its cache, whose logits
are finite and which generates; or it is refused in one line (a :class:`Mha2GqaError`). A traceback
is a failure. The variants are layouts real checkpoints use that the families' fixtures do not."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILY_CONFIGS, cached_heads, random_model, tiny_config
from test_methods import with_tokenizer

from mha2gqa.convert import convert_checkpoint
from mha2gqa.core.errors import Mha2GqaError

#: name -> (family, config overrides): the fixtures' families and real checkpoints' variants
VARIANTS: dict[str, tuple[str, dict]] = {name: (name, {}) for name in sorted(FAMILY_CONFIGS)} | {
    "llama3-rope": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "phi4-mini": ("phi3", {"partial_rotary_factor": 0.75}),  # partial rotary in a fused qkv
    "stablelm-2-1.6b": ("stablelm", {"qk_layernorm": False}),  # no per-head norms
}

#: feature -> (KV heads: one count, or None for per-layer; convert_checkpoint keywords)
FEATURES: dict[str, tuple[int | None, dict]] = {
    "merge": (2, {}),
    "similarity": (2, {"method": "mean", "grouping": "similarity"}),
    "per-layer-auto": (None, {"per_layer": "auto", "kv_budget": 2, "allocation_cost": "logits"}),
    "per-layer-counts": (None, {"num_kv_heads_per_layer": "2,1"}),
    "first": (2, {"method": "first"}),
    "random": (2, {"method": "random"}),
    "aligned": (2, {"method": "aligned"}),
    "refit": (1, {"refit": True, "refit_steps": 4}),
    "refit-on-layer-outputs": (1, {"refit": True, "refit_steps": 4, "refit_target": "layer"}),
    "refit+distill": (1, {"refit": True, "refit_steps": 4, "distill": True, "distill_steps": 2}),
    "self-text": (1, {"refit": True, "refit_steps": 4, "self_text": 0.25}),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory, calib_text):
    root = tmp_path_factory.mktemp("matrix")
    made = {}

    def source(variant: str):
        if variant not in made:
            family, overrides = VARIANTS[variant]
            model = random_model(tiny_config(family, vocab_size=300, **overrides), seed=4)
            made[variant] = with_tokenizer(model, root / variant, calib_text)
        return made[variant]

    return source


def _settings(variant: str, feature: str, source, calib_text) -> tuple[int | None, dict]:
    """The cell's count and keywords: ``svd`` where the checkpoint takes it, else ``mean`` (and a
    count the family can hold); calibration text wherever the cell reads it."""
    from safetensors import safe_open

    from mha2gqa.convert.methods import get_method, incompatibility
    from mha2gqa.convert.plan.groupings import get_grouping
    from mha2gqa.convert.settings import ConvertSettings
    from mha2gqa.core.families import families
    from mha2gqa.pipeline.distill import split_options

    g, kw = FEATURES[feature]
    family = families()[VARIANTS[variant][0]]
    with safe_open(source / "model.safetensors", "pt") as f:
        names = set(f.keys())
    if "method" not in kw:
        svd = incompatibility(get_method("svd"), get_grouping("contiguous"), family, names) is None
        kw = {**kw, "method": "svd" if svd and family.attention_interface else "mean"}
    if family.flag_only and g is not None:
        g = 1  # GPTBigCode: one KV head or one per query head
    calibration = {"calibration": str(calib_text), "calibration_tokens": 512, "calibration_seq_len": 32}
    if ConvertSettings(num_kv_heads=g, **split_options(kw)[0]).reads_calibration or kw.get("distill"):
        kw |= calibration
    return g, kw


def _check(output, asked: int | None, counts: list[int], family: str) -> None:
    """The written model loads, holds ``counts`` KV heads per layer, gives finite logits and generates."""
    from mha2gqa.core.models import load_model

    model = load_model(str(output), torch.device("cpu"), torch.float32).model
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, use_cache=True)
    assert torch.isfinite(out.logits).all()
    cache = out.past_key_values
    heads = model.config.num_attention_heads
    for layer, g in enumerate(counts):
        keys = cache.layers[layer].keys
        assert keys.shape[1] == cached_heads(family, heads, g), (layer, keys.shape)
    if asked is not None:
        assert all(c == asked for c in counts)
    new = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    assert new.shape[1] == 15


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_family_runs_every_feature_or_refuses_it_in_one_line(variant, feature, sources, calib_text, tmp_path):
    from mha2gqa.convert.settings import ConvertSettings
    from mha2gqa.pipeline import Recipe, prepare
    from mha2gqa.pipeline.distill import DistillSettings, split_options

    g, kw = _settings(variant, feature, sources(variant), calib_text)
    convert, distill = split_options(kw)
    try:
        s = ConvertSettings(num_kv_heads=g, progress=False, **convert)
        d = DistillSettings(**distill).check(s)
        if d.distill:
            prepared = prepare(Recipe(s, d), str(sources(variant)), tmp_path / "out", log=lambda *_: None)
            result = prepared.run().conversion
        else:
            result = convert_checkpoint(sources(variant), tmp_path / "out", g, progress=False, **convert)
    except Mha2GqaError as e:
        assert len(str(e).splitlines()) == 1 and str(e).strip(), str(e)
        return
    _check(tmp_path / "out", g, list(result.kv_heads_per_layer), VARIANTS[variant][0])


#: families whose positions are a learned table, as their configs spell them (GPT-2 and GPT-BigCode:
#: ``n_positions``; OPT: two rows more than ``max_position_embeddings``), each at fewer positions (64)
#: than the stages' default windows (512): every window a stage or the guard cuts must fit them (issue 68)
LEARNED_POSITIONS: dict[str, dict] = {
    "gpt2": dict(n_embd=32, n_head=4, n_layer=2, n_positions=64),
    "opt": dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, ffn_dim=64, max_position_embeddings=64,
                word_embed_proj_dim=32),
    "gpt_bigcode": dict(n_embd=32, n_head=4, n_layer=2, n_positions=64, multi_query=False),
}  # fmt: skip

#: the stages at their default windows: the merge (guarded), the refit (guarded) and the distillation
DEFAULT_WINDOW_STAGES: dict[str, dict] = {
    "svd": {},
    "self-text": {"refit": True, "refit_steps": 4, "self_text": 0.25},
    "refit": {"refit": True, "refit_steps": 4},
    "refit+distill": {"refit": True, "refit_steps": 4, "distill": True, "distill_steps": 2},
}


@pytest.fixture(scope="module")
def learned_sources(tmp_path_factory, calib_text):
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("learned")
    made = {}

    def source(kind: str):
        if kind not in made:
            config = AutoConfig.for_model(kind, vocab_size=300, **LEARNED_POSITIONS[kind])
            made[kind] = with_tokenizer(random_model(config, seed=4), root / kind, calib_text)
        return made[kind]

    return source


@pytest.mark.parametrize("stage", sorted(DEFAULT_WINDOW_STAGES))
@pytest.mark.parametrize("kind", sorted(LEARNED_POSITIONS))
def test_learned_position_families_convert_to_one_kv_head_at_the_default_windows(
    kind, stage, learned_sources, calib_text, tmp_path
):
    """``-g 1 --method svd`` with the guard on and no ``--calibration-seq-len``: the statistics, the
    refit's streams, the guard and the distillation all cut windows the model's positions hold."""
    from mha2gqa.convert.settings import ConvertSettings
    from mha2gqa.pipeline import Recipe, prepare
    from mha2gqa.pipeline.distill import DistillSettings, split_options

    kw = {"method": "svd", "calibration": str(calib_text), "calibration_tokens": 1024, **DEFAULT_WINDOW_STAGES[stage]}
    convert, distill = split_options(kw)
    s = ConvertSettings(num_kv_heads=1, progress=False, **convert)
    d = DistillSettings(**distill).check(s)
    lines: list[str] = []
    if d.distill:
        result = prepare(Recipe(s, d), str(learned_sources(kind)), tmp_path / "out", log=lines.append).run().conversion
        assert any(line.startswith("guard: distill:") for line in lines), lines
    else:
        result = convert_checkpoint(learned_sources(kind), tmp_path / "out", 1, progress=False, **convert)
    assert result.guard is not None and result.guard.stages[0].stage == "merge", result.guard  # the guard ran
    _check(tmp_path / "out", 1, list(result.kv_heads_per_layer), "gpt_bigcode")


@pytest.mark.parametrize("kind", sorted(LEARNED_POSITIONS))
def test_eval_and_uptrain_of_learned_position_families_fit_their_default_windows(
    kind, learned_sources, calib_text, tmp_path
):
    """``eval`` and ``uptrain`` with no ``--seq-len`` read windows of the model's 64 positions; one more
    than the model holds is refused in one line naming the setting."""
    from mha2gqa.eval.harness import evaluate
    from mha2gqa.eval.settings import EvalSettings
    from mha2gqa.uptrain import UptrainSettings, uptrain

    src = learned_sources(kind)
    out = convert_checkpoint(src, tmp_path / "g1", 1, "mean", progress=False).output
    results = evaluate(str(src), str(out), EvalSettings(data=str(calib_text), max_tokens=512, progress=False))
    assert results.protocols["disjoint"].settings["seq_len"] == 64, results.protocols["disjoint"]
    kw = dict(data=str(calib_text), teacher=str(src), objective="kd", max_steps=1, batch_size=1, progress=False)
    done = uptrain(str(out), UptrainSettings(output=str(tmp_path / "up"), **kw), log=lambda *_: None)
    assert done.steps == 1 and done.tokens == 64, done
    with pytest.raises(Mha2GqaError, match="longer than the model's 64 positions"):
        uptrain(str(out), UptrainSettings(output=str(tmp_path / "up2"), seq_len=65, **kw), log=lambda *_: None)
