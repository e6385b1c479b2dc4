"""``convert --self-text SHARE`` (convert/calibration/own_text.py): the stages read the mix the model
wrote into the user's text (the same bytes as a conversion given that mix as --calibration), the
user's last windows stay the stage guard's and the model's own held-out sample is scored apart, the
record names the user's text and what the model wrote (never a cache path), the recipe file makes the
same model again, a damaged mix is refused in one line, and bad values are refused before any work."""

from __future__ import annotations

import hashlib
import json
import re

import pytest
from click.testing import CliRunner
from conftest import llama_with_tokenizer

from mha2gqa.cli import main
from mha2gqa.convert import convert_checkpoint
from mha2gqa.convert.calibration import own_text
from mha2gqa.convert.settings import ConvertSettings
from mha2gqa.core.errors import Mha2GqaError

WINDOW = 16
SMALL = dict(method="svd", calibration_tokens=256, calibration_seq_len=WINDOW, device="cpu", progress=False)


def numbered_text(path, lines: int = 240):
    """Lines each with its own number, so that where a piece of the text went can be told."""
    path.write_text("\n\n".join(f"the cat number {i} sat on the mat" for i in range(lines)))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("own-text")
    text = numbered_text(root / "user.txt")
    return str(llama_with_tokenizer(root / "mha", text, max_positions=64)), text


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MHA2GQA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def weights(folder) -> bytes:
    return (folder / "model.safetensors").read_bytes()


def the_mix(cache):
    (mix,) = cache.glob("self-text/mix-*/calibration-mix.txt")
    return mix


def test_the_stages_read_the_mix_the_model_wrote_into_the_users_text(setup, tmp_path, cache):
    src, text = setup
    own = convert_checkpoint(src, tmp_path / "own", 2, calibration=str(text), self_text=0.5, guard="off", **SMALL)
    facts = own.record.conversion.calibration.own
    mix = the_mix(cache)
    assert facts.share == 0.5 and abs(facts.mixed_share - 0.5) < 0.1 and facts.tokens >= 0.5 * 256
    assert facts.mix_sha256 == hashlib.sha256(mix.read_bytes()).hexdigest() and "the cat number 0 " in mix.read_text()
    given = convert_checkpoint(src, tmp_path / "given", 2, calibration=str(mix), guard="off", **SMALL)
    plain = convert_checkpoint(src, tmp_path / "plain", 2, calibration=str(text), guard="off", **SMALL)
    assert weights(own.output) == weights(given.output) != weights(plain.output)
    record = (own.output / "mha2gqa_conversion.json").read_text()
    assert json.loads(record)["conversion"]["calibration"]["data"] == "user.txt" and str(cache) not in record
    assert "written by the model itself" in own.summary()


def test_the_users_last_windows_stay_the_guards_and_the_models_own_sample_is_scored_apart(setup, tmp_path, cache):
    src, text = setup
    s = ConvertSettings(num_kv_heads=2, calibration=str(text), self_text=0.5, **SMALL)
    before = own_text._before_guard(own_text.Path(src), s, 64)
    from mha2gqa.convert.guard import guard_windows
    from mha2gqa.core.models import load_tokenizer

    ids, _, _ = guard_windows(own_text.Path(src), str(text), WINDOW)
    held = set(re.findall(r"number (\d+) ", load_tokenizer(own_text.Path(src)).decode(ids.flatten().tolist())))
    assert held and text.read_text().startswith(before) and not held & set(re.findall(r"number (\d+) ", before))
    r = convert_checkpoint(src, tmp_path / "g", 2, calibration=str(text), self_text=0.5, refit=True, refit_steps=2,
                           refit_tokens=128, **SMALL)  # fmt: skip
    guard = r.record.conversion.guard
    assert guard.where.startswith("the calibration text's last")
    assert [source.name for source in guard.stages[0].after.sources] == [own_text.SAMPLE_NAME]
    assert "the model's own text KL" in r.summary()
    sample = set(re.findall(r"number (\d+) ", the_mix(cache).read_text()))
    assert not held & sample  # the mix holds none of the guard's windows of the user's text


def test_the_recipe_file_makes_the_same_model_again(setup, tmp_path, monkeypatch):
    src, text = setup
    first = convert_checkpoint(src, tmp_path / "a", 2, calibration=str(text), self_text=0.25, **SMALL)
    monkeypatch.chdir(text.parent)  # where --recipe finds the calibration text by its name
    args = ["convert", src, str(tmp_path / "b"), "--recipe", str(first.output / "mha2gqa_recipe.yaml"), "-q"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "self_text: 0.25" in (first.output / "mha2gqa_recipe.yaml").read_text()
    assert weights(first.output) == weights(tmp_path / "b")


def test_a_damaged_mix_is_refused_in_one_line_naming_the_file(setup, tmp_path, cache):
    src, text = setup
    convert_checkpoint(src, tmp_path / "a", 2, calibration=str(text), self_text=0.5, guard="off", **SMALL)
    mix = the_mix(cache)
    mix.write_text(mix.read_text()[:-5] + "tampered")
    with pytest.raises(Mha2GqaError) as e:
        convert_checkpoint(src, tmp_path / "b", 2, calibration=str(text), self_text=0.5, guard="off", **SMALL)
    assert "\n" not in str(e.value) and str(mix) in str(e.value) and not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    ("value", "why"), [("0", "--self-text"), ("1", "--self-text"), ("nan", "--self-text"), ("-0.5", "--self-text")]
)
def test_a_share_outside_0_and_1_is_refused_before_any_work(setup, tmp_path, value, why, cache):
    src, text = setup
    args = ["convert", src, str(tmp_path / "out"), "-g", "2", "--method", "svd", "--calibration", str(text)]
    result = CliRunner().invoke(main, [*args, "--self-text", value])
    assert result.exit_code != 0 and why in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "out").exists() and not cache.exists()


def test_a_text_with_nothing_before_the_guards_windows_is_refused_before_the_model_writes(setup, tmp_path, cache):
    src, _ = setup
    short = numbered_text(tmp_path / "short.txt", lines=10)  # 101 tokens: the guard needs 80, its 64 end it
    with pytest.raises(Mha2GqaError, match="nothing of it comes before") as e:
        convert_checkpoint(src, tmp_path / "o", 2, calibration=str(short), self_text=0.5, **SMALL)
    assert "\n" not in str(e.value) and not (tmp_path / "o").exists() and not list(cache.glob("self-text/*/text.txt"))


def test_without_calibration_or_under_a_launcher_it_is_refused_before_any_work(setup, tmp_path, cache, monkeypatch):
    src, text = setup
    alone = CliRunner().invoke(main, ["convert", src, str(tmp_path / "o"), "-g", "2", "--self-text", "0.5"])
    assert alone.exit_code != 0 and "give --calibration" in alone.output and "Traceback" not in alone.output
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = ["convert", src, str(tmp_path / "o"), "-g", "2", "--method", "svd", "--calibration", str(text)]
    launched = CliRunner().invoke(main, [*args, "--self-text", "0.5"])
    assert launched.exit_code != 0 and "mha2gqa self-text" in launched.output, launched.output
    assert not (tmp_path / "o").exists() and not cache.exists()


def test_the_distillation_reads_the_mix_too(setup, tmp_path, cache):
    src, text = setup
    args = ["convert", src, str(tmp_path / "d"), "-g", "2", "--method", "mean", "--distill", "--distill-steps", "1",
            "--calibration", str(text), "--calibration-tokens", "256", "--calibration-seq-len", str(WINDOW),
            "--self-text", "0.5", "--device", "cpu", "-q"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    read = json.loads((tmp_path / "d" / "mha2gqa_uptrain.json").read_text())["uptrain"]["text"]
    assert read["sha256"] == hashlib.sha256(the_mix(cache).read_bytes()).hexdigest()


def test_the_model_writes_its_share_of_every_window_the_distillation_reads(setup, tmp_path, cache):
    """The distillation reads 32 windows of 16 tokens, twice the calibration budget: the model's text is
    its share of those, so the mix (which ends where that text does) holds a window for every read."""
    src, text = setup
    args = ["convert", src, str(tmp_path / "d"), "-g", "2", "--method", "svd", "--distill", "--distill-steps", "8",
            "--distill-batch", "4", "--calibration", str(text), "--calibration-tokens", "256",
            "--calibration-seq-len", str(WINDOW), "--self-text", "0.5", "--device", "cpu", "-q"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "d" / "mha2gqa_conversion.json").read_text())
    assert record["conversion"]["calibration"]["own"]["tokens"] >= 0.5 * 8 * 4 * WINDOW > 0.5 * 256 * own_text.MARGIN


def _stopped_after_layer_0(src, dst, monkeypatch, **kw) -> None:
    """A --self-text refit into ``dst`` stopped as a kill would, before layer 1's record."""
    import mha2gqa.convert.refit.layerwise as layerwise

    record = layerwise._layer_record

    def stopping(i, *args, **options):
        if i == 1:
            raise RuntimeError("killed")
        return record(i, *args, **options)

    with monkeypatch.context() as m:
        m.setattr(layerwise, "_layer_record", stopping)
        with pytest.raises(RuntimeError, match="killed"):
            convert_checkpoint(src, dst, 2, **kw)


def test_a_stopped_run_resumes_on_the_mix_its_layers_were_fitted_on_and_refuses_another(setup, tmp_path, monkeypatch):
    """The kept layers were fitted on the mix the model wrote; a resume whose model writes other text (at
    other --threads, the last bits of a forward pass can move a sample) would mix two fits in one model."""
    from mha2gqa.core.resume import resume_folder

    src, text = setup
    kw = dict(calibration=str(text), self_text=0.5, refit=True, refit_steps=2, refit_tokens=128, **SMALL)
    whole = convert_checkpoint(src, tmp_path / "whole", 2, **kw)
    dst = tmp_path / "out"
    _stopped_after_layer_0(src, dst, monkeypatch, **kw)
    path = resume_folder(dst) / "fingerprint.json"
    held = json.loads(path.read_text())
    mix = whole.record.conversion.calibration.own.mix_sha256
    assert held[own_text.FINGERPRINT_KEY] == {"mix sha256": mix}
    assert weights(convert_checkpoint(src, dst, 2, resume=True, **kw).output) == weights(whole.output)
    _stopped_after_layer_0(src, dst, monkeypatch, overwrite=True, **kw)
    held[own_text.FINGERPRINT_KEY] = {"mix sha256": "0" * 64}  # the stopped run's model wrote another mix
    path.write_text(json.dumps(held))
    with pytest.raises(Mha2GqaError, match=r"--resume: the text the model wrote \(--self-text\) changed since"):
        convert_checkpoint(src, dst, 2, resume=True, overwrite=True, **kw)
    assert (resume_folder(dst) / "layer-0.json").is_file()  # refused, not dropped
