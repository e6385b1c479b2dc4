"""Per-layer KV-head counts (issue 13, explicit lists): exact oracles, loading, cache, eval, uptrain."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import bench_argv, eval_argv, llama_with_tokenizer, logits, random_model, save, story_text, tiny_config

from mha2gqa.cli import main
from mha2gqa.convert import convert_checkpoint
from mha2gqa.core.errors import Mha2GqaError, SettingError
from mha2gqa.core.models import load_model

IDS = torch.tensor([[1, 5, 17, 33, 9, 60, 2, 41, 77, 12, 3, 90]])
HEADS = (8, 4, 2, 1)  # layer by layer


def _ours(folder: Path):
    return load_model(str(folder), torch.device("cpu"), torch.float32).model


def _equalise(model, per_layer: tuple[int, ...]) -> None:
    """Make the K/V heads inside each contiguous group of each layer identical, layer ``l`` having
    ``per_layer[l]`` groups: then pooling each layer to its count changes nothing."""
    h, d = model.config.num_key_value_heads, model.config.head_dim
    with torch.no_grad():
        for layer, g in zip(model.model.layers, per_layer, strict=True):
            size = h // g
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                for j in range(g):
                    first = proj.weight[j * size * d : (j * size + 1) * d].clone()
                    for m in range(1, size):
                        proj.weight[(j * size + m) * d : (j * size + m + 1) * d] = first


def llama8(**overrides):
    """A 4-layer Llama config with 8 heads of 8 (MHA), no biases."""
    base = dict(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, hidden_size=64, head_dim=8,
                attention_bias=False, vocab_size=300)  # fmt: skip
    return tiny_config("llama", **{**base, **overrides})


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("perlayer")
    model = random_model(llama8(max_position_embeddings=64), seed=21)
    _equalise(model, HEADS)
    return save(model, root / "src")


@pytest.mark.parametrize("method", ["mean", "first", "svd", "aligned"])
def test_equalised_heads_convert_per_layer_with_unchanged_logits(source, method, tmp_path):
    kw = {"calibration": str(story_text(tmp_path / "c.txt")), "calibration_tokens": 256, "calibration_seq_len": 32}
    if method in ("mean", "first"):
        kw = {}
    src = source
    if kw:  # calibration reads text: the source needs a tokenizer
        src = tmp_path / "src"
        import shutil

        shutil.copytree(source, src)
        from mha2gqa.demo import build_tokenizer

        build_tokenizer(Path(kw["calibration"]).read_text(), 300).save_pretrained(src)
    out = convert_checkpoint(
        src, tmp_path / "out", None, method, num_kv_heads_per_layer="8,4,2,1", progress=False, **kw
    )
    assert out.kv_heads_per_layer == list(HEADS)
    before = logits(_ours(src), IDS)
    after = _ours(out.output)
    torch.testing.assert_close(logits(after, IDS), before, atol=1e-4, rtol=1e-4)
    assert [layer.self_attn.k_proj.out_features // 8 for layer in after.model.layers] == list(HEADS)


def test_the_cache_holds_each_layers_heads_and_transformers_loads_it_with_remote_code(source, tmp_path):
    from transformers import AutoModelForCausalLM

    out = convert_checkpoint(source, tmp_path / "out", None, num_kv_heads_per_layer="8,4,2,1", progress=False)
    config = json.loads((out.output / "config.json").read_text())
    assert config["num_key_value_heads_per_layer"] == [8, 4, 2, 1] and config["num_key_value_heads"] == 8
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_mha2gqa.Mha2GqaPerLayerLlamaForCausalLM"
    ours = _ours(out.output)
    with torch.no_grad():
        cache = ours(IDS, use_cache=True).past_key_values
    assert [layer.keys.shape[1] for layer in cache.layers] == list(HEADS)  # measured, not computed
    assert [layer.values.shape[1] for layer in cache.layers] == list(HEADS)
    stock = AutoModelForCausalLM.from_pretrained(out.output, trust_remote_code=True).eval()
    assert type(stock).__name__ == "Mha2GqaPerLayerLlamaForCausalLM"
    gen = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(stock.generate(IDS, **gen), ours.generate(IDS, **gen))
    record = json.loads((out.output / "mha2gqa_conversion.json").read_text())["conversion"]
    assert record["num_kv_heads_per_layer"] == [8, 4, 2, 1]
    assert record["kv_cache_bytes_per_token_after"] == 2 * (8 + 4 + 2 + 1) * 8 * 4  # fp32, head_dim 8
    assert "per layer" in (out.output / "README.md").read_text()
    info = json.loads(CliRunner().invoke(main, ["inspect", str(out.output), "--json"]).output)
    assert info["parameters"] == sum(p.numel() for p in ours.parameters())  # only each layer's own K/V
    assert info["kv_cache_bytes_per_token"]["fp32"] == 2 * 15 * 8 * 4


def test_equal_values_give_exactly_the_uniform_checkpoint(source, tmp_path):
    listed = convert_checkpoint(source, tmp_path / "a", None, num_kv_heads_per_layer="4,4,4,4", progress=False)
    uniform = convert_checkpoint(source, tmp_path / "b", 4, progress=False)
    for name in ("model.safetensors", "config.json"):
        assert (listed.output / name).read_bytes() == (uniform.output / name).read_bytes(), name
    assert not (listed.output / "modeling_mha2gqa.py").exists() and listed.facts.num_kv_heads_per_layer is None


def test_eval_bench_and_uptrain_run_on_a_per_layer_checkpoint(tmp_path):
    from mha2gqa.eval.harness import evaluate
    from mha2gqa.eval.settings import EvalSettings
    from mha2gqa.uptrain import UptrainSettings, uptrain

    text = story_text(tmp_path / "t.txt")
    parent = llama_with_tokenizer(tmp_path / "mha", text)  # 2 layers, 4 heads
    out = convert_checkpoint(parent, tmp_path / "pl", None, num_kv_heads_per_layer="2,1", progress=False).output
    r = evaluate(
        str(parent),
        str(out),
        EvalSettings(data=str(text), seq_len=32, max_tokens=400, samples=1, sample_tokens=3, progress=False),
    )
    assert r.converted.kv_heads_per_layer == [2, 1]
    assert r.agreement.kl.mean > 0 and len(r.attention.layers) == 2
    assert r.converted.kv_cache_bytes_per_token == 2 * 3 * 8 * 4
    bench = tmp_path / "b.json"
    res = CliRunner().invoke(
        main,
        bench_argv(parent, out, bench, "--prompt-len 8 --new-tokens 4 --repeats 1"),
    )
    assert res.exit_code == 0, res.output
    kv = json.loads(bench.read_text())["models"]["converted"]["kv_cache"]
    assert kv["measured_bytes"] == kv["planned_bytes"]
    run = tmp_path / "up"
    uptrain(
        str(out),
        UptrainSettings(data=str(text), output=str(run), seq_len=32, batch_size=2, max_steps=2, progress=False),
        log=lambda *_: None,
    )
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(run, trust_remote_code=True)
    assert again.config.num_key_value_heads_per_layer == [2, 1] and (run / "modeling_mha2gqa.py").is_file()
    assert [layer.self_attn.k_proj.out_features for layer in again.model.layers] == [2 * 8, 1 * 8]


def _refusal(source: Path, dst: Path, **kw) -> str:
    """The one-line error converting ``source`` with ``kw`` (``g``: ``-g``) raises."""
    with pytest.raises((Mha2GqaError, SettingError)) as e:
        convert_checkpoint(source, dst, kw.pop("g", None), progress=False, **kw)
    return str(e.value)


def test_per_layer_bad_input(source, tmp_path):
    def err(**kw) -> str:
        return _refusal(source, tmp_path / "x", **kw)

    assert "one per layer" in err(num_kv_heads_per_layer="8,4,2")
    assert "not valid for a model with 8 KV heads" in err(num_kv_heads_per_layer="8,4,3,1")
    assert "comma-separated integers" in err(num_kv_heads_per_layer="8,four,2,1")
    assert "one of the two" in err(g=4, num_kv_heads_per_layer="8,4,2,1")
    assert "one of the two" in err()
    falcon = save(random_model(tiny_config("falcon", num_hidden_layers=2)), tmp_path / "falcon")
    with pytest.raises(SettingError, match="grouped per head inside one fused projection"):
        convert_checkpoint(falcon, tmp_path / "y", None, num_kv_heads_per_layer="2,1", progress=False)
    done = convert_checkpoint(source, tmp_path / "pl", None, num_kv_heads_per_layer="8,4,2,1", progress=False).output
    with pytest.raises(Mha2GqaError, match="already have different KV-head counts"):
        convert_checkpoint(done, tmp_path / "z", 1, progress=False)
    res = CliRunner().invoke(main, ["convert", str(source), str(tmp_path / "w"), "--num-kv-heads-per-layer", "8,4"])
    assert res.exit_code == 1 and "one per layer" in res.output and "Traceback" not in res.output
    for bad, why in (("8,4", "one per layer"), ("8,x,2,1", "comma-separated integers"), ("8,4,3,1", "divisor of 8")):
        res = CliRunner().invoke(main, ["plan", str(source), "--num-kv-heads-per-layer", bad])
        assert res.exit_code == 1 and why in res.output and "--num-kv-heads-per-layer" in res.output, res.output


def test_allocation_is_the_exact_optimum_of_the_budget():
    import itertools
    import random

    from mha2gqa.convert.plan.allocation import allocate

    rng = random.Random(3)
    for _ in range(30):
        layers = rng.randint(1, 4)
        costs = [{g: (0.0 if g == 8 else rng.random()) for g in (8, 4, 2, 1)} for _ in range(layers)]
        budget = rng.randint(layers, 8 * layers)
        got = allocate(costs, budget)
        best = min(
            sum(c[g] for c, g in zip(costs, combo, strict=True))
            for combo in itertools.product((8, 4, 2, 1), repeat=layers)
            if sum(combo) <= budget
        )
        assert sum(got) <= budget
        assert sum(c[g] for c, g in zip(costs, got, strict=True)) == pytest.approx(best, abs=1e-12)
    with pytest.raises(SettingError, match="cannot give each"):
        allocate([{2: 0.0, 1: 0.1}] * 3, 2)


def test_auto_allocation_finds_the_layers_that_can_share_and_keeps_the_logits(source, tmp_path):
    """Layer l's heads are alike in groups of 8 / 4 / 2 / 1 -> with a budget of 15 KV heads (3.75 per
    layer), the only allocation that loses nothing is 8, 4, 2, 1; uniform G = 2 (8 heads) cannot."""
    import shutil

    from mha2gqa.demo import build_tokenizer

    text = story_text(tmp_path / "c.txt")
    src = tmp_path / "src"
    shutil.copytree(source, src)
    build_tokenizer(text.read_text(), 300).save_pretrained(src)
    kw = dict(calibration=str(text), calibration_tokens=256, calibration_seq_len=32, progress=False)
    out = convert_checkpoint(src, tmp_path / "auto", None, per_layer="auto", kv_budget=3.75, **kw)
    assert out.kv_heads_per_layer == list(HEADS)
    by_residual = convert_checkpoint(
        src, tmp_path / "res", None, per_layer="auto", kv_budget=3.75, allocation_cost="residual", **kw
    )
    assert by_residual.kv_heads_per_layer == list(HEADS)
    assert by_residual.record.conversion.per_layer_allocation.cost_measure.startswith("mean merge residual")
    torch.testing.assert_close(logits(_ours(out.output), IDS), logits(_ours(src), IDS), atol=1e-4, rtol=1e-4)
    alloc = out.record.conversion.per_layer_allocation
    assert alloc.budget_kv_heads == 15 and alloc.chosen == list(HEADS) and alloc.cost < 1e-9
    assert alloc.costs["3"]["1"] < 1e-9 < alloc.costs["0"]["4"]  # layer 3's heads are all alike
    assert alloc.uniform_cost["2"] > 0.01 and "per-layer allocation" in (out.output / "README.md").read_text()
    svd = convert_checkpoint(src, tmp_path / "svd", 2, "svd", per_layer="auto", **kw)  # budget: 2 per layer
    assert sum(svd.kv_heads_per_layer) <= 8
    assert alloc.cost_measure.startswith("the model's next-token KL")  # the default cost
    by_output = convert_checkpoint(
        src, tmp_path / "out", None, per_layer="auto", kv_budget=3.75, allocation_cost="output", **kw
    )
    assert by_output.kv_heads_per_layer == list(HEADS)
    alloc = by_output.record.conversion.per_layer_allocation
    assert alloc.cost < 1e-9 < alloc.costs["0"]["4"] and alloc.cost_measure.startswith("the layer's output error")


def test_the_logits_cost_is_the_models_kl_with_that_layer_alone_converted(tmp_path):
    """Differential: each layer's ``logits`` cost equals the mean KL(source || model) per token of a
    model converted at that layer only (every other layer keeps its 8 heads), scored on the first
    calibration windows, the ones the cost follows."""
    import shutil

    from mha2gqa.convert.engine.layers import calibration_ids
    from mha2gqa.convert.plan.allocation import LOGITS_WINDOWS
    from mha2gqa.demo import build_tokenizer

    text = story_text(tmp_path / "c.txt")
    src = save(random_model(llama8(max_position_embeddings=64), seed=5), tmp_path / "src")
    build_tokenizer(text.read_text(), 300).save_pretrained(src)
    kw = dict(calibration=str(text), calibration_tokens=256, calibration_seq_len=32, progress=False)
    out = convert_checkpoint(src, tmp_path / "auto", 2, "svd", per_layer="auto", allocation_cost="logits", **kw)
    costs = out.record.conversion.per_layer_allocation.costs
    windows = calibration_ids(src, str(text), 256, 32)[:LOGITS_WINDOWS]
    source = _ours(src)
    for layer, g in ((0, 2), (2, 1), (3, 4)):
        counts = ",".join(str(g if i == layer else 8) for i in range(4))
        one = convert_checkpoint(src, tmp_path / "one", None, "svd", num_kv_heads_per_layer=counts, **kw)
        converted = _ours(one.output)
        ref = torch.log_softmax(logits(source, windows).double(), -1)
        got = torch.log_softmax(logits(converted, windows).double(), -1)
        kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
        assert costs[str(layer)][str(g)] == pytest.approx(kl, rel=1e-3, abs=1e-7), (layer, g)
        shutil.rmtree(one.output)
    assert all(costs[str(i)]["8"] == 0 and costs[str(i)]["1"] > costs[str(i)]["4"] for i in range(4))
    fresh = convert_checkpoint(src, tmp_path / "random", 2, "random", per_layer="auto", **kw)  # nothing to follow
    assert set(fresh.record.conversion.per_layer_allocation.costs["1"].values()) == {0.0, 1.0}


@pytest.mark.parametrize(
    ("family", "method"),
    [("phi3", "svd"), ("stablelm", "mean"), ("olmo2", "mean"), ("gemma3", "mean"), ("mixtral", "svd")],
)
def test_each_familys_costs_are_the_models_kl_with_that_layer_alone_converted(family, method, calib_text, tmp_path):
    """The output-level costs run a layer as the conversion writes it, for every layout: a fused qkv
    (Phi-3), per-head key norms (StableLM's per head, OLMo-2's over the projection, Gemma 3's with
    its per-layer-type RoPE), experts stored one per expert (Mixtral). Differential, as above."""
    from test_refit import source

    from mha2gqa.convert.engine.layers import calibration_ids
    from mha2gqa.convert.plan.allocation import LOGITS_WINDOWS

    src = source(family, calib_text, tmp_path / "src", seed=2)
    kw = dict(
        method=method, calibration=str(calib_text), calibration_tokens=512, calibration_seq_len=32, progress=False
    )
    out = convert_checkpoint(
        src, tmp_path / "auto", None, per_layer="auto", kv_budget=2, allocation_cost="logits", **kw
    )
    costs = out.record.conversion.per_layer_allocation.costs
    windows = calibration_ids(src, str(calib_text), 512, 32)[:LOGITS_WINDOWS]
    ref = torch.log_softmax(logits(_ours(src), windows).double(), -1)
    for layer, g in ((0, 1), (1, 2)):
        counts = ",".join(str(g if i == layer else 4) for i in range(2))
        plain = kw if method == "svd" else {"method": method, "progress": False}  # mean reads no text
        one = convert_checkpoint(src, tmp_path / f"one{layer}", None, num_kv_heads_per_layer=counts, **plain)
        got = torch.log_softmax(logits(_ours(one.output), windows).double(), -1)
        kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
        assert kl > 1e-6 and costs[str(layer)][str(g)] == pytest.approx(kl, rel=1e-3, abs=1e-7), (layer, g)
    by_output = convert_checkpoint(src, tmp_path / "output", None, per_layer="auto", kv_budget=2, **kw)
    assert by_output.record.conversion.per_layer_allocation.costs["0"]["1"] > 0


def test_auto_allocation_bad_input(source, tmp_path):
    def err(**kw) -> str:
        return _refusal(source, tmp_path / "x", **kw)

    assert "needs a budget" in err(per_layer="auto")
    assert "measures each layer on calibration text" in err(per_layer="auto", g=2)
    text = str(story_text(tmp_path / "c.txt"))
    assert "outside 1..8" in err(per_layer="auto", kv_budget=0.5, calibration=text)
    assert "outside 1..8" in err(per_layer="auto", kv_budget=9, calibration=text)
    assert "chooses each layer's count" in err(per_layer="auto", num_kv_heads_per_layer="8,4,2,1")
    assert "add --per-layer auto" in err(g=2, kv_budget=1.5)


def test_report_shows_the_per_layer_budget(tmp_path):
    import re

    text = story_text(tmp_path / "t.txt")
    parent = llama_with_tokenizer(tmp_path / "mha", text)
    out = convert_checkpoint(parent, tmp_path / "pl", None, num_kv_heads_per_layer="2,1", progress=False).output
    res = tmp_path / "r.json"
    args = eval_argv(parent, out, text, "32", "300", "-q", "--output", res)
    assert CliRunner().invoke(main, args).exit_code == 0
    html = tmp_path / "r.html"
    assert CliRunner().invoke(main, ["report", str(res), "--html", str(html)]).exit_code == 0
    page = html.read_text()
    assert re.search(r'<figure id="per_layer_heads-0"><img alt="per_layer_heads" src="data:image/png;base64,', page)
    assert "<th>KV heads</th><th>KV B/token</th>" in page and 'id="head_sharing-0"' not in page


@pytest.mark.parametrize(
    "family", ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi", "olmo", "starcoder2", "phi3", "stablelm", "olmo2"]
)
def test_every_supported_family_loads_per_layer_both_ways(family, tmp_path):
    from transformers import AutoModelForCausalLM

    heads = tiny_config(family).num_key_value_heads
    src = save(random_model(tiny_config(family, num_hidden_layers=2)), tmp_path / "src")
    per_layer = f"{heads},{heads // 2}" if family == "mistral" else "2,1"
    out = convert_checkpoint(src, tmp_path / "out", None, num_kv_heads_per_layer=per_layer, progress=False).output
    ids = torch.tensor([[1, 5, 17, 33, 9, 60]])
    ours = _ours(out)
    with torch.no_grad():
        got = ours(ids, use_cache=True)
    assert [layer.keys.shape[1] for layer in got.past_key_values.layers] == [int(g) for g in per_layer.split(",")]
    stock = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    torch.testing.assert_close(logits(stock, ids), got.logits, atol=1e-5, rtol=1e-5)


def test_llama_sources_also_get_the_nemotron_nas_form_that_vllm_and_llama_cpp_read(tmp_path):
    """Read back exactly as vLLM's nemotron_nas.py and llama.cpp's DeciModel read it: KV heads
    ``H // n_heads_in_group`` and MLP width ``ffn_width(ffn_mult, hidden)`` equal the weights' shapes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mha2gqa.core.per_layer import DECI_ARCHITECTURE, ffn_width

    cfg = llama8(intermediate_size=256)
    src = save(random_model(cfg, seed=3), tmp_path / "src")
    out = convert_checkpoint(src, tmp_path / "out", None, num_kv_heads_per_layer="8,4,2,1", progress=False).output
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [DECI_ARCHITECTURE] and config["model_type"] == "llama"
    ours = _ours(out)
    for layer, block in zip(ours.model.layers, config["block_configs"], strict=True):  # llama.cpp reads the JSON
        assert 8 // block["attention"]["n_heads_in_group"] == layer.self_attn.k_proj.out_features // 8
        assert block["attention"]["replace_with_linear"] is False and isinstance(block["ffn"]["ffn_mult"], float)
        assert ffn_width(block["ffn"]["ffn_mult"], 64) == layer.mlp.gate_proj.out_features
        # the explicit widths agree with ffn_mult and with the weights
        assert config["intermediate_size"] == ffn_width(block["ffn"]["ffn_mult"], 64) == layer.mlp.up_proj.out_features
        assert config["head_dim"] * 8 == layer.self_attn.q_proj.out_features
        assert layer.self_attn.k_proj.out_features == config["head_dim"] * 8 // block["attention"]["n_heads_in_group"]
    remote = AutoConfig.from_pretrained(out, trust_remote_code=True)  # vLLM reads attributes of this class
    assert [8 // b.attention.n_heads_in_group for b in remote.block_configs] == list(HEADS)
    assert not remote.block_configs[0].attention.no_op and not hasattr(remote.block_configs[0].ffn, "intermediate_size")
    stock = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(stock.generate(IDS, **gen), ours.generate(IDS, **gen))
    for model, where in ((stock, "stock"), (ours, "ours")):  # saving keeps the form (uptrain saves this way)
        model.save_pretrained(tmp_path / where)
        again = json.loads((tmp_path / where / "config.json").read_text())
        assert again["architectures"] == [DECI_ARCHITECTURE] and again["block_configs"] == config["block_configs"]
    torch.testing.assert_close(logits(_ours(tmp_path / "ours"), IDS), logits(ours, IDS), atol=0, rtol=0)
    record = json.loads((out / "mha2gqa_conversion.json").read_text())["conversion"]
    assert record["serving_form"].startswith("also written in the Nemotron-NAS form")
    assert "vLLM serves it as `DeciLMForCausalLM`" in (out / "README.md").read_text()


@pytest.mark.parametrize(
    ("family", "overrides", "why"),
    [
        ("llama", {"intermediate_size": 48, "attention_bias": False}, "its MLP width 48 is not what ffn_mult gives"),
        ("llama", {"intermediate_size": 256}, "has biases"),
        ("llama", {"intermediate_size": 256, "attention_bias": False, "hidden_act": "gelu"}, "activation is gelu"),
        ("qwen2", {"intermediate_size": 256}, "the source is Qwen2ForCausalLM, not LlamaForCausalLM"),
    ],
)
def test_sources_the_nemotron_nas_form_cannot_express_keep_their_class_and_say_why(family, overrides, why, tmp_path):
    src = save(random_model(tiny_config(family, **overrides)), tmp_path / "src")
    out = convert_checkpoint(src, tmp_path / "out", None, num_kv_heads_per_layer="2,1", progress=False).output
    config = json.loads((out / "config.json").read_text())
    assert (
        "block_configs" not in config
        and config["architectures"] == json.loads((src / "config.json").read_text())["architectures"]
    )
    record = json.loads((out / "mha2gqa_conversion.json").read_text())["conversion"]
    assert record["serving_form"].startswith("not written in the Nemotron-NAS form") and why in record["serving_form"]


@pytest.mark.parametrize("family", ["phi3", "stablelm", "olmo2"])
def test_fused_and_per_head_norm_families_convert_per_layer_with_unchanged_logits(family, tmp_path):
    """Every K/V head alike (key norms too): pooling layer 0 to 2 heads and layer 1 to 1 changes nothing,
    through the fused qkv_proj (Phi-3), per-head LayerNorms (StableLM) or a norm over all rows (OLMo-2)."""
    from test_convert import equalise_groups

    model = random_model(tiny_config(family, num_hidden_layers=2), seed=6)
    equalise_groups(model, family, 1)
    src = save(model, tmp_path / "src")
    out = convert_checkpoint(src, tmp_path / "out", None, num_kv_heads_per_layer="2,1", progress=False).output
    ids = torch.tensor([[1, 5, 17, 33, 9, 60]])
    ours = _ours(out)
    torch.testing.assert_close(logits(ours, ids), logits(model, ids), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        cache = ours(ids, use_cache=True).past_key_values
    assert [layer.keys.shape[1] for layer in cache.layers] == [2, 1]


def test_per_layer_counts_that_disagree_with_the_weights_are_named_as_the_cause(source, tmp_path):
    out = convert_checkpoint(source, tmp_path / "pl", None, num_kv_heads_per_layer="4,2,2,1", progress=False).output
    config = json.loads((out / "config.json").read_text())
    config["num_key_value_heads_per_layer"] = [2, 4, 2, 1]  # swapped: the weights hold 4 then 2
    (out / "config.json").write_text(json.dumps(config))
    text = story_text(tmp_path / "t.txt")
    res = CliRunner().invoke(main, eval_argv(source, out, text, "32", "200"))
    assert res.exit_code == 1 and "the config's per-layer KV-head counts do not match the weights" in res.output
    assert "layer 0: 2, layer 1: 4 KV heads by the config" in res.output, res.output
