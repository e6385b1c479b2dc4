"""Models and values refused before any work (issue 24): every loader checks the weights against the
config first (truncated shards, missing weights, per-layer lists that disagree with the weights or
hold a non-divisor), float8 K/V tensors are checked for NaN like any other, and numbers too large for
any machine are refused in one line."""

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import eval_argv, random_model, save, tiny_config

from mha2gqa.cli import main
from mha2gqa.convert import convert_checkpoint


@pytest.fixture(scope="module")
def per_layer(tmp_path_factory, pair):
    """A per-layer conversion (4,1) of the tiny pair's original, and its text."""
    src, _, text = pair
    root = tmp_path_factory.mktemp("pl")
    src2 = root / "src"
    import shutil

    shutil.copytree(src, src2)
    out = convert_checkpoint(src2, root / "pl", None, num_kv_heads_per_layer="4,1", progress=False).output
    return src2, out, text


def _copy(folder, tmp_path, name="m"):
    import shutil

    return shutil.copytree(folder, tmp_path / name)


def _eval(src, conv, text):
    return CliRunner().invoke(main, eval_argv(src, conv, text, "64", "600", "-q"))


def _refused_before_scoring(res, *words):
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output and "scoring" not in res.output
    for w in words:
        assert w in res.output, res.output


@pytest.mark.parametrize(
    ("counts", "words"),
    [
        ([1, 4], ("per-layer KV-head counts do not match the weights", "layer 0: 1")),
        ([3, 1], ("layer 0 has 3 KV heads",)),
        ([4, 1, 1], ("2 layers", "[4, 1, 1]")),
    ],
    ids=["disagrees-with-weights", "non-divisor", "wrong-length"],
)
def test_a_per_layer_list_that_does_not_fit_is_refused(per_layer, tmp_path, counts, words):
    src, out, text = per_layer
    bad = _copy(out, tmp_path)
    config = json.loads((bad / "config.json").read_text())
    config["num_key_value_heads_per_layer"] = counts
    (bad / "config.json").write_text(json.dumps(config))
    _refused_before_scoring(_eval(src, bad, text), "--converted", *words)
    up = CliRunner().invoke(main, ["uptrain", str(bad), "--data", str(text), "--output", str(tmp_path / "up")])
    assert up.exit_code == 1 and "Traceback" not in up.output and not (tmp_path / "up").exists(), up.output


def test_truncated_or_missing_weights_are_refused_before_the_original_is_scored(pair, tmp_path):
    src, conv, text = pair
    cut = _copy(conv, tmp_path, "cut")
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    _refused_before_scoring(_eval(src, cut, text), "--converted", "truncated")
    empty = _copy(conv, tmp_path, "empty")
    (empty / "model.safetensors").unlink()
    _refused_before_scoring(_eval(src, empty, text), "--converted", "model.safetensors")


def test_an_unsafe_pickle_is_refused_in_one_line(pair, tmp_path):
    src, conv, text = pair
    bad = _copy(conv, tmp_path, "pickled")
    (bad / "model.safetensors").unlink()

    class Payload:
        def __reduce__(self):
            return (print, ("this ran",))

    torch.save({"x": Payload()}, bad / "pytorch_model.bin")
    res = _eval(src, bad, text)
    _refused_before_scoring(res, "refused as unsafe")
    assert "weights_only=False" not in res.output and "this ran" not in res.output


def test_float8_kv_projections_convert(tmp_path):
    from safetensors.torch import load_file, save_file

    save(random_model(tiny_config("llama")), tmp_path / "src")
    weights = load_file(tmp_path / "src" / "model.safetensors")
    for name in weights:
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            weights[name] = weights[name].to(torch.float8_e4m3fn)
    save_file(weights, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    out = convert_checkpoint(tmp_path / "src", tmp_path / "out", 2, progress=False).output
    assert load_file(out / "model.safetensors")["model.layers.0.self_attn.k_proj.weight"].dtype == torch.float8_e4m3fn
    weights["model.layers.1.self_attn.v_proj.weight"][0, 0] = float("nan")
    save_file(weights, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    res = CliRunner().invoke(main, ["convert", str(tmp_path / "src"), str(tmp_path / "o2"), "-g", "2", "-q"])
    assert "v_proj.weight holds NaN or Inf" in res.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bandwidth", "1e300TB"], "beyond any real size"),
        (["--gpu-memory", "1e300TB"], "beyond any real size"),
        (["--bandwidth", "3TB", "--tflops", "1e308"], "at most"),
        (["--seq-len", "99999999999999999999"], "does not fit in 64 bits"),
    ],
)
def test_numbers_beyond_any_machine_are_refused(tmp_path, args, message):
    save(random_model(tiny_config("llama")), tmp_path / "m")
    res = CliRunner().invoke(main, ["plan", str(tmp_path / "m"), *args])
    assert res.exit_code != 0 and message in res.output and "Traceback" not in res.output, res.output


def test_threads_and_top_k_beyond_reason_are_refused(pair, tmp_path):
    src, conv, text = pair
    res = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "o"), "-g", "2", "--threads", "9" * 20])
    assert res.exit_code == 2 and "--threads" in res.output and not (tmp_path / "o").exists()
    big = CliRunner().invoke(main, eval_argv(src, conv, text, "64", "600", "--reference-top-k", "100000"))
    assert big.exit_code == 1 and "more than the vocabulary" in big.output, big.output


@pytest.mark.parametrize("damage", ["truncate-model", "truncate-optimizer", "unsafe-optimizer"])
def test_a_damaged_checkpoint_is_refused_on_resume(pair, tmp_path, damage):
    _, conv, text = pair
    out = tmp_path / "up"
    argv = ["uptrain", str(conv), "--data", str(text), "--output", str(out), "--max-steps", "4", "--batch-size", "2",
            "--seq-len", "32", "--save-every", "2", "-q"]  # fmt: skip
    assert CliRunner().invoke(main, [*argv, "--stop-after", "2"]).exit_code == 0
    (checkpoint,) = [p for p in out.rglob("optimizer*.bin")]
    folder = checkpoint.parent
    if damage == "truncate-model":
        model = next(p for p in folder.glob("*.safetensors"))
        model.write_bytes(model.read_bytes()[:1000])
    elif damage == "truncate-optimizer":
        checkpoint.write_bytes(checkpoint.read_bytes()[:1000])
    else:

        class Payload:
            def __reduce__(self):
                return (print, ("this ran",))

        torch.save({"state": Payload()}, checkpoint)
    res = CliRunner().invoke(main, [*argv, "--resume"])
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert "--resume: the checkpoint" in res.output and "this ran" not in res.output
    assert "weights_only=False" not in res.output


@pytest.fixture(scope="module")
def classic(tmp_path_factory):
    """Tiny GPT-2, GPT-J and GPT-NeoX checkpoints (re-targeted families), as transformers saves them."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPTJConfig, GPTJForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM

    root = tmp_path_factory.mktemp("classic")
    ids = dict(bos_token_id=1, eos_token_id=2)
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=32, **ids)).save_pretrained(
        root / "gpt2"
    )
    GPTJForCausalLM(GPTJConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=32, rotary_dim=4, **ids)
                    ).save_pretrained(root / "gptj")  # fmt: skip
    neox = GPTNeoXConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                         vocab_size=96, max_position_embeddings=32, **ids)  # fmt: skip
    GPTNeoXForCausalLM(neox).save_pretrained(root / "neox")
    return root


def _edited(classic, tmp_path, name, config=None, drop=None):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(classic / name, tmp_path / name)
    if config:
        c = json.loads((folder / "config.json").read_text())
        c.update(config)
        (folder / "config.json").write_text(json.dumps(c))
    if drop:
        weights = load_file(folder / "model.safetensors")
        weights.pop(drop)
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize(
    ("name", "config", "drop", "message"),
    [
        ("gpt2", None, "transformer.h.1.attn.c_attn.bias", "missing: transformer.h.1.attn.c_attn.bias"),
        ("gpt2", {"n_inner": -5}, None, "transformers cannot build this model"),
        ("gpt2", {"n_inner": "x"}, None, "transformers cannot build this model"),
        ("gptj", {"n_head": 0}, None, "n_head 0: not usable here"),  # said in the source's own fields
        ("gptj", {"n_head": "4"}, None, "n_head '4': not usable here"),
        ("neox", {"hidden_size": 64}, None, "wrong shape"),
    ],
    ids=[
        "gpt2-missing-bias",
        "gpt2-negative-inner",
        "gpt2-string-inner",
        "gptj-zero-heads",
        "gptj-string-heads",
        "neox-hidden-size",
    ],
)
def test_re_targeted_sources_are_held_to_their_own_class(classic, tmp_path, name, config, drop, message):
    src = _edited(classic, tmp_path, name, config, drop)
    res = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out"), "-g", "2", "-q"])
    assert res.exit_code == 1 and message in res.output and "Traceback" not in res.output, res.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["gpt2", "gptj", "neox"])
def test_intact_re_targeted_sources_still_convert_and_load(classic, tmp_path, name):
    from mha2gqa.core.checkpoint import check_loadable

    check_loadable("--original", str(classic / name))  # GPT-NeoX's embed_out is transformers' lm_head
    out = convert_checkpoint(classic / name, tmp_path / "out", 2 if name != "gpt2" else 1, progress=False).output
    check_loadable("--converted", str(out))


def test_a_symlinked_dst_is_refused_before_any_work(pair, tmp_path):
    src, _, _ = pair
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    res = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "link"), "-g", "2"])
    assert res.exit_code == 1 and "is a symbolic link" in res.output and "writing" not in res.output
    assert not any((tmp_path / "empty").iterdir()) and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_job_sweeps_per_layer_counts_and_refuses_a_refused_family_first(pair, tmp_path):
    from mha2gqa.core.errors import Mha2GqaError
    from mha2gqa.jobs import load_job, run_job

    src, _, text = pair
    job = tmp_path / "j.yaml"
    sweep = "{num_kv_heads: [2, '4,1'], num_kv_heads_per_layer: [[1, 2]], methods: [mean]}"
    job.write_text(
        f"source: {src}\nconvert: {sweep}\neval: {{data: {text}, seq_len: 64, max_tokens: 600, samples: 0}}\n"
    )
    parsed = load_job(job)
    assert parsed.num_kv_heads == (2, (4, 1), (1, 2))
    assert parsed.recipe((4, 1), "mean").convert.num_kv_heads_per_layer == "4,1"
    result = run_job(parsed, tmp_path / "run", log=lambda m: None)
    assert [r.num_kv_heads for r in result.rows] == ["2", "4,1", "1,2"]
    assert (tmp_path / "run" / "results" / "mean-g4-1.json").is_file()
    bloom = tmp_path / "bloom"
    bloom.mkdir()
    (bloom / "config.json").write_text(json.dumps({"architectures": ["BloomForCausalLM"], "model_type": "bloom",
                                                   "n_head": 4, "hidden_size": 32, "n_layer": 2}))  # fmt: skip
    job.write_text(f"source: {bloom}\nconvert: {{num_kv_heads: [2]}}\neval: {{data: {text}}}\n")
    with pytest.raises(Mha2GqaError, match="BloomForCausalLM is not supported: BLOOM uses ALiBi"):
        run_job(load_job(job), tmp_path / "run2", log=lambda m: None)
    assert not (tmp_path / "run2").exists()


def test_a_full_disk_while_saving_a_checkpoint_is_one_line(pair, tmp_path, monkeypatch):
    from accelerate import Accelerator

    def full(self, *args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file "
                           "data/2: file write failed")  # fmt: skip

    monkeypatch.setattr(Accelerator, "save_state", full)
    _, conv, text = pair
    out = tmp_path / "up"
    argv = ["uptrain", str(conv), "--data", str(text), "--output", str(out), "--max-steps", "2", "--batch-size", "2",
            "--seq-len", "32", "-q"]  # fmt: skip
    res = CliRunner().invoke(main, argv)
    assert res.exit_code == 1 and "disk full" in res.output and "Traceback" not in res.output, res.output
    assert not [p for p in out.rglob("*") if p.name.startswith(".")]  # no half-written checkpoint
