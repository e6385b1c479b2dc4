"""Uptraining at scale: FSDP over 2 gloo processes follows the one-process run (cross-entropy, KD,
LoRA, fused K/V-only training) and resumes exactly; the streamed token store gives the in-memory
windows; distillation from a full-vocabulary teacher cache equals live distillation; damaged stores
and caches are refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import llama_with_tokenizer, story_text
from safetensors.torch import load_file
from test_distributed import run_ok

from mha2gqa.cli import main
from mha2gqa.convert import convert_checkpoint
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.text import TextSource
from mha2gqa.uptrain import UptrainSettings, uptrain
from mha2gqa.uptrain.data import WindowOrder, pack_windows
from mha2gqa.uptrain.tokens import stream_ids, token_store


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny MHA Llama with a tokenizer, its 2-KV-head conversion, and text."""
    root = tmp_path_factory.mktemp("scale")
    text = story_text(root / "t.txt", 400)
    parent = llama_with_tokenizer(root / "mha", text)
    student = convert_checkpoint(parent, root / "g2", 2, progress=False).output
    return {"root": root, "text": text, "parent": parent, "student": student, "cache": root / "cache"}


def _argv(run, out: Path, *extra: str) -> list[str]:
    args = ["uptrain", run["student"], "--data", run["text"], "--output", out, "--data-cache", run["cache"]]
    args += ["--seq-len", "32", "--batch-size", "4", "--max-steps", "6", "--lr", "3e-3", "--device", "cpu", "-q"]
    args += ["--mixed-precision", "no"]  # float32 on every machine: one and two processes agree to rounding
    return [str(a) for a in (*args, *extra)]


def _one(argv: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "mha2gqa.cli", *argv], check=True, capture_output=True)


def _two(argv: list[str]) -> str:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    return run_ok([*torchrun, "-m", "mha2gqa.cli", *argv])  # standalone: a free port of its own


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> float:
    assert a.keys() == b.keys()
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert worst <= atol, worst
    return worst


# ---- FSDP ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("objective", ["ce", "kd"])
def test_fsdp_on_two_processes_follows_one_process(run, tmp_path, objective):
    """Parameters, gradients and AdamW state sharded over 2 gloo processes, each reading half of every
    global batch: the same weights as one process (float noise), and a stock checkpoint."""
    extra = ("--objective", objective, "--teacher", str(run["parent"])) if objective == "kd" else ()
    if objective == "kd":  # 15 held-out windows: the ranks score 8 and 7 (+ one with nothing scored)
        extra += ("--eval-data", str(run["text"]), "--eval-tokens", "500", "--eval-every", "3")
    _one(_argv(run, tmp_path / "one", *extra))
    summary = _two(_argv(run, tmp_path / "fsdp", *extra, "--sharding", "fsdp"))
    assert "on 2 processes (FSDP: sharded)" in summary  # the summary says how it ran
    one, fsdp, start = _weights(tmp_path / "one"), _weights(tmp_path / "fsdp"), _weights(run["student"])
    _close(one, fsdp, 1e-5)
    evals = [
        [json.loads(x) for x in (tmp_path / d / "uptrain_log.jsonl").read_text().splitlines() if '"eval"' in x]
        for d in ("one", "fsdp")
    ]
    assert len(evals[0]) == len(evals[1]) == (3 if objective == "kd" else 0)
    for a, b in zip(*evals, strict=True):
        assert a["eval_tokens"] == b["eval_tokens"] and a["ppl"] == pytest.approx(b["ppl"], rel=1e-5)
        assert a["kl_mean"] == pytest.approx(b["kl_mean"], rel=1e-4, abs=1e-7)
    assert any(not torch.equal(fsdp[k], start[k]) for k in start)  # it trained
    log = [json.loads(line) for line in (tmp_path / "fsdp" / "uptrain_log.jsonl").read_text().splitlines()]
    train = [r for r in log if r["type"] == "train"]
    assert train and all(len(r["peak_memory_mib"]) == 2 and r["step_seconds"] > 0 for r in train)
    assert log[0]["processes"] == 2 and (tmp_path / "fsdp" / "config.json").is_file()


def test_fsdp_resumed_run_continues_the_identical_trajectory(run, tmp_path):
    argv = _argv(run, tmp_path / "whole", "--sharding", "fsdp", "--save-every", "3")
    _two(argv)
    part = _argv(run, tmp_path / "parts", "--sharding", "fsdp", "--save-every", "3")
    _two([*part, "--stop-after", "3"])
    assert not (tmp_path / "parts" / "config.json").exists()
    assert (tmp_path / "parts" / "checkpoints" / "step-0000003" / "optimizer").is_dir()  # each rank's shard
    _two([*part, "--resume"])
    _close(_weights(tmp_path / "whole"), _weights(tmp_path / "parts"), 0.0)


def test_fsdp_lora_merges_like_one_process(run, tmp_path):
    extra = ("--lora-rank", "4", "--train", "attention")
    _one(_argv(run, tmp_path / "one", *extra))
    _two(_argv(run, tmp_path / "fsdp", *extra, "--sharding", "fsdp"))
    _close(_weights(tmp_path / "one"), _weights(tmp_path / "fsdp"), 1e-6)


def test_fsdp_trains_kv_rows_of_a_fused_projection_and_leaves_query_rows_exact(run, tiny_checkpoint, tmp_path):
    """Phi-3's stacked ``[q; k; v]``: each process zeroes the query rows of its own shard's gradient."""
    from transformers import AutoTokenizer

    from mha2gqa.core.architecture import dims_of
    from mha2gqa.core.families import families

    src = tiny_checkpoint("phi3", vocab_size=300)
    student = convert_checkpoint(src, tmp_path / "gqa", 2, "mean", progress=False).output
    AutoTokenizer.from_pretrained(run["parent"]).save_pretrained(student)
    argv = _argv({**run, "student": student}, tmp_path / "fsdp", "--train", "kv", "--sharding", "fsdp")
    _two(argv)
    before, after = _weights(student), _weights(tmp_path / "fsdp")
    dims = dims_of(json.loads((student / "config.json").read_text()))
    q_rows = torch.tensor(families()["phi3"].q_rows(dims.num_heads, dims.num_kv_heads, dims.head_dim))
    fused = [n for n in before if "qkv_proj" in n]
    assert fused and all(torch.equal(after[n][q_rows], before[n][q_rows]) for n in fused)
    assert all(not torch.equal(after[n], before[n]) for n in fused)  # the K/V rows trained
    assert all(torch.equal(after[n], before[n]) for n in before if "qkv_proj" not in n)


def test_sharding_needs_a_process_group_and_offload_needs_sharding(run, tmp_path):
    res = CliRunner().invoke(main, _argv(run, tmp_path / "x", "--sharding", "fsdp"))
    assert res.exit_code == 1 and "torchrun" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(main, _argv(run, tmp_path / "y", "--cpu-offload"))
    assert res.exit_code == 1 and "--cpu-offload" in res.output and "--sharding fsdp" in res.output


# ---- streamed data ------------------------------------------------------------------------------
def test_streamed_windows_equal_the_in_memory_ones(run, tmp_path, monkeypatch):
    """Shards far smaller than a window (so windows cross files) and documents cut into pieces: every
    step's windows, for every rank's slice, equal those packed from the whole stream in memory."""
    from transformers import AutoTokenizer

    import mha2gqa.core.text as text_module

    monkeypatch.setattr(text_module, "PIECE_CHARS", 200)  # a document is tokenized in pieces
    tok = AutoTokenizer.from_pretrained(run["parent"])
    store = token_store(tmp_path / "c", tok, run["parent"], TextSource(str(run["text"])), shard_tokens=37)
    assert len(store.shards) > 10
    ids = stream_ids(tok, str(run["text"]))
    assert store.total == ids.numel() and torch.equal(store.windows(torch.arange(3), 16), pack_windows(ids, 16)[:3])
    for seq_len, seed in ((16, 0), (33, 7)):
        reference = pack_windows(ids, seq_len)
        order = WindowOrder(store.num_windows(seq_len), 8, seed)
        assert store.num_windows(seq_len) == len(reference)
        for step in range(0, 40, 3):  # across epochs
            batch = order.batch(step)
            for rank in range(2):
                mine = batch[rank * 4 : (rank + 1) * 4]
                assert torch.equal(store.windows(mine, seq_len), reference[mine])
    again = token_store(tmp_path / "c", tok, run["parent"], TextSource(str(run["text"])), shard_tokens=37)
    assert again.folder == store.folder and len(list((tmp_path / "c").iterdir())) == 2  # entry + its lock


def test_damaged_token_store_is_refused(run, tmp_path):
    from transformers import AutoTokenizer

    from mha2gqa.uptrain.tokens import TokenStore

    tok = AutoTokenizer.from_pretrained(run["parent"])
    store = token_store(tmp_path / "c", tok, run["parent"], TextSource(str(run["text"])), shard_tokens=1000)
    shard = store.folder / store.shards[0][0]
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(Mha2GqaError, match=r"token cache .*tokens-00000\.bin: its checksum") as e:
        TokenStore.open(store.folder).windows(torch.tensor([0]), 16)
    assert "\n" not in str(e.value) and "remove" in str(e.value)
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(Mha2GqaError, match="truncated"):
        TokenStore.open(store.folder)
    (store.folder / "manifest.json").write_text("{not json")
    with pytest.raises(Mha2GqaError, match=r"manifest\.json: not readable"):
        TokenStore.open(store.folder)


# ---- distillation from a cached teacher ---------------------------------------------------------
def _kd(run, out: Path, **kw) -> UptrainSettings:
    base = dict(data=str(run["text"]), output=str(out), seq_len=32, batch_size=4, lr=3e-3, max_steps=6,
                objective="kd", teacher=str(run["parent"]), data_cache=str(run["cache"]),
                teacher_cache=str(run["root"] / "teacher"), temperature=2.0, progress=False,
                mixed_precision="no")  # fmt: skip
    return UptrainSettings(**{**base, **kw})


def test_kd_from_a_full_vocabulary_cache_equals_live_kd(run, tmp_path):
    lines: list[str] = []
    uptrain(str(run["student"]), _kd(run, tmp_path / "live"), log=lines.append)
    uptrain(str(run["student"]), _kd(run, tmp_path / "cached", teacher_top_k=10**6), log=lines.append)
    assert any("teacher pass" in line for line in lines)
    live, cached = _weights(tmp_path / "live"), _weights(tmp_path / "cached")
    _close(live, cached, 1e-5)
    small = uptrain(str(run["student"]), _kd(run, tmp_path / "k8", teacher_top_k=8), log=lines.append)
    assert small.complete  # a top-8 cache is another (lower-bound) objective: it trains, differently
    assert _close(live, _weights(tmp_path / "k8"), 1.0) > 1e-4


def test_a_teacher_pass_runs_once_and_a_damaged_cache_is_refused(run, tmp_path):
    lines: list[str] = []
    done = uptrain(str(run["student"]), _kd(run, tmp_path / "x", teacher_top_k=16, teacher_only=True), log=lines.append)
    assert done.teacher_cache is not None and not (tmp_path / "x").exists()  # only the cache was written
    assert "teacher pass done" in done.summary()
    lines.clear()
    uptrain(str(run["student"]), _kd(run, tmp_path / "y", teacher_top_k=16), log=lines.append)
    assert not any("teacher pass" in line for line in lines)  # reused, the teacher never loaded
    uptrain(str(run["student"]), _kd(run, tmp_path / "y4", teacher_top_k=16, max_steps=4), log=lines.append)
    assert not any("teacher pass" in line for line in lines)  # a shorter run reads the first steps
    uptrain(str(run["student"]), _kd(run, tmp_path / "y8", teacher_top_k=16, max_steps=8), log=lines.append)
    assert any("teacher pass" in line for line in lines)  # a longer one computes the steps it lacks
    (done.teacher_cache / "chunk-000000-steps-8-part-0-of-1.safetensors").unlink()
    chunk = sorted(done.teacher_cache.glob("chunk-*.safetensors"))[0]
    data = bytearray(chunk.read_bytes())
    data[-5] ^= 1
    chunk.write_bytes(bytes(data))
    damaged = r"teacher cache .*chunk-000000-steps-6-part-0-of-1\.safetensors: its content"
    with pytest.raises(Mha2GqaError, match=damaged) as e:
        uptrain(str(run["student"]), _kd(run, tmp_path / "z", teacher_top_k=16), log=lines.append)
    assert "\n" not in str(e.value)
    res = CliRunner().invoke(main, _argv(run, tmp_path / "w", "--teacher-only"))
    assert res.exit_code == 1 and "--teacher-top-k" in res.output


def test_training_waits_for_the_chunk_a_concurrent_teacher_pass_is_writing(tmp_path):
    """A teacher pass running ahead (``--teacher-only``) publishes chunk by chunk; training reads a
    chunk once it lands, and without a running pass a missing chunk is one line."""
    import threading

    from mha2gqa.uptrain.teacher_cache import CachedTeacher, TeacherCache

    settings = {"top_k": 2, "vocab_size": 10, "seq_len": 3, "batch_size": 2, "chunk_steps": 2, "temperature": 1.0}
    cache = TeacherCache.create(tmp_path, {"material": 1}, settings)
    part = {"values": torch.zeros(2, 2, 3, 2), "indices": torch.arange(24, dtype=torch.int32).reshape(2, 2, 3, 2) % 10,
            "rest": torch.zeros(2, 2, 3)}  # fmt: skip
    running = threading.Event()
    running.set()

    def publish() -> None:
        cache.write_part(0, 0, 1, part)
        running.clear()

    threading.Timer(1.0, publish).start()
    got = CachedTeacher(cache, 4, running.is_set).targets(1, slice(0, 2))  # step 1: chunk 0, its 2nd step
    assert torch.equal(got["indices"], part["indices"][1])
    with pytest.raises(Mha2GqaError, match=r"chunk-000001: this chunk is missing"):
        CachedTeacher(cache, 4, running.is_set).targets(2, slice(0, 2))

    def ended_meanwhile() -> bool:  # the pass publishes chunk 1 and ends between the reader's look and its question
        cache.write_part(1, 0, 1, part)
        return False

    got = CachedTeacher(cache, 4, ended_meanwhile).targets(2, slice(0, 2))  # read, not refused
    assert torch.equal(got["indices"], part["indices"][0])


@pytest.mark.parametrize("budget", [None, 0, 1100])
def test_a_teacher_pass_computes_a_window_it_reads_again_once(budget):
    """Two epochs of 5 windows, 2 a step: each window's top-K form is computed once (within the
    budget; with none, again each time it is read) and is what computing that step anew gives."""
    from conftest import random_model, tiny_config

    from mha2gqa.uptrain.teacher_cache import FIELDS, Seen, StepWindows, teacher_part

    teacher = random_model(tiny_config("llama"), seed=1)
    tokens = torch.randint(3, 96, (5, 9), generator=torch.Generator().manual_seed(0))
    asked: list[int] = []
    windows = StepWindows(lambda step: [], lambda ids: (asked.extend(ids), tokens[ids])[1])
    seen = Seen() if budget is None else Seen(budget)
    for ids in ([0, 1], [2, 3], [4, 0], [1, 2], [3, 4]):
        got = seen.step(teacher, ids, windows, {"top_k": 8, "temperature": 2.0}, 2)
        direct = teacher_part(teacher, tokens[ids], 8, 2.0, 2)
        for k in FIELDS:
            torch.testing.assert_close(got[k], direct[k], atol=1e-5, rtol=1e-5)
    one = 8 * (8 * 4 + 8 * 4 + 4)  # a window: 8 positions of 8 values, 8 indices and a rest, 4 bytes each
    kept = 5 if budget is None else min(5, budget // one)
    assert seen.computed == len(asked) == 5 + 5 - kept and sorted(asked[:5]) == [0, 1, 2, 3, 4] and seen.read == 10
    assert seen.bytes == kept * one <= (budget if budget is not None else seen.budget)


def test_a_tampered_teacher_cache_manifest_is_refused(tmp_path):
    from mha2gqa.uptrain.teacher_cache import MANIFEST, TeacherCache

    settings = {"top_k": 2, "vocab_size": 10, "seq_len": 3, "batch_size": 2, "chunk_steps": 2, "temperature": 1.0}
    cache = TeacherCache.create(tmp_path, {"material": 1}, settings)
    manifest = json.loads((cache.folder / MANIFEST).read_text())
    for key, value in (("temperature", "hot"), ("temperature", float("nan")), ("chunk_steps", 0), ("top_k", True)):
        (cache.folder / MANIFEST).write_text(json.dumps({**manifest, "settings": {**settings, key: value}}))
        with pytest.raises(Mha2GqaError, match="not a teacher cache of this entry") as e:
            TeacherCache.open(cache.folder, cache.folder.name)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize(("field", "value"), [("values", float("nan")), ("values", 0.5), ("rest", float("nan"))])
def test_a_teacher_chunk_holding_no_log_probabilities_is_refused_naming_it(field, value, tmp_path):
    """A chunk whose checksum matches (recomputed by whoever edited it) but which holds a NaN or a
    positive log-probability: the line names the chunk and the cache, not the learning rate."""
    from mha2gqa.uptrain.teacher_cache import CachedTeacher, TeacherCache

    settings = {"top_k": 2, "vocab_size": 10, "seq_len": 3, "batch_size": 2, "chunk_steps": 2, "temperature": 1.0}
    cache = TeacherCache.create(tmp_path, {"material": 1}, settings)
    part = {"values": -torch.ones(2, 2, 3, 2), "indices": torch.zeros(2, 2, 3, 2, dtype=torch.int32),
            "rest": -torch.ones(2, 2, 3)}  # fmt: skip
    part[field].view(-1)[3] = value
    cache.write_part(0, 0, 1, part)
    pattern = r"teacher cache .*chunk-000000-steps-2-part-0-of-1\.safetensors: it holds values that are not log-prob"
    with pytest.raises(Mha2GqaError, match=pattern) as e:
        CachedTeacher(cache, 2, lambda: False).targets(0, slice(0, 2))
    assert "--lr" not in str(e.value) and "\n" not in str(e.value)


def test_a_token_store_whose_ids_exceed_the_models_vocabulary_is_refused(run, tmp_path):
    """A store whose checksums match but whose ids are beyond the model's vocabulary (forged, or
    written for another tokenizer): one line naming the shard, never an IndexError in the embedding."""
    import hashlib
    import json

    import numpy as np
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run["parent"])
    store = token_store(tmp_path / "c", tok, run["parent"], TextSource(str(run["text"])), shard_tokens=1000)
    shard = store.folder / store.shards[0][0]
    ids = np.fromfile(shard, dtype=store.dtype)
    ids[5] = 60000
    ids.tofile(shard)
    manifest = json.loads((store.folder / "manifest.json").read_text())
    manifest["shards"][0][2] = hashlib.sha256(shard.read_bytes()).hexdigest()
    (store.folder / "manifest.json").write_text(json.dumps(manifest))
    again = token_store(tmp_path / "c", tok, run["parent"], TextSource(str(run["text"])), vocab_size=len(tok))
    with pytest.raises(Mha2GqaError, match=r"tokens-00000\.bin: it holds token id 60000, outside the model's vocab"):
        again.windows(torch.tensor([0]), 16)
    out = CliRunner().invoke(main, _argv(run, tmp_path / "w", "--data-cache", str(tmp_path / "c")))
    assert out.exit_code == 1 and "outside the model's vocabulary" in out.output and "Traceback" not in out.output
    assert len(out.output.strip().splitlines()) == 1, out.output
