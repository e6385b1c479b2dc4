"""KV-cache figures follow each layer's attention (issue 71): full layers hold every token, sliding and
chunked layers their window's last ``w - 1``; the bytes ``dims.kv_cache_bytes`` gives equal the cache
transformers builds after N tokens, below and above the window, for every family with sliding or mixed
layers, read from the ``config.json`` a real checkpoint carries (``layer_types`` given or not)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_model, tiny_config

from mha2gqa.core.architecture import dims_of
from mha2gqa.core.cache_layers import cache_spans, layer_types
from mha2gqa.core.errors import Mha2GqaError

MIXED = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
#: name -> (family, config overrides): windows of 8 tokens; mixed layers where the family has them
WINDOWED = {
    "mistral": ("mistral", {"sliding_window": 8}),
    "mixtral": ("mixtral", {"sliding_window": 8}),
    "ministral": ("ministral", {"sliding_window": 8, "layer_types": MIXED}),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {"layer_types": MIXED}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    "qwen2-no-window": ("qwen2", {"use_sliding_window": False, "sliding_window": 8}),
    "qwen2_moe-window": ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}),
    "starcoder2": ("starcoder2", {"sliding_window": 8}),
    "phi3": ("phi3", {"sliding_window": 8}),
}


def _measured(model, tokens: int) -> int:
    ids = torch.randint(3, 90, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_the_kv_bytes_are_the_cache_transformers_builds(name, tmp_path):
    """As saved (``layer_types`` listed), and as an older checkpoint without them, whose layers
    transformers' config class derives (the family's rule must derive the same)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    family, overrides = WINDOWED[name]
    random_model(tiny_config(family, num_hidden_layers=4, **overrides)).save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    older = {k: v for k, v in saved.items() if k != "layer_types"}
    (tmp_path / "older").mkdir()
    (tmp_path / "older" / "config.json").write_text(json.dumps(older))
    for config, folder in ((saved, "saved"), (older, "older")):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / folder)).eval()
        dims = dims_of(config)
        for tokens in (5, 8, 9, 20):
            assert dims.kv_cache_bytes(tokens, None, 4) == _measured(model, tokens), (name, folder, tokens)


def test_a_model_without_windows_counts_every_layer_at_full_length():
    dims = dims_of(tiny_config("llama").to_dict())
    assert dims.cache_spans is None and not dims.windowed
    assert dims.kv_cache_bytes(100, None, 2) == 100 * dims.kv_cache_bytes_per_token(None, 2)
    assert dims.kv_cache_bytes(100, 1, 2) == 100 * dims.kv_cache_bytes_per_token(1, 2)


def test_gemma3s_pattern_and_what_it_says():
    """Gemma 3 270M's shape: 18 layers, 5 sliding of 512 to 1 full; at 4,096 tokens the cache is 3.7x
    smaller than every layer at full length."""
    config = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 18,
              "hidden_size": 640, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
              "sliding_window": 512, "sliding_window_pattern": 6}  # fmt: skip
    dims = dims_of(config)
    assert (
        layer_types(config, 18, {"sliding": "(layer + 1) % (sliding_window_pattern or 6)"}).count("full_attention") == 3
    )
    full = dims.kv_cache_bytes_per_token(None, 2) * 4096
    assert full / dims.kv_cache_bytes(4096, None, 2) == pytest.approx(3.7, abs=0.05)
    assert dims.window_note() == "15 of 18 layers keep their last 511 tokens"


def test_shared_and_attention_free_layers_hold_nothing_and_bad_windows_are_refused():
    config = {"layer_types": ["full_attention", "sliding_attention", "mlp"], "sliding_window": 4,
              "kv_sharing_modes": ["own", "own", "own"]}  # fmt: skip
    assert cache_spans(config, 3) == (None, 3, 0)
    assert cache_spans({**config, "kv_sharing_modes": ["own", "reuse", "own"]}, 3) == (None, 0, 0)
    with pytest.raises(Mha2GqaError, match="sliding_window must be a positive integer"):
        cache_spans({"sliding_window": -4}, 2)
    with pytest.raises(Mha2GqaError, match="layer_types must name one attention type per layer"):
        cache_spans({"layer_types": ["full_attention"]}, 2)


@pytest.mark.parametrize("name", ["mistral", "gemma3", "qwen2-window"])
def test_inspect_plan_convert_and_bench_give_the_cache_transformers_holds(name, tmp_path):
    """Below and above the window: ``inspect --json``, ``plan``'s bytes per sequence, the conversion
    record (and card) and ``bench``'s planned bytes are the cache the model builds; the source and its
    1-KV-head conversion alike."""
    from mha2gqa.convert import convert_checkpoint
    from mha2gqa.core.conversion_record import read_conversion_record
    from mha2gqa.core.models import load_model
    from mha2gqa.eval.bench import bench_model
    from mha2gqa.serving.capacity import inspect_model, plan_capacity
    from mha2gqa.serving.sizing import PlanSettings

    family, overrides = WINDOWED[name]
    src = tmp_path / "src"
    random_model(tiny_config(family, num_hidden_layers=4, **overrides)).save_pretrained(src)
    out = convert_checkpoint(src, tmp_path / "g1", 1, "mean", progress=False).output
    for folder in (src, out):
        model = load_model(str(folder), torch.device("cpu"), torch.float32).model
        for tokens in (6, 30):
            measured = _measured(model, tokens)
            assert inspect_model(str(folder), tokens, 1).data["kv_cache_bytes"]["fp32"] == measured
            rows = plan_capacity(str(folder), PlanSettings(gpu="h100-sxm", seq_len=tokens, dtype="fp32")).rows
            own = next(r for r in rows if r.num_kv_heads == model.config.num_key_value_heads)
            assert own.kv_bytes_per_sequence == measured, (folder.name, tokens)
        kv = bench_model(model, 20, 4, repeats=1, warmup=0).kv_cache
        assert kv.planned_bytes == kv.measured_bytes, (folder.name, kv)
    windowed = read_conversion_record(out).conversion.windowed_cache
    assert windowed is not None and windowed.tokens == 64  # the model's positions, under 4,096
    assert windowed.bytes_after == _measured(load_model(str(out), torch.device("cpu"), torch.float32).model, 64)
    assert "KV cache a sequence" in (out / "README.md").read_text()


def test_the_reports_kv_bytes_are_the_checkpoints_and_follow_the_windows(tmp_path):
    """A bf16 checkpoint with sliding layers, evaluated in float32: the results count its KV cache in
    bf16 (what ``convert`` printed), name the evaluated dtype beside it, and size each sequence as the
    cache holds it."""
    from mha2gqa.convert import convert_checkpoint
    from mha2gqa.core.conversion_record import read_conversion_record
    from mha2gqa.core.models import load_model
    from mha2gqa.demo import build_tokenizer
    from mha2gqa.eval.harness import evaluate
    from mha2gqa.eval.settings import EvalSettings
    from mha2gqa.eval.tables import kv_rows

    text = tmp_path / "t.txt"
    text.write_text("\n\n".join(f"the cat {i % 7} sat on the mat and ran {i % 5} times" for i in range(300)))
    tok = build_tokenizer(text.read_text(), 300)
    model = random_model(tiny_config("mistral", vocab_size=len(tok), sliding_window=8)).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "src")
    tok.save_pretrained(tmp_path / "src")
    out = convert_checkpoint(tmp_path / "src", tmp_path / "g2", 2, "mean", progress=False).output
    facts = read_conversion_record(out).conversion
    settings = EvalSettings(data=str(text), max_tokens=256, seq_len=32, dtype="float32", progress=False)
    results = evaluate(str(tmp_path / "src"), str(out), settings)
    original, converted = results.models["original"], results.models["converted"]
    assert converted.dtype == "float32" and converted.kv_cache_dtype == "bfloat16"
    assert (original.kv_cache_bytes_per_token, converted.kv_cache_bytes_per_token) == (
        facts.kv_cache_bytes_per_token_before, facts.kv_cache_bytes_per_token_after)  # fmt: skip
    rows = {row[0]: row for row in kv_rows(results)}
    assert rows["converted"][2] == "bfloat16 (evaluated in float32)"
    fp32 = load_model(str(out), torch.device("cpu"), torch.float32).model
    assert converted.kv_cache_bytes(64) * 2 == _measured(fp32, 64)  # bf16: half the float32 cache's bytes
