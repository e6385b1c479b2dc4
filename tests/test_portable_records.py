"""A converted model's card, recipe file and record travel (issue 69): they name the calibration
text by file name and sha256, never by a path of the machine that converted; the card's
``base_model`` is a model id or absent, and its metadata reads with ``huggingface_hub``; ``--recipe``
finds its text beside the recipe file and refuses a text of another sha256 in one line; ``eval``
still flags its own calibration text from the record alone, on another machine."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from click.testing import CliRunner
from conftest import llama_with_tokenizer, story_text

from mha2gqa.cli import main
from mha2gqa.core.text_ref import SKETCH_LINES, TextRef, compared_lines, sketch


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``(source, output, the calibration folder)``: svd at 1 KV head, calibrated on a text given by
    its absolute path in a folder of its own."""
    root = tmp_path_factory.mktemp("portable")
    texts = root / "my-private-texts"
    texts.mkdir()
    text = story_text(texts / "calib.txt", 400)
    src = llama_with_tokenizer(root / "src", text, max_positions=64)
    out = root / "out"
    args = ["convert", str(src), str(out), "-g", "1", "--method", "svd", "--calibration", str(text.resolve())]
    result = CliRunner().invoke(main, [*args, "--calibration-tokens", "1024", "-q"])
    assert result.exit_code == 0, result.output
    return src, out, texts


def test_no_file_the_conversion_writes_names_the_calibration_texts_path(converted):
    _, out, texts = converted
    sha = hashlib.sha256((texts / "calib.txt").read_bytes()).hexdigest()
    for path in out.iterdir():
        if path.suffix in (".json", ".yaml", ".md"):
            assert str(texts) not in path.read_text(), path.name
    record = json.loads((out / "mha2gqa_conversion.json").read_text())
    calibration = record["conversion"]["calibration"]
    assert calibration["data"] == "calib.txt" and calibration["text"]["sha256"] == sha
    assert record["settings"]["calibration"] == "calib.txt" and record["settings"]["calibration_sha256"] == sha
    recipe = (out / "mha2gqa_recipe.yaml").read_text()
    assert "calibration: calib.txt\n" in recipe and f"calibration_sha256: {sha}\n" in recipe
    assert f"`calib.txt` (sha256 `{sha[:16]}`…)" in (out / "README.md").read_text()


def test_the_cards_metadata_reads_with_huggingface_hub_and_names_no_local_folder(converted):
    from huggingface_hub import ModelCard

    from mha2gqa.core.cards import model_card
    from mha2gqa.core.conversion_record import read_conversion_record

    _, out, _ = converted
    card = ModelCard((out / "README.md").read_text())
    data = card.data.to_dict()
    assert data["library_name"] == "transformers" and "mha2gqa" in data["tags"]
    assert "base_model" not in data  # a local folder's name ("src") would link to some other model
    record = read_conversion_record(out)
    from_hub = record.__class__(**{**record.__dict__, "source": record.source.__class__(
        **{**record.source.__dict__, "repo_id": "meta-llama/Llama-2-7b-hf"})})  # fmt: skip
    assert ModelCard(model_card(from_hub)).data.to_dict()["base_model"] == "meta-llama/Llama-2-7b-hf"


def test_a_recipe_finds_its_text_beside_it_and_refuses_another(converted, tmp_path):
    src, out, texts = converted
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.copy(out / "mha2gqa_recipe.yaml", moved)
    shutil.copy(texts / "calib.txt", moved)
    recipe = ["--recipe", str(moved / "mha2gqa_recipe.yaml")]
    again = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "again"), *recipe, "-q"])
    assert again.exit_code == 0, again.output
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    other = story_text(tmp_path / "calib.txt", 401)
    refused = CliRunner().invoke(
        main, ["convert", str(src), str(tmp_path / "no"), *recipe, "--calibration", str(other)]
    )
    assert refused.exit_code != 0 and len(refused.output.strip().splitlines()) == 1, refused.output
    assert "not the text --calibration-sha256 names" in refused.output and "Traceback" not in refused.output
    assert not (tmp_path / "no").exists()


def test_eval_flags_the_calibration_text_from_the_record_alone(converted, tmp_path):
    """The text moved to another folder (the converting machine's path is gone): the same bytes are
    the same text; a text sharing a third of its lines is flagged with about that share."""
    from mha2gqa.core.text import load_text
    from mha2gqa.eval.pair import calibration_overlap

    _, out, texts = converted
    copy = tmp_path / "renamed.txt"
    shutil.copy(texts / "calib.txt", copy)
    same = calibration_overlap(load_text(str(copy)), str(copy), out, "text")
    assert same is not None and same.same and same.use == "calibration"
    lines = (texts / "calib.txt").read_text().split("\n\n")
    fresh = [f"an entirely different sentence about {i} green birds in the tall trees" for i in range(60)]
    mixed = tmp_path / "mixed.txt"
    mixed.write_text("\n\n".join(lines[:30] + fresh))
    part = calibration_overlap(load_text(str(mixed)), str(mixed), out, "text")
    distinct = len(compared_lines(lines[:30]))
    assert part is not None and not part.same and part.flagged
    assert part.share == pytest.approx(distinct / (distinct + 60))


def test_a_sampled_sketch_estimates_the_share_of_a_large_text():
    """More distinct lines than the sketch keeps: the share is estimated on the kept hashes' range."""
    big = [f"line number {i} of a long calibration text, long enough to be compared" for i in range(3 * SKETCH_LINES)]
    lines, total = sketch(["\n".join(big)])
    ref = TextRef("big.txt", None, lines, total)
    assert total == 3 * SKETCH_LINES and len(ref.hashes()) == SKETCH_LINES
    half = set(big[: 3 * SKETCH_LINES // 2]) | {
        f"a line of another text, number {i}, long enough too" for i in range(3 * SKETCH_LINES // 2)
    }
    assert ref.share_of(half) == pytest.approx(0.5, abs=0.04)
    assert ref.share_of(set(big)) == 1.0


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("lines", "not base64!", "not a line sketch"),
        ("lines", "AAAA" * 5, "at most lines_total"),  # more hashes than the text has lines
        ("sha256", "abc", "not a sha256"),
    ],
)
def test_a_tampered_text_reference_is_refused_naming_the_record(converted, tmp_path, field, value, why):
    from mha2gqa.core.conversion_record import read_conversion_record
    from mha2gqa.core.errors import Mha2GqaError

    _, out, _ = converted
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    path = copy / "mha2gqa_conversion.json"
    record = json.loads(path.read_text())
    record["conversion"]["calibration"]["text"] |= {field: value, "lines_total": 4}
    path.write_text(json.dumps(record))
    with pytest.raises(Mha2GqaError, match=why) as e:
        read_conversion_record(copy)
    assert str(path) in str(e.value) and "damaged conversion record" in str(e.value)


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """``(root, the distilled model, the uptrained one, the text)``: ``convert --distill`` (guard off: the
    record alone names the stage), then ``mha2gqa uptrain`` of it, both on a text given by its absolute
    path."""
    root = tmp_path_factory.mktemp("portable-distill")
    texts = root / "my-private-texts"
    texts.mkdir()
    text = story_text(texts / "calib.txt", 400).resolve()
    src = llama_with_tokenizer(root / "src", text, max_positions=64)
    out, up = root / "distilled", root / "uptrained"
    common = ["--calibration", str(text), "--calibration-tokens", "1024", "-q"]
    args = ["convert", str(src), str(out), "-g", "1", "--method", "svd", "--distill", "--distill-steps", "2"]
    result = CliRunner().invoke(main, [*args, *common, "--guard", "off"])
    assert result.exit_code == 0, result.output
    args = ["uptrain", str(out), "--data", str(text), "--output", str(up), "--max-steps", "2", "--seq-len", "32"]
    result = CliRunner().invoke(main, [*args, "--batch-size", "2", "--teacher", str(src), "--objective", "kd", "-q"])
    assert result.exit_code == 0, result.output
    return root, out, up, text


def test_a_distilled_or_uptrained_models_records_name_no_path_of_the_machine(distilled):
    """The uptraining record and card (``convert --distill``'s and ``mha2gqa uptrain``'s) name the
    models as ``./NAME`` and the text by file name with its sha256 and sketch, and so does the run log
    published beside them: no folder of the machine."""
    from huggingface_hub import ModelCard

    root, out, up, text = distilled
    sha = hashlib.sha256(text.read_bytes()).hexdigest()
    for folder in (out, up):
        for path in folder.iterdir():
            if path.suffix in (".json", ".jsonl", ".yaml", ".md"):  # the run log (uptrain_log.jsonl) too
                assert str(root) not in path.read_text(), f"{folder.name}/{path.name}"
        run = json.loads((folder / "mha2gqa_uptrain.json").read_text())["uptrain"]
        assert run["text"]["name"] == "calib.txt" and run["text"]["sha256"] == sha and run["text"]["lines"]
        assert run["settings"]["data"] == "calib.txt" and run["settings"]["teacher_cache"] is None
        assert run["settings"]["output"] == f"./{folder.name}"
        assert "base_model" not in ModelCard((folder / "README.md").read_text()).data.to_dict()
    first, then = (json.loads((f / "mha2gqa_uptrain.json").read_text())["uptrain"] for f in (out, up))
    assert (first["student"], first["stage"], first["settings"]["teacher"]) == ("./src", "distill", "./src")
    assert (then["student"], then["stage"]) == ("./distilled", None)
    card = (out / "README.md").read_text()
    assert "# src, converted and distilled" in card and "`mha2gqa convert --distill`" in card


def test_a_distilled_model_is_named_distill_not_uptrain(distilled, tmp_path):
    """``eval`` names the distilled model ``svd+distill`` (its record says which stage wrote it) and the
    model uptrained after it ``svd+distill+uptrain``; a record naming another stage is refused."""
    root, out, up, text = distilled
    names = []
    for folder in (out, up):
        path = tmp_path / f"{folder.name}.json"
        args = ["eval", "--original", str(root / "src"), "--converted", str(folder), "--data", str(text)]
        extra = ["--seq-len", "32", "--max-tokens", "256", "--no-attention", "--samples", "0", "--allow-overlap"]
        result = CliRunner().invoke(main, [*args, *extra, "--output", str(path), "-q"])
        assert result.exit_code in (0, 3), result.output  # (3: a gate; the names are what is tested)
        names.append(json.loads(path.read_text())["models"]["converted"]["recipe"])
    assert names[0] == "svd+distill" and names[1].startswith("svd+distill+uptrain"), names
    tampered = tmp_path / "tampered"
    shutil.copytree(out, tampered)
    record = json.loads((tampered / "mha2gqa_uptrain.json").read_text())
    record["uptrain"]["stage"] = "refit"
    (tampered / "mha2gqa_uptrain.json").write_text(json.dumps(record))
    from mha2gqa.core.errors import Mha2GqaError
    from mha2gqa.core.uptrain_guard import published_run

    with pytest.raises(Mha2GqaError, match=r"mha2gqa_uptrain.json: damaged uptraining record \(uptrain.stage"):
        published_run(tampered)
