"""``convert --distill``'s rate backoff: a distillation the stage guard finds no closer to SRC runs again
from the converted model at a third of the rate (then a ninth); one that helps is published as run (the
bytes of a run without the backoff); the tries in the record and the terminal; --resume goes on with
the try in progress."""

import json
import signal

import pytest
from click.testing import CliRunner
from conftest import llama_with_tokenizer, story_text

from mha2gqa.cli import main
from mha2gqa.core.records import CONVERSION_RECORD, UPTRAIN_RECORD
from mha2gqa.core.resume import resume_folder
from mha2gqa.pipeline.backoff import BACKOFF, BACKOFF_FILE, BEST_FILE
from mha2gqa.uptrain.checkpoints import CHECKPOINTS


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    root = tmp_path_factory.mktemp("backoff")
    text = story_text(root / "calib.txt", 400)
    return {"model": llama_with_tokenizer(root / "mha", text, max_positions=64), "text": text}


def _convert(src, dst, *more: str):
    args = ["convert", str(src["model"]), str(dst), "-g", "1", "--method", "mean", "-q", "--distill"]
    args += ["--calibration", str(src["text"]), "--calibration-tokens", "2048", "--calibration-seq-len", "32"]
    return CliRunner().invoke(main, [*args, "--distill-steps", "12", *more])


def _distill_stage(dst) -> dict:
    stages = json.loads((dst / CONVERSION_RECORD).read_text())["conversion"]["guard"]["stages"]
    return next(s for s in stages if s["stage"] == "distill")


def _score(figures: dict) -> str:
    from mha2gqa.core.conversion_record import GuardScore

    return str(GuardScore(figures["kl"], figures["top1"]))


def _model(dst) -> bytes:
    return (dst / "model.safetensors").read_bytes()


def _lr(dst) -> float:
    return json.loads((dst / UPTRAIN_RECORD).read_text())["uptrain"]["settings"]["lr"]


def _forced(monkeypatch, hurt: int = 3, finals: bool = False) -> list[str]:
    """The guard's first ``hurt`` scores of a distilled model (its checkpoints at steps 4 and 8, then the
    final one: a whole try; ``finals``: of final models alone) forced to KL 9 (a distillation that hurt);
    returns the list the scorings are counted in (``checkpoint`` or ``final``)."""
    from mha2gqa.convert.guard import GuardRun
    from mha2gqa.core.conversion_record import GuardScore

    score, calls = GuardRun.score_folder, []

    def first_hurts(self, folder, targets):
        calls.append("checkpoint" if CHECKPOINTS in folder.parts else "final")
        real = score(self, folder, targets)
        counted = [c for c in calls if c == "final"] if finals else calls
        return GuardScore(9.0, 0.0) if len(counted) <= hurt and calls[-1] in counted else real

    monkeypatch.setattr(GuardRun, "score_folder", first_hurts)
    return calls


def test_a_distillation_that_helps_is_published_as_run(src, tmp_path):
    """The rate as given lowers the held-out KL: nothing runs again, and the bytes are a run's without
    the backoff."""
    backing = _convert(src, tmp_path / "backing")
    assert backing.exit_code == 0, backing.output
    plain = _convert(src, tmp_path / "plain", "--no-distill-backoff")
    assert plain.exit_code == 0, plain.output
    for dst in ("backing", "plain"):
        stage = _distill_stage(tmp_path / dst)  # each checkpoint's KL; the final scored best
        detail = stage["detail"]
        assert stage["outcome"] == "kept" and detail.startswith("step 4: KL ") and ", step 12: KL " in detail
        assert "'s model" not in detail
    assert _model(tmp_path / "backing") == _model(tmp_path / "plain") and _lr(tmp_path / "backing") == 1.5e-3


def test_a_distillation_that_does_not_help_runs_again_at_a_third_of_the_rate(src, tmp_path, monkeypatch):
    """Where the guard finds the distilled model no closer to SRC, the distillation runs again from the
    converted model at a third of the rate; the published model is a plain run's at that rate, and the
    record and the terminal give both tries."""
    calls = _forced(monkeypatch)
    backed = _convert(src, tmp_path / "backed", "--distill-lr", "0.03")
    assert backed.exit_code == 0, backed.output
    # each try's checkpoints at steps 4 and 8 and its final model scored once (the published one's score
    # is the guard's distill figure)
    assert calls == ["checkpoint", "checkpoint", "final"] * 2
    stage = _distill_stage(tmp_path / "backed")
    assert stage["outcome"] == "kept" and stage["detail"].startswith("--distill-lr 0.03: KL 9, top-1 0.0%, not below")
    assert "(step 4: KL 9, step 8: KL 9, step 12: KL 9); " in stage["detail"]
    assert f"; --distill-lr 0.01: {_score(stage['after'])}, kept (step 4: KL " in stage["detail"]
    assert stage["detail"] in backed.output
    monkeypatch.undo()
    rate = 0.03 * BACKOFF[1]
    plain = _convert(src, tmp_path / "plain", "--distill-lr", repr(rate), "--no-distill-backoff")
    assert plain.exit_code == 0, plain.output
    assert _lr(tmp_path / "backed") == rate and _model(tmp_path / "backed") == _model(tmp_path / "plain")


def test_without_the_guard_there_is_no_backoff(src, tmp_path, monkeypatch):
    calls = _forced(monkeypatch)
    done = _convert(src, tmp_path / "dst", "--guard", "off")
    assert done.exit_code == 0, done.output
    assert _lr(tmp_path / "dst") == 1.5e-3 and calls == []


def test_a_run_stopped_in_a_later_try_resumes_it_and_refuses_a_damaged_record(src, tmp_path, monkeypatch):
    """Stopped inside the second try, --resume goes on with that try from its newest checkpoint (not the
    first try again), to the uninterrupted run's bytes; a damaged backoff record is refused in one line
    naming it."""
    import mha2gqa.uptrain.trainer as trainer
    from mha2gqa.core.signals import Terminated

    whole, dst = tmp_path / "whole", tmp_path / "dst"
    with monkeypatch.context() as m:
        _forced(m)
        assert _convert(src, whole).exit_code == 0
    step = trainer._Trainer.step
    with monkeypatch.context() as m:
        calls = _forced(m)

        def stopping(self, k):
            if k == 9 and len(calls) > 3:  # in the second try; checkpoints every 4 steps: the newest is step 8's
                raise Terminated(signal.SIGTERM)
            return step(self, k)

        m.setattr(trainer._Trainer, "step", stopping)
        assert _convert(src, dst).exit_code != 0
    kept = resume_folder(dst)
    record = (kept / BACKOFF_FILE).read_text()
    assert json.loads(record)["lr"] == 1.5e-3 * BACKOFF[1]
    (kept / BACKOFF_FILE).write_text('{"lr": 0.7}')
    bad = _convert(src, dst, "--resume")
    assert bad.exit_code == 1 and str(kept / BACKOFF_FILE) in bad.output and "--remove-stale" in bad.output
    assert len(bad.output.strip().splitlines()) == 1 and kept.exists()
    (kept / BACKOFF_FILE).write_text(record)
    scores = (kept / BEST_FILE).read_text()
    assert json.loads(scores)["scored"] == 8  # the second try's checkpoints, scored before the stop
    (kept / BEST_FILE).write_text('{"scored": 4, "step": 8, "kl": 0.1, "top1": 0.5}')
    bad = _convert(src, dst, "--resume")
    assert bad.exit_code == 1 and str(kept / BEST_FILE) in bad.output and len(bad.output.strip().splitlines()) == 1
    (kept / BEST_FILE).write_text(scores)
    steps = []
    monkeypatch.setattr(trainer._Trainer, "step", lambda self, k: steps.append(k) or step(self, k))
    done = _convert(src, dst, "--resume")
    assert done.exit_code == 0, done.output
    assert steps == [9, 10, 11, 12]  # the second try went on; the first did not run again
    assert _distill_stage(dst)["detail"] == _distill_stage(whole)["detail"] != ""
    assert _model(dst) == _model(whole)


def test_a_rescaled_model_distils_to_the_same_quality(src, tmp_path):
    """The same function written differently (v x 4 with o / 4, q with k, a norm with what it feeds)
    takes the same relative steps: the distillation reaches the same held-out KL at the same rate."""
    from conftest import load, save
    from test_guard import _rescaled
    from transformers import AutoTokenizer

    model = load(src["model"])
    _rescaled(model)
    rescaled = {**src, "model": save(model, tmp_path / "rescaled")}
    AutoTokenizer.from_pretrained(src["model"]).save_pretrained(rescaled["model"])
    for source, name in ((src, "a"), (rescaled, "b")):
        done = _convert(source, tmp_path / name)
        assert done.exit_code == 0, done.output
    a, b = _distill_stage(tmp_path / "a"), _distill_stage(tmp_path / "b")
    assert _lr(tmp_path / "a") == _lr(tmp_path / "b") and a["outcome"] == b["outcome"] == "kept"
    assert b["after"]["kl"] == pytest.approx(a["after"]["kl"], rel=0.02), (a, b)


def test_a_distillation_that_passed_its_best_is_published_at_the_best_checkpoint(src, tmp_path, monkeypatch):
    """The final model scoring worse than an earlier checkpoint (forced), the checkpoint's model is
    published: the weights of a run of that many steps, its record at that step, and the guard's line
    says which step and why; the checkpoints are not published."""
    from safetensors.torch import load_file

    calls = _forced(monkeypatch, hurt=1, finals=True)
    early = _convert(src, tmp_path / "early")
    assert early.exit_code == 0, early.output
    assert calls == ["checkpoint", "checkpoint", "final", "final"]  # the chosen checkpoint scored as published
    stage = _distill_stage(tmp_path / "early")
    assert stage["outcome"] == "kept" and stage["detail"].startswith("step 4: KL ")
    assert ", step 12: KL 9, so step " in stage["detail"]
    step = int(stage["detail"].split(", so step ")[1].split("'")[0])
    record = json.loads((tmp_path / "early" / UPTRAIN_RECORD).read_text())["uptrain"]
    assert step in (4, 8) and record["steps"] == step and f"uptrain done: {step} steps" in early.output
    monkeypatch.undo()
    short = _convert(src, tmp_path / "short", "--distill-steps", str(step))
    assert short.exit_code == 0 and "'s model" not in _distill_stage(tmp_path / "short")["detail"], short.output
    published, run = (
        load_file(tmp_path / "early" / "model.safetensors"),
        load_file(tmp_path / "short" / "model.safetensors"),
    )
    assert published.keys() == run.keys() and all(published[k].equal(run[k]) for k in run)
    assert not any(p.suffix in (".bin", ".pkl") for p in (tmp_path / "early").iterdir())
