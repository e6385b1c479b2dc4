import json

import pytest
import torch
from conftest import FAMILY_CONFIGS, tiny_config

from mha2gqa.core.architecture import resolve
from mha2gqa.core.dims import AttentionDims
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.families import families, parse_family


def test_every_family_has_a_tiny_model_in_the_tests():
    assert set(families()) == set(FAMILY_CONFIGS)


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_every_name_in_a_definition_exists_in_the_real_model(family):
    from transformers import AutoModelForCausalLM

    config = tiny_config(family)
    with torch.device("meta"):
        names = set(AutoModelForCausalLM.from_config(config).state_dict())
    fam = families()[family]
    for layer in range(config.num_hidden_layers):
        for module in fam.modules():
            assert module.format(layer=layer) + ".weight" in names
        for norm in (fam.q_norm, fam.k_norm):
            if norm is not None:
                assert norm.name.format(layer=layer, head=0) in names
    assert resolve(json.loads(config.to_json_string())).family is fam


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_a_layers_roles_name_exactly_the_real_models_attention_tensors(family):
    """:mod:`~mha2gqa.core.layer_tensors` by role, per-head norms included, against the model transformers
    builds: every weight role exists, every norm name of every head exists, and no head past the count."""
    from transformers import AutoModelForCausalLM

    from mha2gqa.core.architecture import dims_of
    from mha2gqa.core.layer_tensors import attention_names, norm_names, role_names

    config = tiny_config(family)
    with torch.device("meta"):
        names = set(AutoModelForCausalLM.from_config(config).state_dict())
    fam, dims = families()[family], dims_of(json.loads(config.to_json_string()))
    for layer in range(dims.num_layers):
        roles = role_names(fam, layer)
        assert {r for r in roles if not r.endswith("_bias")} == ({"qkv", "o"} if fam.fused else {"q", "k", "v", "o"})
        assert all(roles[r] in names for r in roles if not r.endswith("_bias"))
        assert (
            set(attention_names(names, fam, layer).values()) == {n for r, n in roles.items() if r != "o_bias"} & names
        )
        norms = norm_names(fam, layer, dims.num_heads, dims.num_kv_heads)
        assert set(norms) == {r for r, n in (("q_norm", fam.q_norm), ("k_norm", fam.k_norm)) if n is not None}
        for role, found in norms.items():
            assert all(n in names for n in found), (role, found)
            if (fam.q_norm if role == "q_norm" else fam.k_norm).layout == "indexed":
                assert len(found) == (dims.num_heads if role == "q_norm" else dims.num_kv_heads)
                assert found[-1].replace(f".{len(found) - 1}.", f".{len(found)}.") not in names


def test_unknown_keys_in_a_definition_are_an_error():
    good = {
        "family": "x",
        "description": "d",
        "architectures": ["X"],
        "model_types": ["x"],
        "attention": {
            "q_proj": "l.{layer}.q",
            "k_proj": "l.{layer}.k",
            "v_proj": "l.{layer}.v",
            "o_proj": "l.{layer}.o",
        },
    }
    assert parse_family(good).family == "x"
    with pytest.raises(ValueError, match="unknown keys"):
        parse_family({**good, "kv_proj": "typo"})
    with pytest.raises(ValueError, match="'attention' takes only"):
        parse_family({**good, "attention": {**good["attention"], "k_prj": "l.{layer}.k"}})
    with pytest.raises(ValueError, match="either 'qkv_proj'"):
        parse_family({**good, "attention": {**good["attention"], "qkv_proj": "l.{layer}.qkv"}})
    with pytest.raises(ValueError, match="layout"):
        parse_family({**good, "k_norm": {"name": "l.{layer}.kn", "layout": "weird"}})
    with pytest.raises(ValueError, match=r"'\{head\}' must appear"):
        parse_family({**good, "k_norm": {"name": "l.{layer}.kn", "layout": "indexed"}})
    for bad in ("5.25", "newest", "", 5, None):  # a version range, true or false; never guessed
        with pytest.raises(ValueError, match="'attention_interface' is true, false or transformers versions"):
            parse_family({**good, "attention_interface": bad})


def test_the_attention_interface_follows_the_installed_transformers():
    from mha2gqa.core.families import installed_transformers

    base = {"family": "x", "description": "d", "architectures": ["X"], "model_types": ["x"]}
    base["attention"] = {r: f"l.{{layer}}.{r}" for r in ("q_proj", "k_proj", "v_proj", "o_proj")}
    now = installed_transformers()
    specs = (True, False, f">={now}", f"<{now}", ">=999")
    runs = [parse_family({**base, "attention_interface": spec}).attention_interface for spec in specs]
    assert runs == [True, False, True, False, False], runs
    assert parse_family({**base, "attention_interface": ">=999"}).interface_hint == (
        " (transformers >=999 does: pip install 'transformers>=999')"
    )


def test_unknown_family_is_refused_with_the_supported_list():
    with pytest.raises(
        Mha2GqaError, match=r"unsupported model family \(MambaForCausalLM\); supported: .*LlamaForCausalLM"
    ):
        resolve({"architectures": ["MambaForCausalLM"], "model_type": "mamba"})


def test_dims_head_dim_and_kv_cache_by_hand():
    llama2 = {"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096}
    dims = AttentionDims.from_config(llama2)
    assert (dims.num_kv_heads, dims.head_dim) == (32, 128)
    assert dims.kv_cache_bytes_per_token(32, 2) == 524_288
    assert dims.kv_cache_bytes_per_token(8, 2) == 131_072
    gemma7b = {
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "hidden_size": 3072,
        "head_dim": 256,
    }
    assert AttentionDims.from_config(gemma7b).head_dim == 256
    with pytest.raises(Mha2GqaError, match="num_hidden_layers"):
        AttentionDims.from_config({"num_attention_heads": 4, "hidden_size": 8})


#: config switches that change which tensors exist, flipped for each family that has them
SWITCHES = (
    *[
        "tie_word_embeddings",
        "attention_bias",
        "mlp_bias",
        "use_qkv_bias",
        "qk_layernorm",
        "use_parallel_residual",
        "use_bias",
    ],
)


def meta_parameters(config) -> int:
    """Parameters of the model class itself (built on meta), tied weights counted once."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_declared_parameter_terms_count_exactly_what_transformers_builds(family):
    """The planner counts parameters from the family's terms, without torch (or, for a family that
    declares none, GPTBigCode and Falcon, from its class on ``meta``): for every family, with each
    switch on and off, MHA and GQA, the count equals the model class's own."""
    from mha2gqa.serving.sizing import count_parameters, model_shape

    fam = families()[family]
    base = tiny_config(family)
    variants = [{}, {**fam.kv_config(1), "num_key_value_heads": 1}]
    for key in SWITCHES:
        if hasattr(base, key):
            variants.append({key: not getattr(base, key)})
    for overrides in variants:
        config = tiny_config(family, **overrides)
        as_dict = json.loads(config.to_json_string())
        if fam.parameter_terms:
            assert count_parameters(as_dict, fam) == meta_parameters(config), overrides
        else:
            assert model_shape(as_dict).parameters == meta_parameters(config), overrides


def test_parameter_terms_use_the_model_class_defaults_for_absent_switches():
    from mha2gqa.serving.sizing import count_parameters

    fam = families()["starcoder2"]  # ties embeddings and uses biases unless told otherwise
    config = tiny_config("starcoder2")
    bare = {
        k: v for k, v in json.loads(config.to_json_string()).items() if k not in ("tie_word_embeddings", "use_bias")
    }
    assert count_parameters(bare, fam) == meta_parameters(config)


def _table_cells(family: str) -> dict[str, str]:
    """docs/families.md's feature-table row of ``family``: column heading -> ``yes`` / ``no (n)``."""
    from pathlib import Path

    from mha2gqa.families_doc import BEGIN, END

    page = (Path(__file__).resolve().parents[1] / "docs" / "families.md").read_text(encoding="utf-8")
    page = page[page.index(BEGIN) : page.index(END)]
    rows = [[c.strip() for c in line.strip(" |").split(" | ")] for line in page.splitlines() if line.startswith("| ")]
    head = next(r for r in rows if r[0] == "family")
    row = next(r for r in rows if r[0] == family)
    return {h.split(" (")[0].strip(): c.strip() for h, c in zip(head, row, strict=True)}


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_the_family_tables_method_cells_are_what_convert_does(family, calib_text, tmp_path):
    """Each method cell of the families page says yes exactly where ``convert`` takes the method on the
    family's checkpoint, and no where it refuses it in one line (checked before any model loads)."""
    from conftest import random_model
    from test_methods import with_tokenizer

    from mha2gqa.convert.prepare import prepare
    from mha2gqa.convert.settings import ConvertSettings
    from mha2gqa.core.families import families

    src = with_tokenizer(random_model(tiny_config(family, vocab_size=300)), tmp_path / "src", calib_text)
    g = 1 if families()[family].flag_only else 2
    cells = _table_cells(family)
    for column, method, grouping in (("aligned", "aligned", "contiguous"), ("svd", "svd", "contiguous"),
                                     ("--grouping similarity", "mean", "similarity")):  # fmt: skip
        settings = ConvertSettings(num_kv_heads=g, method=method, grouping=grouping, calibration=str(calib_text))
        if method == "aligned" and not families()[family].attention_interface:
            settings = ConvertSettings(num_kv_heads=g, method=method)  # from the weights alone
        try:
            prepare(str(src), tmp_path / f"{method}-{grouping}", settings.check())
            took = True
        except Mha2GqaError as e:
            assert len(str(e).splitlines()) == 1, str(e)
            took = False
        runs = cells[column] == "yes" or (cells[column].startswith("yes (") and families()[family].attention_interface)
        assert runs == took, (family, column, cells[column])  # "yes (n)": in the transformers versions (n) names
