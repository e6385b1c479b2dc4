"""Every bad input: one clear line, a non-zero exit, and nothing left behind."""

import errno
import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from conftest import random_model, tiny_config

from mha2gqa.cli import main


@pytest.fixture
def src(tiny_checkpoint, tmp_path):
    """A private copy of a tiny Llama (4 heads, 2 layers) that a test may damage."""
    folder = tmp_path / "src"
    shutil.copytree(tiny_checkpoint("llama"), folder)
    return folder


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_refused(result, pattern, parent):
    assert result.exit_code == 1, result.output
    lines = [ln for ln in result.output.strip().splitlines() if not ln.startswith("writing:")]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert "Traceback" not in result.output
    import re

    assert re.search(pattern, lines[0]), lines[0]
    leftovers = [p.name for p in parent.iterdir() if p.name.startswith(".")]
    assert not leftovers, leftovers


def convert_refused(src, parent, pattern):
    """``mha2gqa convert SRC OUT -g 2`` refuses in one line matching ``pattern``."""
    assert_refused(run_cli("convert", src, parent / "out", "-g", 2), pattern, parent)


def rewrite_header(path, edit):
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n :])


@pytest.mark.parametrize(
    ("g", "pattern"),
    [
        (3, r"--num-kv-heads 3 is not valid .* 4 KV heads: choose a divisor of 4 \(1, 2, 4\)"),
        (8, r"--num-kv-heads 8 is not valid"),
        (0, r"--num-kv-heads 0 is not valid"),
    ],
)
def test_bad_group_count(src, tmp_path, g, pattern):
    assert_refused(run_cli("convert", src, tmp_path / "out", "-g", g), pattern, tmp_path)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        (
            {"architectures": ["RwkvForCausalLM"], "model_type": "rwkv"},
            r"unsupported model family \(RwkvForCausalLM\); supported: .*Qwen2ForCausalLM.*"
            r"re-targeted: .*GPT2LMHeadModel",
        ),
        ({"num_hidden_layers": 1}, r"the weights have more layers than the 1 config.json says"),
        ({"head_dim": 4}, r"k_proj.weight has 32 rows, but the config implies 16 .*check head_dim in config.json"),
        (
            {"vocab_size": 100},
            r"2 tensors have the wrong shape, e.g. lm_head.weight is \[96, 32\], the config says \[100, 32\]",
        ),
    ],
    ids=["unsupported-family", "fewer-layers", "head-dim", "vocab-size"],
)
def test_a_config_the_weights_do_not_match(src, tmp_path, changes, pattern):
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (src / "config.json").write_text(json.dumps(cfg))
    convert_refused(src, tmp_path, pattern)


def test_missing_tensor(src, tmp_path):
    from safetensors.torch import load_file, save_file

    state = load_file(src / "model.safetensors")
    del state["model.layers.1.self_attn.v_proj.weight"]
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    convert_refused(src, tmp_path, r"1 tensors the config needs are missing: model.layers.1.self_attn.v_proj.weight")


def test_truncated_safetensors(src, tmp_path):
    path = src / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    convert_refused(src, tmp_path, r"model.safetensors: data ends at byte \d+ but the file has \d+ bytes \(truncated\)")


def test_gap_in_safetensors_data(src, tmp_path):
    rewrite_header(src / "model.safetensors", lambda h: h.pop("model.layers.1.self_attn.v_proj.weight"))
    convert_refused(src, tmp_path, r"model.safetensors: tensor data is not contiguous at byte \d+")


def test_corrupt_safetensors(src, tmp_path):
    path = src / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[8:20] = b"not json!!!!"
    path.write_bytes(bytes(raw))
    convert_refused(src, tmp_path, r"model.safetensors: header is not valid JSON")


def test_missing_config(src, tmp_path):
    (src / "config.json").unlink()
    convert_refused(src, tmp_path, r"no config.json \(is this a Hugging Face model folder\?\)")


def test_missing_weights(src, tmp_path):
    (src / "model.safetensors").unlink()
    convert_refused(src, tmp_path, r"no model.safetensors or model.safetensors.index.json")


def test_no_such_source(tmp_path):
    assert_refused(run_cli("convert", tmp_path / "nope", tmp_path / "out", "-g", 2), r"nope: no such folder", tmp_path)


def test_hub_id_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    result = run_cli("convert", "meta-llama/Llama-2-7b-hf", tmp_path / "out", "-g", 8)
    assert result.exit_code == 1 and "the Hugging Face hub cannot be reached" in result.output
    assert not (tmp_path / "out").exists()


def test_unwritable_dst(src, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_refused(run_cli("convert", src, blocker / "out", "-g", 2), r"cannot write next to DST .*file/out", tmp_path)


def test_dst_is_a_file(src, tmp_path):
    (tmp_path / "out").write_text("x")
    convert_refused(src, tmp_path, r"exists and is not a folder")


def test_dst_is_src(src, tmp_path):
    assert_refused(
        run_cli("convert", src, src, "-g", 2, "--overwrite"), r"is \(or contains\) the source model", tmp_path
    )
    assert_refused(
        run_cli("convert", src, tmp_path, "-g", 2, "--overwrite"), r"is \(or contains\) the source model", tmp_path
    )
    assert (src / "model.safetensors").is_file()


def test_existing_output_needs_overwrite(src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert_refused(run_cli("convert", src, out, "-g", 2), r"exists and is not empty: pass --overwrite", tmp_path)
    assert (out / "keep.txt").read_text() == "precious"
    assert_refused(run_cli("convert", src, out, "-g", 2, "--overwrite"), r"was not written by mha2gqa", tmp_path)
    assert (out / "keep.txt").read_text() == "precious"  # --overwrite replaces only our own outputs
    mine = tmp_path / "mine"
    assert run_cli("convert", src, mine, "-g", 1, "-q").exit_code == 0
    result = run_cli("convert", src, mine, "-g", 2, "--overwrite", "-q")
    assert result.exit_code == 0, result.output
    assert json.loads((mine / "config.json").read_text())["num_key_value_heads"] == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_empty_existing_output_is_fine(src, tmp_path):
    (tmp_path / "out").mkdir()
    assert run_cli("convert", src, tmp_path / "out", "-g", 2, "-q").exit_code == 0


def test_disk_full_mid_write_removes_the_temp_folder(src, tmp_path, monkeypatch):
    import mha2gqa.convert.write.shard_writer as writer

    real = writer._write_tensor
    calls = []

    def failing(fd, t):
        calls.append(t.name)
        if len(calls) == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, t)

    monkeypatch.setattr(writer, "_write_tensor", failing)
    convert_refused(
        src,
        tmp_path,
        r"disk full while writing .*: the output needs [\d,]+(\.\d+)? (B|KiB|MiB|GiB); free space or choose "
        "another DST",
    )
    assert not (tmp_path / "out").exists()


def test_pickle_needs_allow_pickle(tmp_path):
    model = random_model(tiny_config("llama"))
    src = tmp_path / "src"
    model.save_pretrained(src, safe_serialization=False) if _can_save_pickle() else _save_pickle(model, src)
    convert_refused(src, tmp_path, r"only PyTorch pickle weights \(.bin\) found; .*--allow-pickle")
    result = run_cli("convert", src, tmp_path / "out", "-g", 4, "--allow-pickle", "-q")
    assert result.exit_code == 0, result.output
    from safetensors.torch import load_file

    got = load_file(tmp_path / "out" / "model.safetensors")
    for name, p in model.state_dict().items():
        if name in got:
            assert torch.equal(got[name], p), name


def _can_save_pickle() -> bool:
    import inspect

    from transformers import PreTrainedModel

    return "safe_serialization" in inspect.signature(PreTrainedModel.save_pretrained).parameters


def _save_pickle(model, folder):
    folder.mkdir()
    model.config.save_pretrained(folder)
    state = {
        k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or not model.config.tie_word_embeddings
    }
    torch.save(state, folder / "pytorch_model.bin")


def test_quantized_checkpoint_is_refused(src, tmp_path):
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (src / "config.json").write_text(json.dumps(cfg))
    convert_refused(src, tmp_path, r"quantized checkpoint \(gptq\); convert the unquantized model")


def test_unknown_method_is_a_usage_error(src, tmp_path):
    result = run_cli("convert", src, tmp_path / "out", "-g", 2, "--method", "magic")
    assert result.exit_code == 2 and "'magic' is not one of" in result.output


def test_a_source_without_a_tokenizer_is_named_when_text_is_read(calib_text, tmp_path):
    """A checkpoint saved without its tokenizer: the step that reads text says so, not that the text
    is too short (issue 48)."""
    from test_methods import with_tokenizer

    src = with_tokenizer(random_model(tiny_config("llama", vocab_size=300)), tmp_path / "src", calib_text)
    for name in src.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens")):
            name.unlink()
    result = run_cli("convert", src, tmp_path / "out", "-g", 1, "--method", "svd", "--calibration", calib_text)
    assert_refused(
        result, r"src: no tokenizer \(tokenizer.json, .* absent\): .* copy the original model's tokenizer", tmp_path
    )
    assert not (tmp_path / "out").exists()


def test_an_error_is_shown_by_its_first_line_or_its_type():
    """What a library raised, quoted in a one-line error: its first non-blank line (cut when asked),
    its type's name when its message is empty or blank (never an IndexError from an empty message)."""
    from mha2gqa.core.errors import first_line

    assert first_line(ValueError("\n  bad value  \nmore detail\n")) == "bad value"
    assert first_line(ValueError("abcdef"), 3) == "abc"
    assert first_line(ValueError()) == "ValueError"
    assert first_line(OSError(" \n ")) == "OSError"


@pytest.mark.parametrize("refit", [False, True])
def test_a_calibration_text_too_short_is_refused_before_any_weight_loads(refit, tmp_path, monkeypatch):
    """Fewer tokens than the stages' windows (one; two with --refit): one line, before the model's
    skeleton is built or a tensor read, with the count the calibration pass would find."""
    from conftest import llama_with_tokenizer, story_text

    import mha2gqa.convert.calibration.streaming as streaming
    import mha2gqa.convert.engine.layers as layers
    import mha2gqa.convert.refit.layerwise as layerwise

    src = llama_with_tokenizer(tmp_path / "src", story_text(tmp_path / "t.txt"), max_positions=64)
    short = tmp_path / "short.txt"
    short.write_text("the cat sat on the mat")

    def no(*_, **__):
        raise AssertionError("the model was built before the text was checked")

    for module in (layers, streaming, layerwise):
        monkeypatch.setattr(module, "skeleton", no)
    args = ["convert", str(src), str(tmp_path / "o"), "-g", "1", "--method", "svd", "--calibration", str(short)]
    result = CliRunner().invoke(main, [*args, *(["--refit"] if refit else [])])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
    windows = "two windows (--refit holds one out)" if refit else "one window"
    assert f"tokens, fewer than {windows} of 64" in result.output and not (tmp_path / "o").exists()


def test_a_recipe_whose_repeatable_setting_is_not_a_list_is_refused_naming_the_recipe(tmp_path):
    """``guard_data: served.txt`` (one text, not a list of texts) in a recipe file: one line naming the
    file and the setting, before any work (click alone said "Value must be an iterable")."""
    from click.testing import CliRunner

    from mha2gqa.cli import main

    recipe = tmp_path / "mine.yaml"
    recipe.write_text("convert: {method: svd, guard_data: served.txt}\n")
    result = CliRunner().invoke(
        main, ["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--recipe", str(recipe)]
    )
    assert result.exit_code == 2, result.output
    assert "mine.yaml: convert.guard_data must be a list" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "dst").exists()
