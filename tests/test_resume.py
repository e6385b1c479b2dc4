"""``convert --refit --resume`` (issue 50): a conversion stopped after some layers keeps them beside
DST; resumed, its output equals an uninterrupted run's bit for bit (tensors and records but the
timings); a changed source, text or recipe refuses in one line; finished work is never dropped
unasked; nothing is left once DST is published."""

import dataclasses
import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner
from conftest import random_model, story_text, tiny_config
from test_methods import with_tokenizer

import mha2gqa.convert.refit.layerwise as layerwise
from mha2gqa.cli import main
from mha2gqa.convert import convert_checkpoint
from mha2gqa.core.conversion_record import NORMALIZED_ERROR
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.records import CONVERSION_RECORD
from mha2gqa.core.resume import resume_folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    text = story_text(root / "calib.txt", 300)
    src = with_tokenizer(
        random_model(tiny_config("llama", vocab_size=300, num_hidden_layers=4), seed=7), root / "src", text
    )
    kw = {"calibration": str(text), "calibration_tokens": 1024, "refit": True, "refit_steps": 12, "progress": False}
    whole = convert_checkpoint(src, root / "whole", 1, "svd", **kw)
    return {"src": src, "text": text, "kw": kw, "whole": whole}


def _stopped(setup, dst, monkeypatch, layer: int, g: int | None = 1, **options) -> None:
    """Convert into ``dst`` (``options`` in place of the setup's) and stop as a kill would, after layer
    ``layer``'s tensors are written and before its record."""
    record = layerwise._layer_record

    def stopping(i, *args, **kw):
        if i == layer:
            raise RuntimeError("killed")
        return record(i, *args, **kw)

    with monkeypatch.context() as m:
        m.setattr(layerwise, "_layer_record", stopping)
        with pytest.raises(RuntimeError, match="killed"):
            convert_checkpoint(setup["src"], dst, g, **{"method": "svd", **setup["kw"], **options})


def killed_once(args: list[str], ready) -> None:
    """Start ``args`` and SIGKILL it and every process under it (a launcher's ranks run in sessions of
    their own) as soon as ``ready()``; skips the test when the command finished first."""
    import psutil

    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    if proc.poll() is not None:
        pytest.skip("the conversion finished before it could be killed")
    root = psutil.Process(proc.pid)
    tree = [*root.children(recursive=True), root]
    for p in tree:
        p.send_signal(signal.SIGKILL)
    proc.wait()
    psutil.wait_procs(tree, timeout=30)


def _timeless(layers) -> list[dict]:
    return [{k: v for k, v in dataclasses.asdict(r).items() if k != "seconds"} for r in layers]


def test_a_stopped_refit_resumes_to_the_uninterrupted_output(setup, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    _stopped(setup, dst, monkeypatch, 2)
    kept = resume_folder(dst)
    assert not dst.exists() and sorted(p.name for p in kept.iterdir() if p.suffix == ".json") == [
        "fingerprint.json",
        "layer-0.json",
        "layer-1.json",
    ]
    fitted = []
    monkeypatch.setattr(layerwise, "_refit_layer", lambda *a, **k: fitted.append(a[1].i) or _refit(*a, **k))
    out = convert_checkpoint(setup["src"], dst, 1, "svd", resume=True, **setup["kw"])
    assert fitted == [2, 3]  # layers 0 and 1 read back, not fitted again
    whole = setup["whole"]
    assert (dst / "model.safetensors").read_bytes() == (whole.output / "model.safetensors").read_bytes()
    assert _timeless(out.facts.refit.layers) == _timeless(whole.facts.refit.layers)
    assert out.facts.guard == whole.facts.guard
    assert not kept.exists()  # published: the kept work goes
    record = json.loads((dst / CONVERSION_RECORD).read_text())["conversion"]
    assert [r["layer"] for r in record["refit"]["layers"]] == [0, 1, 2, 3]


_refit = layerwise._refit_layer


def test_a_refit_stopped_under_another_error_refuses_to_resume(setup, tmp_path, monkeypatch):
    """Layers kept by a version of the code whose refit lowered another error (one before the error
    was recorded: no such key) are not mixed with layers fitted to this one."""
    dst = tmp_path / "out"
    _stopped(setup, dst, monkeypatch, 1)
    path = resume_folder(dst) / "fingerprint.json"
    held = json.loads(path.read_text())
    assert held.pop("refit error") == NORMALIZED_ERROR
    path.write_text(json.dumps(held))
    with pytest.raises(
        Mha2GqaError, match=r"--resume: the refit error changed since the stopped run \(not recorded -> mean squared"
    ):
        convert_checkpoint(setup["src"], dst, 1, "svd", resume=True, **setup["kw"])
    assert (resume_folder(dst) / "layer-0.json").is_file()  # refused, not dropped


def test_a_refit_stopped_on_a_machine_of_another_arithmetic_refuses_to_resume(setup, tmp_path, monkeypatch):
    """``--refit-precision auto`` is bf16 on a machine that computes it natively and float32 elsewhere:
    layers kept by a run of the other arithmetic are not mixed with this machine's."""
    from mha2gqa.core.models import computes_bf16, resolve_precision

    dst = tmp_path / "out"
    _stopped(setup, dst, monkeypatch, 1)
    held = json.loads((resume_folder(dst) / "fingerprint.json").read_text())
    here = resolve_precision("auto", torch.device("cpu"))
    assert held["refit arithmetic"] == here
    monkeypatch.setattr("mha2gqa.core.models.computes_bf16", lambda device: not computes_bf16(device))
    other = {"bf16": "no", "no": "bf16"}[here]
    with pytest.raises(
        Mha2GqaError, match=rf"--resume: the refit arithmetic changed since the stopped run \({here} -> {other}\)"
    ):
        convert_checkpoint(setup["src"], dst, 1, "svd", resume=True, **setup["kw"])
    assert (resume_folder(dst) / "layer-0.json").is_file()  # refused, not dropped


def test_a_changed_input_refuses_to_resume_and_finished_work_is_never_dropped_unasked(setup, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    _stopped(setup, dst, monkeypatch, 1)
    other = story_text(tmp_path / "other.txt", 310)
    base = ["convert", str(setup["src"]), str(dst), "-g", "1", "--method", "svd", "--refit", "--refit-steps", "12"]
    text = ["--calibration-tokens", "1024", "--calibration", str(setup["text"])]
    changed = CliRunner().invoke(main, [*base[:-1], "13", *text, "--resume"])
    assert changed.exit_code == 1 and "--resume: the recipe changed since the stopped run" in changed.output
    moved = CliRunner().invoke(main, [*base, *text[:2], "--calibration", str(other), "--resume"])
    assert moved.exit_code == 1 and "--resume: the calibration text changed" in moved.output, moved.output
    fresh = CliRunner().invoke(main, [*base, *text])
    assert fresh.exit_code == 1 and "finished work of a stopped conversion" in fresh.output
    assert "--resume to continue it, or --remove-stale to start over" in fresh.output
    assert len(fresh.output.strip().splitlines()) == 1 and resume_folder(dst).exists()
    over = CliRunner().invoke(main, [*base, *text, "--remove-stale", "-q"])  # started over, from layer 0
    assert over.exit_code == 0 and "layer-0" not in over.output, over.output
    assert (dst / "model.safetensors").is_file() and not resume_folder(dst).exists()
    with pytest.raises(Mha2GqaError, match="resume: this conversion keeps no work to continue"):
        convert_checkpoint(setup["src"], tmp_path / "plain", 1, "mean", resume=True, progress=False)


def test_a_killed_process_resumes(setup, tmp_path):
    """A real SIGKILL mid-refit (the process gets no chance to clean up), then --resume."""
    dst = tmp_path / "out"
    options = ["-g", "1", "--method", "svd", "--calibration", str(setup["text"]), "--calibration-tokens", "1024"]
    options += ["--refit", "--refit-steps", "12", "-q"]
    args = [sys.executable, "-m", "mha2gqa.cli", "convert", str(setup["src"]), str(dst), *options]
    whole = tmp_path / "whole"  # the reference, made the same way (a process's thread count moves the last bit)
    subprocess.run([*args[:5], str(whole), *options], check=True, capture_output=True)
    first = resume_folder(dst) / "layer-0.json"
    killed_once(args, first.exists)
    assert not dst.exists() and first.exists()
    done = subprocess.run([*args, "--resume", "--remove-stale"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (dst / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
    assert not resume_folder(dst).exists() and not list(tmp_path.glob(".out.*"))


def test_another_conversion_into_a_killed_runs_dst_never_strands_its_kept_work(setup, tmp_path):
    """SIGKILL mid-refit, then another conversion (``--method mean``, which keeps no work) into the same
    DST: refused in one line while the kept work is there; with ``--remove-stale`` it publishes DST and
    nothing is left beside it; the killed run's ``--resume`` then refuses in one line (DST exists)."""
    dst = tmp_path / "out"
    refit = ["-g", "1", "--method", "svd", "--calibration", str(setup["text"]), "--calibration-tokens", "1024"]
    refit += ["--refit", "--refit-steps", "12", "-q"]
    args = [sys.executable, "-m", "mha2gqa.cli", "convert", str(setup["src"]), str(dst)]
    killed_once([*args, *refit], (resume_folder(dst) / "layer-0.json").exists)
    assert not dst.exists() and resume_folder(dst).exists()
    mean = ["convert", str(setup["src"]), str(dst), "-g", "1", "--method", "mean", "-q"]
    kept = CliRunner().invoke(main, mean)
    assert kept.exit_code == 1 and len(kept.output.strip().splitlines()) == 1, kept.output
    assert "finished work of a stopped conversion" in kept.output and not dst.exists()
    over = CliRunner().invoke(main, [*mean, "--remove-stale"])
    assert over.exit_code == 0, over.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # DST, and nothing beside it
    again = CliRunner().invoke(main, [*args[3:], *refit, "--resume"])
    assert again.exit_code != 0 and len(again.output.strip().splitlines()) == 1, again.output
    assert "exists" in again.output and "Traceback" not in again.output


def test_kept_work_that_was_damaged_is_refused_naming_the_file(setup, tmp_path, monkeypatch):
    import torch
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "out"
    _stopped(setup, dst, monkeypatch, 2)
    layer = resume_folder(dst) / "layer-1.safetensors"
    tensors = load_file(layer)
    first = next(iter(tensors))
    tensors[first] = torch.full_like(tensors[first], float("nan"))
    save_file(tensors, layer)
    with pytest.raises(Mha2GqaError, match=r"layer-1\.safetensors: holds NaN or infinite values"):
        convert_checkpoint(setup["src"], dst, 1, "svd", resume=True, **setup["kw"])
    (resume_folder(dst) / "layer-0.json").write_text('{"layer": "zero"}')
    with pytest.raises(Mha2GqaError, match=r"layer-0\.json"):
        convert_checkpoint(setup["src"], dst, 1, "svd", resume=True, **setup["kw"])
    layer.write_bytes(b"not safetensors")
    (resume_folder(dst) / "layer-0.json").unlink()  # layer 0 fitted again, layer 1 read back
    with pytest.raises(Mha2GqaError, match=r"layer-1\.safetensors: not the layer a stopped run wrote"):
        convert_checkpoint(setup["src"], dst, 1, "svd", resume=True, **setup["kw"])
    assert resume_folder(dst).exists()  # kept for the user to look at: --remove-stale starts over


def test_a_per_layer_auto_refit_resumes_though_the_allocation_rewrote_its_settings(setup, tmp_path, monkeypatch):
    """The fingerprint is of the run as asked (before ``--per-layer auto`` chose its counts): a
    budget the allocation meets with uniform counts rewrites the settings it ran with, not the ones
    a resumed run is checked against."""
    kw = {**setup["kw"], "per_layer": "auto", "kv_budget": 1.0, "method": "svd"}
    dst = tmp_path / "out"
    _stopped(setup, dst, monkeypatch, 1, None, per_layer="auto", kv_budget=1.0)
    out = convert_checkpoint(setup["src"], dst, None, resume=True, **kw)
    assert out.kv_heads_per_layer == [1, 1, 1, 1] and not resume_folder(dst).exists()


def _distill_run(setup, dst, resume: bool = False):
    from mha2gqa.convert.settings import ConvertSettings
    from mha2gqa.pipeline import Recipe, prepare
    from mha2gqa.pipeline.distill import DistillSettings

    s = ConvertSettings(num_kv_heads=1, method="svd", resume=resume, **setup["kw"])
    d = DistillSettings(distill=True, distill_steps=6)
    outcome = prepare(Recipe(s, d), str(setup["src"]), dst, log=lambda *_: None).run()
    return outcome.conversion, outcome.distillation


def _record(folder, name: str) -> dict:
    """A record file without what differs between any two runs (times, seconds)."""

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("created", "seconds", "step_seconds")}
        return [strip(v) for v in x] if isinstance(x, list) else x

    return strip(json.loads((folder / name).read_text()))


def test_a_distillation_stopped_after_a_checkpoint_resumes_to_the_uninterrupted_output(setup, tmp_path, monkeypatch):
    """``convert --refit --distill`` stopped (SIGTERM) inside the distillation keeps the fitted layers and
    the distillation's newest checkpoint; ``--resume`` reads the layers back, continues the distillation
    from that checkpoint and publishes the uninterrupted run's bytes and records."""
    import mha2gqa.uptrain.trainer as trainer
    from mha2gqa.core.records import UPTRAIN_RECORD
    from mha2gqa.core.signals import Terminated

    whole, dst = tmp_path / "whole", tmp_path / "out"
    _distill_run(setup, whole)
    step = trainer._Trainer.step

    def stopping(self, k):
        if k == 5:  # checkpoints every 2 of the 6 steps: the newest is step 4's
            raise Terminated(signal.SIGTERM)
        return step(self, k)

    with monkeypatch.context() as m:
        m.setattr(trainer._Trainer, "step", stopping)
        with pytest.raises(Terminated) as stopped:
            _distill_run(setup, dst)
    kept = resume_folder(dst)
    assert "--resume continues" in stopped.value.kept and str(kept) in stopped.value.kept
    assert not dst.exists() and (kept / "layer-3.json").is_file()
    assert [p.name for p in (kept / "distilled" / "checkpoints").iterdir()] == ["step-0000004"]
    steps, fitted = [], []
    monkeypatch.setattr(trainer._Trainer, "step", lambda self, k: steps.append(k) or step(self, k))
    monkeypatch.setattr(layerwise, "_refit_layer", lambda *a, **k: fitted.append(a[1].i) or _refit(*a, **k))
    _distill_run(setup, dst, resume=True)
    assert fitted == [] and steps == [5, 6]  # every layer read back; the distillation went on from step 4
    assert (dst / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
    resumed, straight = _record(dst, CONVERSION_RECORD), _record(whole, CONVERSION_RECORD)
    assert resumed["settings"].pop("resume") and not straight["settings"].pop("resume")  # the same but --resume
    assert resumed == straight
    resumed, straight = _record(dst, UPTRAIN_RECORD)["uptrain"], _record(whole, UPTRAIN_RECORD)["uptrain"]
    assert (resumed["settings"].pop("output"), straight["settings"].pop("output")) == ("./out", "./whole")
    assert resumed == straight
    assert not kept.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["out", "whole"]


def test_a_distillation_resume_refuses_other_distillation_settings(setup, tmp_path, monkeypatch):
    import mha2gqa.uptrain.trainer as trainer
    from mha2gqa.core.signals import Terminated

    dst = tmp_path / "out"
    with monkeypatch.context() as m:
        m.setattr(trainer._Trainer, "step", lambda self, k: (_ for _ in ()).throw(Terminated(signal.SIGTERM)))
        with pytest.raises(Terminated):
            _distill_run(setup, dst)
    base = ["convert", str(setup["src"]), str(dst), "-g", "1", "--method", "svd", "--refit", "--refit-steps", "12"]
    base += ["--calibration-tokens", "1024", "--calibration", str(setup["text"]), "--distill", "--resume"]
    other = CliRunner().invoke(main, [*base, "--distill-steps", "7"])
    assert other.exit_code == 1 and "--resume: the later stage changed since the stopped run" in other.output
    assert len(other.output.strip().splitlines()) == 1 and resume_folder(dst).exists()
    from mha2gqa.core.models import computes_bf16  # a machine of the other arithmetic (auto: bf16 or float32)

    monkeypatch.setattr("mha2gqa.core.models.computes_bf16", lambda device: not computes_bf16(device))
    elsewhere = CliRunner().invoke(main, base)
    assert elsewhere.exit_code == 1 and "--resume: the later stage changed" in elsewhere.output, elsewhere.output
    assert '{"arithmetic": ' in elsewhere.output and resume_folder(dst).exists()


def test_a_process_killed_inside_the_distillation_resumes(setup, tmp_path):
    """A real SIGKILL once the distillation has written a checkpoint, then the same command with --resume."""
    dst, whole = tmp_path / "out", tmp_path / "whole"
    options = ["-g", "1", "--method", "svd", "--calibration", str(setup["text"]), "--calibration-tokens", "1024"]
    options += ["--refit", "--refit-steps", "12", "--distill", "--distill-steps", "30", "-q"]
    args = [sys.executable, "-m", "mha2gqa.cli", "convert", str(setup["src"]), str(dst), *options]
    subprocess.run([*args[:5], str(whole), *options], check=True, capture_output=True)
    checkpoints = resume_folder(dst) / "distilled" / "checkpoints"
    killed_once(args, lambda: any(checkpoints.glob("step-*")))
    assert not dst.exists() and any(checkpoints.glob("step-*"))
    done = subprocess.run([*args, "--resume", "--remove-stale"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (dst / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
    assert not resume_folder(dst).exists() and not list(tmp_path.glob(".out.*"))


def test_a_full_disk_while_writing_keeps_the_fitted_layers_for_resume(setup, tmp_path, monkeypatch):
    """A full disk is the machine's state, not a decision of the run's: the one-line error says where
    the fitted layers are kept, and --resume (space freed) reads them back instead of fitting again."""
    import errno

    import mha2gqa.convert.write.shard_writer as writer

    dst = tmp_path / "out"

    def full(fd, t):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(writer, "_write_tensor", full)
        with pytest.raises(Mha2GqaError, match=r"disk full while writing .*; the finished work is kept in .*--resume"):
            convert_checkpoint(setup["src"], dst, 1, "svd", **setup["kw"])
    assert not dst.exists() and (resume_folder(dst) / "layer-3.json").is_file()  # every layer kept
    fitted: list[int] = []
    _refit = layerwise._refit_layer
    monkeypatch.setattr(layerwise, "_refit_layer", lambda *a, **k: fitted.append(a[1].i) or _refit(*a, **k))
    convert_checkpoint(setup["src"], dst, 1, "svd", **setup["kw"], resume=True)
    assert fitted == []
    assert (dst / "model.safetensors").read_bytes() == (setup["whole"].output / "model.safetensors").read_bytes()
    assert not resume_folder(dst).exists()
