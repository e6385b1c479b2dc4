"""``final_from_checkpoint``: an earlier checkpoint published as a run's final model, as ``save_final``
would have written it: floating weights cast to the source's dtype (integers as they are), the config
and the shard index saying so, the run state (optimizer, scheduler, RNG) left out, the run's log kept."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.records import UPTRAIN_LOG
from mha2gqa.uptrain.checkpoints import STATE_NAME, final_from_checkpoint


def test_a_checkpoint_becomes_the_final_model_in_the_sources_dtype(tmp_path):
    ckpt, out = tmp_path / "checkpoints" / "step-0000008", tmp_path / "out"
    ckpt.mkdir(parents=True)
    out.mkdir()
    a, b, ids = torch.randn(3, 5), torch.randn(7), torch.arange(4)
    save_file({"a": a, "ids": ids}, ckpt / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file({"b": b}, ckpt / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    index = {"metadata": {"total_size": 4 * (15 + 7) + 8 * 4}, "weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "float32"}))
    (ckpt / STATE_NAME).write_text(json.dumps({"step": 8, "source_dtype": "bfloat16"}))
    for name in ("optimizer.bin", "scheduler.bin", "random_states_0.pkl", "README.md", "tokenizer.json"):
        (ckpt / name).write_text(name)
    (out / "model.safetensors").write_text("the last step's weights")
    (out / "config.json").write_text("{}")
    (out / UPTRAIN_LOG).write_text("the run's log\n")
    final_from_checkpoint(ckpt, out)
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        UPTRAIN_LOG,
    ]
    first, second = (
        load_file(out / "model-00001-of-00002.safetensors"),
        load_file(out / "model-00002-of-00002.safetensors"),
    )
    assert first["a"].dtype == torch.bfloat16 and first["a"].equal(a.to(torch.bfloat16))
    assert first["ids"].equal(ids) and second["b"].equal(b.to(torch.bfloat16))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["total_size"] == 2 * 22 + 8 * 4
    assert (out / UPTRAIN_LOG).read_text() == "the run's log\n"


def test_a_damaged_checkpoint_is_one_line_naming_the_file_and_the_final_model_stays(tmp_path):
    ckpt, out = tmp_path / "step-0000004", tmp_path / "out"
    ckpt.mkdir()
    out.mkdir()
    (ckpt / STATE_NAME).write_text(json.dumps({"step": 4, "source_dtype": "bfloat16"}))
    (ckpt / "config.json").write_text(json.dumps({"dtype": "float32"}))
    (ckpt / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    (out / "model.safetensors").write_text("the last step's weights")
    with pytest.raises(Mha2GqaError, match=r"model.safetensors: not a readable safetensors file"):
        final_from_checkpoint(ckpt, out)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]  # nothing half-moved, no scratch
    (ckpt / "model.safetensors").unlink()
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(Mha2GqaError, match=r"config.json: not valid JSON"):
        final_from_checkpoint(ckpt, out)
    assert (out / "model.safetensors").read_text() == "the last step's weights"
