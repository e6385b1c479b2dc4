"""Every file the tool reads back, structurally damaged at random (hypothesis): a reader either accepts
it or refuses it with one line (:class:`Mha2GqaError`) naming the file; never another exception.

Formats: eval results (and the terminal summary and report tables over what it accepts), the reference
cache manifest, the conversion record, an uptraining log, a bench file, a model config, a
safetensors header, and the self-text cache's manifest and part records. ``MHA2GQA_FUZZ_EXAMPLES`` sets
the examples per reader (CI: 150).
"""

import copy
import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import pytest
from conftest import random_model, save, tiny_config

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mha2gqa.core.errors import Mha2GqaError  # noqa: E402

EXAMPLES = int(os.environ.get("MHA2GQA_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

#: What a damaged value may become.
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(),
                                                                              max_size=2),
)  # fmt: skip


def _paths(doc: Any, here: tuple = ()) -> list[tuple]:
    """Every path into ``doc`` (dict keys and list indices)."""
    out = [here]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*here, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:4]):
            out += _paths(v, (*here, i))
    return out


@st.composite
def damaged(draw, doc: Any) -> Any:
    """``doc`` with one to three random structural edits: a value replaced, a key dropped, a list
    emptied or a key added."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["replace", "drop", "empty", "add"]))
        if not path:
            if action == "replace":
                doc = draw(JUNK)
            continue
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        last = path[-1]
        if action == "replace":
            parent[last] = draw(JUNK)
        elif action == "drop" and isinstance(parent, dict):
            parent.pop(last, None)
        elif action == "empty":
            parent[last] = type(parent[last])() if isinstance(parent[last], list | dict) else None
        elif action == "add" and isinstance(parent[last], dict):
            parent[last][draw(st.text(max_size=6))] = draw(JUNK)
    return doc


def _write(path: Path, doc: Any) -> Path:
    path.write_text(json.dumps(doc, allow_nan=True), encoding="utf-8")
    return path


def _refused_or_read(fn, path: Path, names: bool = True) -> None:
    """``fn()`` returns, or raises a one-line :class:`Mha2GqaError`, naming ``path`` (its folder or
    name) unless ``names`` is False (a value that reads well but does not fit, e.g. a bench of another
    model, is refused by what it means, naming the option)."""
    try:
        fn()
    except Mha2GqaError as e:
        message = str(e)
        assert "\n" not in message, message
        assert not names or path.name in message or str(path.parent) in message, message


# -- valid documents, made once -------------------------------------------------------------------
@pytest.fixture(scope="module")
def evaluated(pair, tmp_path_factory):
    """A results dict with every section (attention, samples, gates, verdict, quantization) and its
    reference cache entry's manifest."""
    from mha2gqa.eval.gates import GateSettings
    from mha2gqa.eval.outcome import EvalRequest
    from mha2gqa.eval.settings import EvalSettings

    src, conv, text = pair
    root = tmp_path_factory.mktemp("fuzz")
    s = EvalSettings(data=str(text), seq_len=64, max_tokens=600, samples=1, sample_tokens=4, progress=False,
                     reference_cache=str(root / "cache"), compare_quantization=("int8",))  # fmt: skip
    EvalRequest(str(src), str(conv), s, GateSettings(max_kl=10.0), output=root / "r.json").prepare().run()
    (entry,) = [p for p in (root / "cache").iterdir() if p.is_dir()]
    manifest = json.loads((entry / "mha2gqa_reference.json").read_text())
    return json.loads((root / "r.json").read_text()), entry, manifest


@given(data=st.data())
@FUZZ
def test_results(evaluated, tmp_path_factory, data):
    from mha2gqa.eval.results import Results
    from mha2gqa.eval.summary import summary_lines
    from mha2gqa.eval.tables import overview_table, tables

    doc = data.draw(damaged(evaluated[0]))
    path = _write(tmp_path_factory.mktemp("r") / "r.json", doc)

    def read_and_show():
        r = Results.load(path)
        summary_lines(r)
        tables(r)
        overview_table([r])
        r.judge()

    _refused_or_read(read_and_show, path)


@given(data=st.data())
@FUZZ
def test_reference_manifest(evaluated, data):
    from mha2gqa.eval.reference import REFERENCE_RECORD, find

    _, entry, manifest = evaluated
    doc = data.draw(damaged(manifest))
    path = entry / REFERENCE_RECORD
    _write(path, doc)
    try:
        _refused_or_read(lambda: find(entry.parent, entry.name), path)
    finally:
        _write(path, manifest)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from mha2gqa.convert import convert_checkpoint
    from mha2gqa.core.records import CONVERSION_RECORD

    root = tmp_path_factory.mktemp("conv")
    save(random_model(tiny_config("llama")), root / "src")
    out = convert_checkpoint(root / "src", root / "out", 2, progress=False).output
    return out, json.loads((out / CONVERSION_RECORD).read_text())


@given(data=st.data())
@FUZZ
def test_conversion_record(converted, data):
    from mha2gqa.core.conversion_record import read_conversion_record
    from mha2gqa.core.records import CONVERSION_RECORD

    folder, record = converted
    path = folder / CONVERSION_RECORD
    _write(path, data.draw(damaged(record)))
    try:
        _refused_or_read(lambda: read_conversion_record(folder), path)
    finally:
        _write(path, record)


RUN_LOG = [
    {"type": "start", "created": "2026-11-26T00:00:00+00:00", "student": "s", "teacher": "t",
     "settings": {"objective": "kd", "train": "all", "max_steps": 4}, "windows": 16, "tokens_per_step": 64,
     "total_steps": 4, "trainable_parameters": 100, "parameters": 100, "num_heads": 4, "num_kv_heads": 2,
     "processes": 1, "device": "cpu", "mixed_precision": "no", "eval_seq_len": 32},
    {"type": "eval", "step": 0, "tokens": 0, "nll": 2.64, "ppl": 14.0, "teacher_ppl": 10.0, "ppl_ratio": 1.4,
     "kl_mean": 0.4, "eval_tokens": 512},
    {"type": "train", "step": 2, "tokens": 128, "epoch": 0.5, "loss": 2.0, "kd": 2.0, "lr": 1e-3,
     "grad_norm": 1.5, "tokens_per_second": 900.0},
    {"type": "eval", "step": 4, "tokens": 256, "nll": 2.34, "ppl": 10.4, "teacher_ppl": 10.0, "ppl_ratio": 1.04,
     "kl_mean": 0.04, "eval_tokens": 512},
]  # fmt: skip


@given(data=st.data())
@FUZZ
def test_uptraining_log(tmp_path_factory, data):
    from mha2gqa.eval.report import load_runs
    from mha2gqa.eval.tables import overview_table, recovery_table

    records = data.draw(damaged(RUN_LOG))
    path = tmp_path_factory.mktemp("run") / "uptrain_log.jsonl"
    lines = [json.dumps(r, allow_nan=True) for r in records] if isinstance(records, list) else [json.dumps(records)]
    path.write_text("\n".join(lines) + "\n")

    def read_and_show():
        runs = load_runs([path])
        recovery_table(runs)
        overview_table([], runs)

    _refused_or_read(read_and_show, path)


BENCH = {
    "schema": "mha2gqa.bench/1",
    "settings": {"prompt_len": 32, "new_tokens": 8, "batch_size": 1, "device": "cpu"},
    "models": {"original": {"num_kv_heads": 4, "parameters": 1000, "decode_tokens_per_second": {"median": 50.0}},
               "converted": {"num_kv_heads": 2, "parameters": 900, "decode_tokens_per_second": {"median": 60.0}}},
}  # fmt: skip


@given(data=st.data())
@FUZZ
def test_bench_file(tmp_path_factory, data):
    from mha2gqa.core.records import BENCH_SCHEMA
    from mha2gqa.serving.capacity import plan_capacity
    from mha2gqa.serving.sizing import PlanSettings

    root = tmp_path_factory.mktemp("bench")
    save(random_model(tiny_config("llama")), root / "m") if not (root / "m").exists() else None
    path = _write(root / "b.json", data.draw(damaged({**BENCH, "schema": BENCH_SCHEMA})))

    def read_and_compare():
        plan_capacity(str(root / "m"), PlanSettings(gpu="h100-sxm"), bench_path=path)

    _refused_or_read(read_and_compare, path, names=False)


@given(data=st.data())
@FUZZ
def test_model_config(tmp_path_factory, data):
    from mha2gqa.core.architecture import resolve
    from mha2gqa.core.checkpoint import read_config
    from mha2gqa.serving.capacity import plan_capacity
    from mha2gqa.serving.sizing import PlanSettings

    base = tiny_config("llama").to_dict()
    base = {k: v for k, v in base.items() if isinstance(v, int | float | str | bool | list | dict | type(None))}
    folder = tmp_path_factory.mktemp("cfg")
    path = _write(folder / "config.json", data.draw(damaged(base)))

    def read_and_plan():
        resolve(read_config(folder))
        plan_capacity(str(folder), PlanSettings(gpu_memory="1GB"))

    _refused_or_read(read_and_plan, path, names=False)


@given(data=st.data())
@FUZZ
def test_safetensors_header(tmp_path_factory, data):
    from mha2gqa.core.safetensors_io import read_shard_index

    header = {"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
              "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]}}  # fmt: skip
    doc = data.draw(damaged(header))
    raw = json.dumps(doc, allow_nan=True).encode()
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 32)
    _refused_or_read(lambda: read_shard_index([path]), path)


@pytest.fixture(scope="module")
def self_written(tmp_path_factory):
    """A finished self-text entry of a tiny Llama, and its manifest and first part's record."""
    from conftest import llama_with_tokenizer, story_text

    from mha2gqa.core.self_text import MANIFEST, SelfTextSettings, self_text

    root = tmp_path_factory.mktemp("self-text")
    model = llama_with_tokenizer(root / "m", story_text(root / "t.txt"))
    s = SelfTextSettings(tokens=60, document_tokens=16, batch_size=2, device="cpu")
    entry = self_text(str(model), s, root / "cache").path.parent
    return (
        str(model),
        s,
        entry,
        json.loads((entry / MANIFEST).read_text()),
        json.loads((entry / "part-000000.json").read_text()),
    )


@given(data=st.data())
@FUZZ
def test_self_text_records(self_written, data):
    from mha2gqa.core.self_text import MANIFEST, self_text

    model, s, entry, manifest, part = self_written
    which = data.draw(st.sampled_from([MANIFEST, "part-000000.json"]))
    doc = data.draw(damaged(manifest if which == MANIFEST else part))
    path = entry / which
    _write(path, doc)
    moved = entry / (MANIFEST + ".kept")
    if which != MANIFEST:  # a part's record is read while the entry is unfinished
        (entry / MANIFEST).rename(moved)
    try:
        _refused_or_read(lambda: self_text(model, s, entry.parent), path)
    finally:
        if moved.exists():
            (entry / MANIFEST).unlink(missing_ok=True)
            moved.rename(entry / MANIFEST)
        _write(entry / "part-000000.json", part)
        _write(entry / MANIFEST, manifest)


def test_the_damage_strategy_changes_documents():
    """The fuzzing is not vacuous: damaged documents differ from the original."""
    from hypothesis import find

    changed = find(damaged(RUN_LOG), lambda d: d != RUN_LOG, settings=settings(database=None))
    assert changed != RUN_LOG and not math.isnan(0.0)
