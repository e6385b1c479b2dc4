"""Exact oracles for every family: G = H copies, equalised groups keep the logits, the output loads
as stock GQA with a G-head KV cache, and streaming equals an in-memory reference bit for bit."""

import json

import pytest
import torch
from conftest import FAMILY_CONFIGS, cached_heads, load, logits, random_model, save, tiny_config
from reference import reference_convert
from safetensors import safe_open
from safetensors.torch import load_file

from mha2gqa.convert import convert_checkpoint
from mha2gqa.core.families import families

FAMILIES = sorted(FAMILY_CONFIGS)
IDS = torch.tensor([[1, 5, 17, 33, 9, 60, 2, 41, 77, 12, 3, 90]])


def read_all(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def source_kv(config) -> int:
    from mha2gqa.core.architecture import dims_of

    return dims_of(config).num_kv_heads


def equalise_groups(model, family: str, groups: int, strided: bool = False) -> None:
    """Make the K/V heads inside each ``repeat_kv`` group identical (or, with ``strided``, heads
    ``h`` and ``h + G`` identical: the classic wrong grouping)."""
    fam = families()[family]
    cfg = model.config
    h, kv = cfg.num_attention_heads, source_kv(cfg)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // h
    per = kv // groups
    members = [
        [j + groups * i for i in range(per)] if strided else list(range(j * per, (j + 1) * per)) for j in range(groups)
    ]
    params = dict(model.named_parameters())

    def fix_rows(t: torch.Tensor, offset: int = 0) -> None:
        for group in members:
            src = t[offset + group[0] * d : offset + (group[0] + 1) * d].clone()
            for m in group[1:]:
                t[offset + m * d : offset + (m + 1) * d] = src

    with torch.no_grad():
        for layer in range(cfg.num_hidden_layers):
            for suffix in (".weight", ".bias"):
                if fam.fused:  # k and v rows wherever the family's layout keeps them
                    t = params.get(fam.qkv_proj.format(layer=layer) + suffix)
                    if t is not None:
                        q, k, v = (x.clone() for x in fam.split_qkv(t.data, h, kv, d))
                        fix_rows(k)
                        fix_rows(v)
                        t.copy_(fam.join_qkv(q, k, v, h, kv, d))
                for module in (fam.k_proj, fam.v_proj):
                    if module and (t := params.get(module.format(layer=layer) + suffix)) is not None:
                        fix_rows(t)
            norm = fam.k_norm
            if norm and norm.layout == "rows":
                fix_rows(params[norm.name.format(layer=layer)])
            elif norm and norm.layout == "indexed":
                for group in members:
                    for m in group[1:]:
                        params[norm.name.format(layer=layer, head=m)].copy_(
                            params[norm.name.format(layer=layer, head=group[0])]
                        )


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_same_head_count_is_a_byte_exact_copy(family, sharded, tiny_checkpoint, tmp_path):
    src = tiny_checkpoint(family, sharded=sharded)
    g = source_kv(tiny_config(family))
    result = convert_checkpoint(
        src, tmp_path / "out", g, "mean", max_shard_size="20KB" if sharded else "5GB", progress=False
    )
    a, b = read_all(src), read_all(result.output)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), (
            name
        )
    assert torch.equal(logits(load(src), IDS), logits(load(result.output), IDS))
    assert (len(result.record.output.files) > 1) == sharded
    assert f"{g} KV heads is the model's own count: nothing merged, a byte-for-byte copy" in result.summary()


@pytest.mark.parametrize("family", FAMILIES)
def test_equalised_groups_convert_without_changing_logits(family, tmp_path):
    from mha2gqa.core.architecture import dims_of

    config = tiny_config(family)
    kv = source_kv(config)
    for g in [g for g in (kv // 2, 1) if g in dims_of(config).valid_kv_heads()]:
        model = random_model(config, seed=g)
        equalise_groups(model, family, g)
        src = save(model, tmp_path / f"src{g}")
        before = logits(model, IDS)
        out = convert_checkpoint(src, tmp_path / f"out{g}", g, "mean", progress=False).output
        converted = load(out)
        assert dims_of(converted.config).num_kv_heads == g
        # float noise only: the same sums in another order (Gemma 3's logits reach 1e-5 of noise on some CPUs)
        torch.testing.assert_close(logits(converted, IDS), before, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "phi3", "stablelm", "olmo2"])
def test_the_oracle_catches_a_strided_grouping(family, tmp_path):
    """Heads equal under the wrong (strided, h mod G) grouping must not survive contiguous pooling:
    proof that the oracle above would fail a converter that grouped that way."""
    config = tiny_config(family)
    model = random_model(config)
    equalise_groups(model, family, 2, strided=True)
    src = save(model, tmp_path / "src")
    out = convert_checkpoint(src, tmp_path / "out", 2, "mean", progress=False).output
    assert (logits(load(out), IDS) - logits(model, IDS)).abs().max() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_output_loads_generates_and_caches_g_heads(family, tiny_checkpoint, tmp_path):
    src = tiny_checkpoint(family, sharded=True)
    out = convert_checkpoint(src, tmp_path / "out", 1, "mean", max_shard_size="30KB", progress=False).output
    model = load(out)
    gen = model.generate(
        IDS[:, :4], max_new_tokens=5, min_new_tokens=5, do_sample=False, return_dict_in_generate=True, pad_token_id=0
    )
    assert gen.sequences.shape == (1, 9)
    cache = gen.past_key_values
    held = cached_heads(family, model.config.num_attention_heads, 1)  # (docs/families.md: Falcon's cache)
    for layer in cache.layers:
        assert layer.keys.shape[1] == held and layer.values.shape[1] == held
    cfg_in = json.loads((src / "config.json").read_text())
    cfg_out = json.loads((out / "config.json").read_text())
    changed = {k: v for k, v in cfg_out.items() if cfg_in.get(k) != v}
    assert changed == {k: v for k, v in families()[family].kv_config(1).items() if cfg_in.get(k) != v} != {}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    sizes = 0
    for f in set(index["weight_map"].values()):
        with safe_open(out / f, "pt") as h:
            assert h.metadata() == {"format": "pt"}
            sizes += sum(h.get_tensor(k).numel() * h.get_tensor(k).element_size() for k in h.keys())  # noqa: SIM118
    assert index["metadata"]["total_size"] == sizes


@pytest.mark.parametrize("method", ["mean", "first"])
@pytest.mark.parametrize("family", FAMILIES)
def test_streaming_equals_in_memory_reference(family, method, tiny_checkpoint, tmp_path):
    src = tiny_checkpoint(family, sharded=True)
    config = json.loads((src / "config.json").read_text())
    fam = families()[family]
    layout = {"k": fam.k_proj, "v": fam.v_proj} if not fam.fused else {"qkv": fam.qkv_proj, "family": fam}
    if fam.k_norm:
        layout.update(k_norm=fam.k_norm.name, k_norm_layout=fam.k_norm.layout)
    groups = 1 if family != "mistral" else 2
    expected = reference_convert(read_all(src), config, {k: v for k, v in layout.items() if v}, groups, method)
    got = read_all(
        convert_checkpoint(src, tmp_path / "out", groups, method, max_shard_size="25KB", progress=False).output
    )
    assert expected.keys() == got.keys()
    for name in expected:
        assert expected[name].shape == got[name].shape, name
        assert torch.equal(expected[name].view(torch.uint8), got[name].view(torch.uint8)), name


def test_bf16_pools_in_float32_and_writes_bf16(tmp_path):
    model = random_model(tiny_config("llama", attention_bias=False)).to(torch.bfloat16)
    src = save(model, tmp_path / "src")
    out = convert_checkpoint(src, tmp_path / "out", 2, "mean", progress=False).output
    got = read_all(out)
    k = model.model.layers[0].self_attn.k_proj.weight.detach()
    expected = ((k[0:8].float() + k[8:16].float()) / 2).to(torch.bfloat16)  # heads 0 and 1 by hand
    assert got["model.layers.0.self_attn.k_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(got["model.layers.0.self_attn.k_proj.weight"][:8], expected)
    record = json.loads((out / "mha2gqa_conversion.json").read_text())
    assert record["conversion"]["kv_cache_dtype"] == "BF16"
    assert record["conversion"]["kv_cache_bytes_per_token_after"] == 2 * 2 * 2 * 8 * 2


def test_tied_embeddings_stay_tied(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("gemma")  # Gemma ties input and output embeddings
    assert "lm_head.weight" not in read_all(src)
    out = convert_checkpoint(src, tmp_path / "out", 2, "mean", progress=False).output
    assert "lm_head.weight" not in read_all(out)
    model = load(out)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_card_and_record_describe_the_conversion(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen2")
    result = convert_checkpoint(src, tmp_path / "out", 2, "first", progress=False)
    card = (result.output / "README.md").read_text()
    front = card.split("---\n")[1]
    import yaml

    meta = yaml.safe_load(front)
    assert meta["library_name"] == "transformers" and "base_model" not in meta  # a local folder: no model id
    assert f"# {src.name} as grouped-query attention" in card
    assert "mha2gqa" in meta["tags"]
    record = json.loads((result.output / "mha2gqa_conversion.json").read_text())
    conv = record["conversion"]
    assert conv["method"] == "first" and conv["num_kv_heads_before"] == 4 and conv["num_kv_heads_after"] == 2
    assert conv["query_heads_per_kv_head"] == [[0, 1], [2, 3]]
    assert len(record["source"]["config_sha256"]) == 64
    assert all(len(f["header_sha256"]) == 64 for f in record["source"]["files"])
    assert "KV heads 4 -> 2" in result.summary()
