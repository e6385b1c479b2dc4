"""``convert --distill``'s learning-rate probe: the first sixth of the steps at --distill-lr x 1/3, 1, 3,
each from the converted model; the run whose model the stage guard finds closest to SRC goes on, its
probe steps kept; the choice in the record and the terminal, read back on --resume."""

import json
import re
import signal

import pytest
from click.testing import CliRunner
from conftest import llama_with_tokenizer, story_text

from mha2gqa.cli import main
from mha2gqa.core.records import CONVERSION_RECORD, UPTRAIN_RECORD
from mha2gqa.core.resume import resume_folder
from mha2gqa.distill_probe import PROBE_FILE, probe_steps


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe")
    text = story_text(root / "calib.txt", 400)
    return {"model": llama_with_tokenizer(root / "mha", text, max_positions=64), "text": text}


def _convert(src, dst, *more: str):
    args = ["convert", str(src["model"]), str(dst), "-g", "1", "--method", "mean", "-q", "--distill"]
    args += ["--calibration", str(src["text"]), "--calibration-tokens", "2048", "--calibration-seq-len", "32"]
    return CliRunner().invoke(main, [*args, "--distill-steps", "12", *more])


def _distill_stage(dst) -> dict:
    stages = json.loads((dst / CONVERSION_RECORD).read_text())["conversion"]["guard"]["stages"]
    return next(s for s in stages if s["stage"] == "distill")


def _lr(dst) -> float:
    return json.loads((dst / UPTRAIN_RECORD).read_text())["uptrain"]["settings"]["lr"]


def test_probe_steps():
    assert [probe_steps(n) for n in (1, 2, 5, 6, 12, 24, 25)] == [0, 1, 1, 1, 2, 4, 4]


@pytest.mark.parametrize(("given", "factor"), [("1.5e-3", 3.0), ("1.0", 1 / 3)])
def test_the_probe_goes_on_with_the_rate_closest_to_src(src, tmp_path, given, factor):
    """On this tiny model 1.5e-3 of each weight's RMS is too small a step and 1.0 too large: the probe
    goes on with the rate whose short run the guard measured closest to SRC, and the published model is
    closer to SRC than the rate as given makes it; its probe steps are kept (the same bytes as a plain
    run at the chosen rate)."""
    probed = _convert(src, tmp_path / "probed", "--distill-lr", given)
    assert probed.exit_code == 0, probed.output
    stage = _distill_stage(tmp_path / "probed")
    figures = {float(r): float(kl) for r, kl in re.findall(r"([0-9.e-]+): KL ([0-9.e-]+)", stage["detail"])}
    chosen = _lr(tmp_path / "probed")
    assert chosen == pytest.approx(float(given) * factor) and f"--distill-lr {chosen:.3g} chosen" in stage["detail"]
    assert len(figures) == 3 and min(figures, key=figures.get) == pytest.approx(chosen, rel=1e-2)
    assert "distill: kept - held-out" in probed.output and stage["detail"] in probed.output
    plain = _convert(src, tmp_path / "plain", "--distill-lr", given, "--no-distill-probe")
    assert plain.exit_code == 0, plain.output
    assert _lr(tmp_path / "plain") == float(given) and _distill_stage(tmp_path / "plain")["detail"] == ""
    assert stage["after"]["kl"] < _distill_stage(tmp_path / "plain")["after"]["kl"]
    same = _convert(src, tmp_path / "same", "--distill-lr", repr(chosen), "--no-distill-probe")
    assert same.exit_code == 0, same.output
    assert (tmp_path / "same" / "model.safetensors").read_bytes() == (
        tmp_path / "probed" / "model.safetensors"
    ).read_bytes()


def test_without_the_guard_there_is_no_probe(src, tmp_path):
    done = _convert(src, tmp_path / "dst", "--guard", "off")
    assert done.exit_code == 0, done.output
    assert _lr(tmp_path / "dst") == 1.5e-3 and "probe" not in done.output


def test_a_resumed_run_goes_on_at_the_rate_chosen_and_refuses_a_damaged_choice(src, tmp_path, monkeypatch):
    """Stopped after the probe, --resume continues at the chosen rate without probing again, to the
    uninterrupted run's bytes; a damaged probe file is refused in one line naming it."""
    import mha2gqa.uptrain.trainer as trainer
    from mha2gqa.core.signals import Terminated

    whole, dst = tmp_path / "whole", tmp_path / "dst"
    assert _convert(src, whole).exit_code == 0
    step = trainer._Trainer.step

    def stopping(self, k):
        if k == 9:  # the probe runs 2 steps; checkpoints every 4: the newest is step 8's
            raise Terminated(signal.SIGTERM)
        return step(self, k)

    with monkeypatch.context() as m:
        m.setattr(trainer._Trainer, "step", stopping)
        assert _convert(src, dst).exit_code != 0
    kept = resume_folder(dst)
    choice = (kept / PROBE_FILE).read_text()
    (kept / PROBE_FILE).write_text('{"lr": "fast"}')
    bad = _convert(src, dst, "--resume")
    assert bad.exit_code == 1 and str(kept / PROBE_FILE) in bad.output and "--remove-stale" in bad.output
    assert len(bad.output.strip().splitlines()) == 1 and kept.exists()
    (kept / PROBE_FILE).write_text(choice)
    steps = []
    monkeypatch.setattr(trainer._Trainer, "step", lambda self, k: steps.append(k) or step(self, k))
    done = _convert(src, dst, "--resume")
    assert done.exit_code == 0, done.output
    assert steps == [9, 10, 11, 12] and "distill probe: --distill-lr" not in done.output
    assert _distill_stage(dst)["detail"] == _distill_stage(whole)["detail"]
    assert (dst / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()


def test_a_rescaled_model_probes_to_the_same_rate_and_quality(src, tmp_path):
    """The same function written differently (v x 4 with o / 4, q with k, a norm with what it feeds)
    takes the same relative steps, so the probe chooses the same rate and the distillation reaches the
    same held-out KL."""
    from conftest import load, save
    from test_guard import _rescaled
    from transformers import AutoTokenizer

    model = load(src["model"])
    _rescaled(model)
    rescaled = {**src, "model": save(model, tmp_path / "rescaled")}
    AutoTokenizer.from_pretrained(src["model"]).save_pretrained(rescaled["model"])
    for source, name in ((src, "a"), (rescaled, "b")):
        done = _convert(source, tmp_path / name, "--distill-lr", "1.5e-3")
        assert done.exit_code == 0, done.output
    a, b = _distill_stage(tmp_path / "a"), _distill_stage(tmp_path / "b")
    assert _lr(tmp_path / "a") == _lr(tmp_path / "b") and "chosen" in a["detail"]
    assert b["after"]["kl"] == pytest.approx(a["after"]["kl"], rel=0.02), (a, b)
