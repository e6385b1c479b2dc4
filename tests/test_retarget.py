"""The classic MHA families (issue 16): GPT-NeoX/Pythia and GPT-J re-expressed as Phi, GPT-2 and OPT
as GPTBigCode, Falcon (new_decoder_architecture) regrouped, BLOOM/T5/Falcon-RW refused. Exact oracles
on tiny random models (every weight, norm and bias random)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import cached_heads, logits, random_model, save, story_text
from safetensors.torch import load_file

from mha2gqa.cli import main
from mha2gqa.convert import convert_checkpoint
from mha2gqa.convert.methods import get_method
from mha2gqa.convert.methods.pooling import reduce_rows
from mha2gqa.core.errors import Mha2GqaError, SettingError

IDS = torch.tensor([[1, 5, 17, 33, 9, 60, 2, 41, 77, 12]])
#: source model_type -> (tiny config, target class, a KV-head count below H it converts to)
SOURCES = {
    "gpt_neox": (dict(hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2, rotary_pct=0.5,
                      max_position_embeddings=64, tie_word_embeddings=False), "PhiForCausalLM", 2),
    "gptj": (dict(n_embd=32, n_head=4, n_layer=2, rotary_dim=4, n_positions=64), "PhiForCausalLM", 2),
    "gpt2": (dict(n_embd=32, n_head=4, n_layer=2, n_positions=64), "GPTBigCodeForCausalLM", 1),
    "opt": (dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, ffn_dim=64, max_position_embeddings=64,
                 word_embed_proj_dim=32), "GPTBigCodeForCausalLM", 1),
    "falcon": (dict(hidden_size=32, num_attention_heads=8, num_kv_heads=4, num_hidden_layers=2,
                    new_decoder_architecture=True, max_position_embeddings=64), "FalconForCausalLM", 2),
}  # fmt: skip


def _model(kind: str, seed: int = 0, vocab: int = 96, **overrides):
    from transformers import AutoConfig

    return random_model(AutoConfig.for_model(kind, vocab_size=vocab, **{**SOURCES[kind][0], **overrides}), seed)


def _kv_rows(model, kind: str):
    """Per layer, per K/V weight and bias of the source: ``(tensor, dim, rows_of(head))``, the slice of
    ``dim`` that holds KV head ``head`` (in the source's own layout)."""
    cfg = model.config
    heads, d = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    out = []
    if kind == "gpt_neox":
        for layer in model.gpt_neox.layers:
            qkv = layer.attention.query_key_value
            for part in (1, 2):  # rows [h, 3, d]: k and v of head h
                out += [
                    (t, 0, lambda h, p=part: slice((3 * h + p) * d, (3 * h + p + 1) * d))
                    for t in (qkv.weight, qkv.bias)
                ]
    elif kind == "gpt2":
        for layer in model.transformer.h:  # Conv1D columns [q | k | v]
            for part in (1, 2):
                out += [
                    (t, t.dim() - 1, lambda h, p=part: slice(p * heads * d + h * d, p * heads * d + (h + 1) * d))
                    for t in (layer.attn.c_attn.weight, layer.attn.c_attn.bias)
                ]
    elif kind == "falcon":
        g = cfg.num_kv_heads
        per = heads // g
        for layer in model.transformer.h:  # rows [G, H/G + 2, d]
            w = layer.self_attention.query_key_value.weight
            for part in (per, per + 1):
                out.append((w, 0, lambda h, p=part: slice((h * (per + 2) + p) * d, (h * (per + 2) + p + 1) * d)))
    else:
        for layer in model.transformer.h if kind == "gptj" else model.model.decoder.layers:
            attn = layer.attn if kind == "gptj" else layer.self_attn
            for proj in (attn.k_proj, attn.v_proj):
                out += [(t, 0, lambda h: slice(h * d, (h + 1) * d)) for t in (proj.weight, proj.bias) if t is not None]
    return out


def _equalise(model, kind: str, groups: int, strided: bool = False) -> None:
    """Make the K/V heads of each group identical: contiguous groups (what the conversion merges) or,
    as a control, strided ones (heads j, j + G, ...)."""
    cfg = model.config
    kv = getattr(cfg, "num_kv_heads", None) if kind == "falcon" else cfg.num_attention_heads
    size = kv // groups
    with torch.no_grad():
        for tensor, dim, rows in _kv_rows(model, kind):
            for j in range(groups):
                members = [j + m * groups for m in range(size)] if strided else [j * size + m for m in range(size)]
                first = tensor.narrow(
                    dim, rows(members[0]).start, rows(members[0]).stop - rows(members[0]).start
                ).clone()
                for h in members[1:]:
                    tensor.narrow(dim, rows(h).start, rows(h).stop - rows(h).start).copy_(first)


def _stock(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", list(SOURCES))
def test_the_same_head_count_reproduces_the_source_through_the_target_class(kind, tmp_path):
    source = _model(kind)
    src = save(source, tmp_path / "src")
    heads = getattr(source.config, "num_kv_heads", None) if kind == "falcon" else source.config.num_attention_heads
    out = convert_checkpoint(src, tmp_path / "out", heads, progress=False)
    target = _stock(out.output)
    assert type(target).__name__ == SOURCES[kind][1]
    torch.testing.assert_close(logits(target, IDS), logits(source, IDS), atol=1e-5, rtol=0)
    record = json.loads((out.output / "mha2gqa_conversion.json").read_text())["conversion"]
    if kind != "falcon":
        assert record["retarget"]["target_class"] == SOURCES[kind][1]
        assert record["retarget"]["source_class"] == type(source).__name__
        card = (out.output / "README.md").read_text()
        assert f"Re-targeted from `{type(source).__name__}` to `{SOURCES[kind][1]}`" in card and "Runs in:" in card


@pytest.mark.parametrize("kind", list(SOURCES))
@pytest.mark.parametrize("method", ["mean", "first", "aligned"])
def test_equalised_groups_convert_without_changing_the_logits_and_the_cache_holds_g_heads(kind, method, tmp_path):
    groups = SOURCES[kind][2]
    source = _model(kind, seed=2)
    _equalise(source, kind, groups)
    src = save(source, tmp_path / "src")
    out = convert_checkpoint(src, tmp_path / "out", groups, method, progress=False).output
    target = _stock(out)
    torch.testing.assert_close(logits(target, IDS), logits(source, IDS), atol=1e-4, rtol=0)
    with torch.no_grad():
        cache = target(IDS, use_cache=True).past_key_values
    held = cached_heads(kind, source.config.num_attention_heads, groups)  # measured, not computed
    assert {layer.keys.shape[1] for layer in cache.layers} == {held}
    gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert target.generate(IDS, **gen).shape[1] == IDS.shape[1] + 5


@pytest.mark.parametrize("kind", ["gpt_neox", "gptj", "falcon"])
def test_the_strided_grouping_control_changes_the_logits(kind, tmp_path):
    """Heads alike in strided groups (j, j + G...) are not what contiguous merging pools: the same
    conversion then changes the outputs, so the oracle above can fail."""
    groups = SOURCES[kind][2]
    source = _model(kind, seed=2)
    _equalise(source, kind, groups, strided=True)
    out = convert_checkpoint(save(source, tmp_path / "src"), tmp_path / "out", groups, progress=False).output
    assert (logits(_stock(out), IDS) - logits(source, IDS)).abs().max() > 1e-3


def _reference_target(kind: str, model) -> dict[str, torch.Tensor]:
    """An in-memory re-targeting written independently of the streaming one (same float64 maths)."""
    sd = {k: v.double() for k, v in model.state_dict().items()}
    cfg = model.config
    heads, hidden = cfg.num_attention_heads, cfg.hidden_size
    d = hidden // heads
    out: dict[str, torch.Tensor] = {}
    if kind == "gpt_neox":
        out["model.embed_tokens.weight"] = sd["gpt_neox.embed_in.weight"]
        for i in range(cfg.num_hidden_layers):
            p, q = f"gpt_neox.layers.{i}.", f"model.layers.{i}."
            g1, b1 = sd[p + "input_layernorm.weight"], sd[p + "input_layernorm.bias"]
            g2, b2 = sd[p + "post_attention_layernorm.weight"], sd[p + "post_attention_layernorm.bias"]
            w = sd[p + "attention.query_key_value.weight"].view(heads, 3, d, hidden)
            b = sd[p + "attention.query_key_value.bias"].view(heads, 3, d)
            for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
                wj, bj = w[:, j].reshape(hidden, hidden), b[:, j].reshape(hidden)
                out[q + f"self_attn.{name}.weight"] = wj * g1[None, :]
                out[q + f"self_attn.{name}.bias"] = wj @ b1 + bj
            out[q + "self_attn.dense.weight"] = sd[p + "attention.dense.weight"]
            out[q + "self_attn.dense.bias"] = sd[p + "attention.dense.bias"]
            fc1 = sd[p + "mlp.dense_h_to_4h.weight"]
            out[q + "mlp.fc1.weight"], out[q + "mlp.fc1.bias"] = (
                fc1 * g2[None, :],
                fc1 @ b2 + sd[p + "mlp.dense_h_to_4h.bias"],
            )
            out[q + "mlp.fc2.weight"], out[q + "mlp.fc2.bias"] = (
                sd[p + "mlp.dense_4h_to_h.weight"],
                sd[p + "mlp.dense_4h_to_h.bias"],
            )
            out[q + "input_layernorm.weight"], out[q + "input_layernorm.bias"] = torch.ones(hidden), torch.zeros(hidden)
        out["model.final_layernorm.weight"] = sd["gpt_neox.final_layer_norm.weight"]
        out["model.final_layernorm.bias"] = sd["gpt_neox.final_layer_norm.bias"]
        out["lm_head.weight"], out["lm_head.bias"] = (
            sd["lm_head.weight"],
            torch.zeros(cfg.vocab_size),
        )  # embed_out on disk
    elif kind == "gptj":  # one LayerNorm kept; q/k rows: even rotary dims, then odd, then the rest
        rd = cfg.rotary_dim
        order = torch.tensor([*range(0, rd, 2), *range(1, rd, 2), *range(rd, d)])
        rows = (torch.arange(heads)[:, None] * d + order[None, :]).reshape(-1)
        out["model.embed_tokens.weight"] = sd["transformer.wte.weight"]
        for i in range(cfg.n_layer):
            p, q = f"transformer.h.{i}.", f"model.layers.{i}."
            out[q + "input_layernorm.weight"], out[q + "input_layernorm.bias"] = (
                sd[p + "ln_1.weight"],
                sd[p + "ln_1.bias"],
            )
            for name in ("q_proj", "k_proj", "v_proj"):
                w = sd[p + f"attn.{name}.weight"]
                out[q + f"self_attn.{name}.weight"] = w[rows] if name != "v_proj" else w
                out[q + f"self_attn.{name}.bias"] = torch.zeros(hidden)
            out[q + "self_attn.dense.weight"], out[q + "self_attn.dense.bias"] = (
                sd[p + "attn.out_proj.weight"],
                torch.zeros(hidden),
            )
            for a, b in (("fc_in", "fc1"), ("fc_out", "fc2")):
                out[q + f"mlp.{b}.weight"], out[q + f"mlp.{b}.bias"] = (
                    sd[p + f"mlp.{a}.weight"],
                    sd[p + f"mlp.{a}.bias"],
                )
        out["model.final_layernorm.weight"], out["model.final_layernorm.bias"] = (
            sd["transformer.ln_f.weight"],
            sd["transformer.ln_f.bias"],
        )
        out["lm_head.weight"], out["lm_head.bias"] = sd["lm_head.weight"], sd["lm_head.bias"]
    elif kind == "opt":  # GPT-2's block: q/k/v gathered per head ([h, 3, d] rows), positions from row 2
        dec = "model.decoder."
        out["transformer.wte.weight"] = sd[dec + "embed_tokens.weight"]
        out["transformer.wpe.weight"] = sd[dec + "embed_positions.weight"][2:]
        out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = (
            sd[dec + "final_layer_norm.weight"],
            sd[dec + "final_layer_norm.bias"],
        )
        for i in range(cfg.num_hidden_layers):
            p, q = f"{dec}layers.{i}.", f"transformer.h.{i}."
            for a, b in (
                ("self_attn_layer_norm", "ln_1"),
                ("final_layer_norm", "ln_2"),
                ("self_attn.out_proj", "attn.c_proj"),
                ("fc1", "mlp.c_fc"),
                ("fc2", "mlp.c_proj"),
            ):
                out[q + f"{b}.weight"], out[q + f"{b}.bias"] = sd[p + f"{a}.weight"], sd[p + f"{a}.bias"]
            for suffix, shape in ((".weight", (hidden,)), (".bias", ())):
                parts = [sd[p + f"self_attn.{m}_proj{suffix}"].reshape(heads, 1, d, *shape) for m in "qkv"]
                out[q + f"attn.c_attn{suffix}"] = torch.cat(parts, dim=1).reshape(3 * hidden, *shape)
    else:  # gpt2: Conv1D transposed, c_attn regrouped per head ([h, 3, d] rows)
        for name, t in sd.items():
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                continue
            conv = any(name.endswith(f"{m}.weight") for m in ("c_attn", "c_proj", "c_fc"))
            out[name] = t.t() if conv else t
        for i in range(cfg.n_layer):
            p = f"transformer.h.{i}.attn.c_attn."
            out[p + "weight"] = (
                out[p + "weight"].reshape(3, heads, d, hidden).transpose(0, 1).reshape(3 * hidden, hidden)
            )
            out[p + "bias"] = out[p + "bias"].reshape(3, heads, d).transpose(0, 1).reshape(3 * hidden)
    return {k: v.float() for k, v in out.items()}


@pytest.mark.parametrize("kind", ["gpt_neox", "gptj", "gpt2", "opt"])
def test_streaming_equals_an_in_memory_reference_bit_for_bit(kind, tmp_path):
    source = _model(kind, seed=4)
    src = save(source, tmp_path / "src", shard="20KB")  # several shards
    groups = SOURCES[kind][2]
    out = convert_checkpoint(src, tmp_path / "out", groups, "mean", progress=False, max_shard_size="30KB").output
    streamed = {}
    for f in sorted(out.glob("*.safetensors")):
        streamed |= load_file(f)
    expected = _reference_target(kind, source)
    heads, d = source.config.num_attention_heads, source.config.hidden_size // source.config.num_attention_heads
    mean = get_method("mean").reduce
    for name, t in list(expected.items()):  # then the conversion: K/V pooled by the mean, as planned
        if kind in ("gpt_neox", "gptj") and (".k_proj." in name or ".v_proj." in name):
            expected[name] = reduce_rows(t, groups, d, mean)
        elif kind in ("gpt2", "opt") and name.endswith(("c_attn.weight", "c_attn.bias")):
            rows = t.reshape(heads, 3, d, *t.shape[1:])
            q, k, v = (rows[:, i].reshape(heads * d, *t.shape[1:]) for i in range(3))
            expected[name] = torch.cat([q, reduce_rows(k, 1, d, mean), reduce_rows(v, 1, d, mean)])
    assert set(streamed) == set(expected) - ({"lm_head.weight"} if kind in ("gpt2", "opt") else set())
    for name, t in streamed.items():
        assert torch.equal(t, expected[name]), name


@pytest.mark.parametrize("kind", ["gpt_neox", "gptj", "gpt2", "opt"])
def test_calibrated_methods_run_on_re_targeted_sources(kind, tmp_path):
    from mha2gqa.demo import build_tokenizer

    text = story_text(tmp_path / "c.txt")
    source = _model(kind, seed=5, vocab=300)
    src = save(source, tmp_path / "src")
    build_tokenizer(text.read_text(), 300).save_pretrained(src)
    groups = SOURCES[kind][2]
    kw = dict(calibration=str(text), calibration_tokens=256, calibration_seq_len=32, progress=False)
    for method, grouping in (("svd", "contiguous"), ("mean", "similarity"), ("random", "contiguous")):
        if grouping == "similarity" and groups == 1:
            continue
        reads = kw if (method, grouping) != ("random", "contiguous") else {"progress": False}
        out = convert_checkpoint(src, tmp_path / f"{method}-{grouping}", groups, method, grouping=grouping, **reads)
        assert torch.isfinite(logits(_stock(out.output), IDS)).all()
    if kind == "gpt_neox":  # per-layer counts too: Phi takes them
        out = convert_checkpoint(src, tmp_path / "pl", None, "svd", num_kv_heads_per_layer="4,1", **kw).output
        assert json.loads((out / "config.json").read_text())["num_key_value_heads_per_layer"] == [4, 1]


def _err(src: Path, dst: Path, *args: str) -> str:
    result = CliRunner().invoke(main, ["convert", str(src), str(dst), *args])
    assert result.exit_code != 0 and "Traceback" not in result.output and not dst.exists(), result.output
    return result.output.strip()


def test_refused_families_and_counts_say_why_and_what_is_valid(falcon_before_its_interface, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, T5Config, T5ForConditionalGeneration

    bloom = save(
        AutoModelForCausalLM.from_config(
            AutoConfig.for_model("bloom", vocab_size=96, hidden_size=32, n_head=4, n_layer=2)
        ),
        tmp_path / "bloom",
    )
    assert "ALiBi" in _err(bloom, tmp_path / "o", "-g", "2")
    t5 = save(
        T5ForConditionalGeneration(T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)),
        tmp_path / "t5",
    )
    assert "encoder-decoder" in _err(t5, tmp_path / "o", "-g", "2")
    rw = save(
        _model(
            "falcon",
            alibi=True,
            new_decoder_architecture=False,
            multi_query=False,
            num_kv_heads=None,
            num_attention_heads=4,
        ),
        tmp_path / "rw",
    )
    assert "ALiBi" in _err(rw, tmp_path / "o", "-g", "2")
    gpt2 = save(_model("gpt2"), tmp_path / "gpt2")
    msg = _err(gpt2, tmp_path / "o", "-g", "2")
    assert "holds one KV head (multi_query) or one per query head; choose 1 or 4" in msg and len(msg.splitlines()) == 1
    assert "choose 1 or 4" in _err(save(_model("opt"), tmp_path / "opt"), tmp_path / "o", "-g", "2")
    post = save(_model("opt", do_layer_norm_before=False), tmp_path / "post")
    assert "do_layer_norm_before is false" in _err(post, tmp_path / "o", "-g", "1")
    falcon = save(_model("falcon"), tmp_path / "falcon")
    text = story_text(tmp_path / "c.txt")
    assert "attention interface" in _err(
        falcon, tmp_path / "o", "-g", "2", "--method", "svd", "--calibration", str(text)
    )


def test_a_checkpoint_that_is_not_the_expected_layout_is_refused(tmp_path):
    src = save(_model("gpt_neox"), tmp_path / "src")
    from safetensors.torch import save_file

    tensors = load_file(src / "model.safetensors")
    tensors["gpt_neox.layers.0.attention.extra.weight"] = torch.zeros(2)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    extra = r"gpt_neox\.layers\.0\.attention\.extra\.weight"  # checked against its own class first
    with pytest.raises(Mha2GqaError, match=rf"(no place for|the config does not describe:) {extra}"):
        convert_checkpoint(src, tmp_path / "out", 2, progress=False)


def test_inspect_plan_and_eval_read_the_source_classes(tmp_path):
    source = _model("gpt_neox", vocab=300)
    src = save(source, tmp_path / "src")
    info = json.loads(CliRunner().invoke(main, ["inspect", str(src), "--json"]).output)
    assert info["num_heads"] == 4 and info["parameters"] == sum(p.numel() for p in source.parameters())
    assert info["architecture"] == "GPTNeoXForCausalLM" and info["converts_as"] == "PhiForCausalLM"
    text = CliRunner().invoke(main, ["inspect", str(src)]).output
    assert "GPTNeoXForCausalLM (converted as PhiForCausalLM, family phi)" in text
    plan = CliRunner().invoke(main, ["plan", str(src)])
    assert plan.exit_code == 0, plan.output
    with pytest.raises(SettingError):
        convert_checkpoint(src, tmp_path / "out", 3, progress=False)
    shutil.rmtree(tmp_path / "out", ignore_errors=True)


def test_each_output_tensor_keeps_its_sources_dtype(tmp_path):
    """A bf16 checkpoint whose norms are stored in float32: copies keep float32, computed tensors
    take their main source weight's dtype, and the written dtypes are what the header declares."""
    from safetensors.torch import save_file

    src = save(_model("gpt_neox"), tmp_path / "src")
    tensors = {
        k: (v if "layer_norm" in k or "layernorm" in k else v.to(torch.bfloat16))
        for k, v in load_file(src / "model.safetensors").items()
    }
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    out = load_file(convert_checkpoint(src, tmp_path / "out", 2, progress=False).output / "model.safetensors")
    assert out["model.final_layernorm.weight"].dtype == torch.float32  # copied as stored
    assert out["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16  # folded from bf16 qkv
    assert out["model.layers.0.mlp.fc1.bias"].dtype == torch.bfloat16
    assert out["model.layers.0.input_layernorm.weight"].dtype == torch.bfloat16  # the checkpoint's own dtype
    assert torch.isfinite(logits(_stock(tmp_path / "out"), IDS)).all()


def test_a_retargeted_sources_bad_config_is_reported_in_its_own_fields(tmp_path):
    """The derived field (Phi's partial_rotary_factor) is not what the user wrote: the error names
    the source's own keys and values first; a value of the wrong kind is one line too."""
    base = {"architectures": ["GPTJForCausalLM"], "model_type": "gptj", "n_head": 4, "n_embd": 64, "n_layer": 2,
            "vocab_size": 100, "n_positions": 64}  # fmt: skip
    neox = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "num_attention_heads": 4,
            "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100, "max_position_embeddings": 64,
            "intermediate_size": 128}  # fmt: skip
    for config, said in [
        ({**base, "rotary_dim": 1000}, "config.json: rotary_dim 1000, n_embd 64, n_head 4 of this GPTJForCausalLM"),
        ({**base, "rotary_dim": "x"}, "config.json: rotary_dim 'x': not usable here"),
        ({**neox, "rotary_pct": 3.0}, "config.json: rotary_pct 3.0 of this GPTNeoXForCausalLM"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps(config))
        res = CliRunner().invoke(main, ["inspect", str(tmp_path)])
        assert res.exit_code == 1 and said in res.output and "Traceback" not in res.output, res.output
        assert res.output.startswith("Error: ") and len(res.output.strip().splitlines()) == 1
