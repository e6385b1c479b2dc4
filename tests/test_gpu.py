"""CUDA paths against their CPU runs (``-m gpu``; skipped without a CUDA device, never in CI).

Tolerances: fp32 on CUDA equals fp32 on CPU to 1e-4 (TF32 off); bf16 on CUDA is within 2% of fp32
on perplexity and 0.05 nats of mean KL (bf16 keeps 8 bits of mantissa: logits of a tiny random model
move by ~1e-2); calibration statistics and the ``svd`` merge on CUDA equal CPU to 1e-4 relative.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import llama_with_tokenizer, story_text
from safetensors.torch import load_file

from mha2gqa.convert import convert_checkpoint
from mha2gqa.eval.harness import evaluate
from mha2gqa.eval.settings import EvalSettings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu")
    text = story_text(root / "text.txt", 400)
    src = llama_with_tokenizer(root / "mha", text, max_positions=128)
    mean = convert_checkpoint(src, root / "mean", 2, progress=False).output
    return {"root": root, "text": text, "src": src, "mean": mean}


@pytest.fixture(autouse=True)
def _no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _eval(pair, **kw) -> dict:
    base = dict(
        data=str(pair["text"]),
        seq_len=64,
        max_tokens=2000,
        protocols=("disjoint", "stride", "rolling"),
        doc_split="paragraph",
        samples=1,
        sample_tokens=4,
        progress=False,
    )
    return evaluate(str(pair["src"]), str(pair["mean"]), EvalSettings(**{**base, **kw})).to_dict()


def _close(a: float, b: float, rel: float) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=rel)


def test_cuda_eval_equals_cpu_in_fp32_and_bf16_stays_within_tolerance(pair):
    cpu = _eval(pair, device="cpu", dtype="float32")
    gpu = _eval(pair, device="cuda", dtype="float32")
    for p in ("disjoint", "stride", "rolling"):
        for m in ("original", "converted"):
            assert _close(gpu["protocols"][p][m]["nll"], cpu["protocols"][p][m]["nll"], 1e-4), (p, m)
    for k in ("mean", "median", "q99"):
        assert _close(gpu["agreement"]["kl"][k], cpu["agreement"]["kl"][k], 1e-4), k
    assert abs(gpu["agreement"]["top1_agreement"] - cpu["agreement"]["top1_agreement"]) < 2e-3
    for k in ("mean_kl", "mean_js", "mean_contribution_rel_error", "mean_hidden_cosine"):
        assert _close(gpu["attention"]["summary"][k], cpu["attention"]["summary"][k], 1e-4), k
    bf16 = _eval(pair, device="cuda", dtype="bfloat16")
    assert bf16["device"]["dtype"] == "bfloat16"
    for m in ("original", "converted"):
        assert _close(bf16["protocols"]["disjoint"][m]["ppl"], cpu["protocols"]["disjoint"][m]["ppl"], 0.02)
    assert abs(bf16["agreement"]["kl"]["mean"] - cpu["agreement"]["kl"]["mean"]) < 0.05


def test_one_model_at_a_time_equals_both_in_memory_on_cuda(pair, tmp_path):
    one = _eval(pair, device="cuda", dtype="bfloat16", reference_cache=str(tmp_path))
    both = _eval(pair, device="cuda", dtype="bfloat16", load_both=True)
    assert one["protocols"]["disjoint"]["converted"] == both["protocols"]["disjoint"]["converted"]
    assert one["agreement"]["kl"] == both["agreement"]["kl"]
    assert one["attention"]["summary"] == both["attention"]["summary"]


def test_device_map_auto_evaluates(pair):
    out = _eval(pair, device="cuda", dtype="float32", device_map="auto", protocols=("disjoint",))
    cpu = _eval(pair, device="cpu", dtype="float32", protocols=("disjoint",))
    assert out["device"]["device_map"] == "auto"
    assert _close(
        out["protocols"]["disjoint"]["converted"]["nll"], cpu["protocols"]["disjoint"]["converted"]["nll"], 1e-4
    )


def test_calibration_and_svd_on_cuda_equal_cpu(pair, tmp_path):
    kw = dict(
        method="svd", calibration=str(pair["text"]), calibration_tokens=512, calibration_seq_len=64, progress=False
    )
    cpu = convert_checkpoint(pair["src"], tmp_path / "cpu", 2, device="cpu", **kw).output
    gpu = convert_checkpoint(pair["src"], tmp_path / "gpu", 2, device="cuda", **kw).output
    a, b = load_file(cpu / "model.safetensors"), load_file(gpu / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        err = (a[name].double() - b[name].double()).norm() / a[name].double().norm().clamp_min(1e-12)
        assert err < 1e-4, name


@pytest.mark.parametrize("cost", ["logits", "output"])
def test_per_layer_allocation_on_cuda_equals_cpu(pair, tmp_path, cost):
    """The output-level costs merge a layer that runs on the device with statistics kept on the CPU
    (the first GPU run of ``--per-layer auto`` failed on mixed devices)."""
    kw = dict(
        method="svd",
        per_layer="auto",
        kv_budget=2.0,
        allocation_cost=cost,
        calibration=str(pair["text"]),
        calibration_tokens=512,
        calibration_seq_len=64,
        progress=False,
    )
    cpu = convert_checkpoint(pair["src"], tmp_path / "cpu", None, device="cpu", **kw).facts.per_layer_allocation
    gpu = convert_checkpoint(pair["src"], tmp_path / "gpu", None, device="cuda", **kw).facts.per_layer_allocation
    assert gpu.chosen == cpu.chosen and gpu.costs.keys() == cpu.costs.keys()
    for layer, costs in cpu.costs.items():
        for g, c in costs.items():
            assert _close(gpu.costs[layer][g], c, 1e-3) or abs(gpu.costs[layer][g] - c) < 1e-6, (layer, g)


def test_uptraining_with_bf16_autocast_reaches_the_cpu_loss(pair, tmp_path):
    from mha2gqa.core.runlog import RunTrain, read_log
    from mha2gqa.uptrain import UptrainSettings, uptrain

    def run(device: str, precision: str) -> float:
        out = tmp_path / device
        s = UptrainSettings(
            data=str(pair["text"]),
            output=str(out),
            seq_len=32,
            batch_size=4,
            lr=3e-3,
            max_steps=20,
            log_every=20,
            device=device,
            mixed_precision=precision,
            progress=False,
        )
        uptrain(str(pair["mean"]), s, log=lambda *_: None)
        return [r for r in read_log(out) if isinstance(r, RunTrain)][-1].loss

    cpu, gpu = run("cpu", "no"), run("cuda", "bf16")
    assert abs(gpu - cpu) / cpu < 0.05, (gpu, cpu)


def test_bench_cache_bytes_equal_the_planners(pair):
    from mha2gqa.core.models import load_model
    from mha2gqa.eval.bench import bench_model

    for folder in (pair["src"], pair["mean"]):
        model = load_model(str(folder), torch.device("cuda"), torch.bfloat16).model
        out = bench_model(model, 16, 8, repeats=1, warmup=0, batch_size=2)
        assert out.kv_cache.measured_bytes == out.kv_cache.planned_bytes


def test_the_guard_and_refit_on_cuda_measure_what_the_cpu_measures(pair, tmp_path):
    """The stage guard streams its scoring on the conversion's device: its merge figures equal the
    CPU's, and what it says of the published model is what stock transformers computes on the CPU."""
    from test_guard import _independent

    kw = dict(
        method="svd",
        refit=True,
        refit_steps=20,
        calibration=str(pair["text"]),
        calibration_tokens=1024,
        calibration_seq_len=64,
        progress=False,
    )
    cpu = convert_checkpoint(pair["src"], tmp_path / "cpu", 1, device="cpu", **kw)
    gpu = convert_checkpoint(pair["src"], tmp_path / "gpu", 1, device="cuda", **kw)
    (cpu_merge, cpu_refit), (gpu_merge, gpu_refit) = cpu.facts.guard.stages, gpu.facts.guard.stages
    assert (
        _close(gpu_merge.after.kl, cpu_merge.after.kl, 1e-4) and abs(gpu_merge.after.top1 - cpu_merge.after.top1) < 2e-3
    )
    assert _close(gpu_refit.after.kl, cpu_refit.after.kl, 0.1)  # the refit batches its windows on a GPU
    kl, top1 = _independent(pair["src"], gpu.output, pair["text"], 64)
    assert _close(gpu_refit.published.kl, kl, 1e-3) and abs(gpu_refit.published.top1 - top1) < 2e-3


def test_convert_distill_on_cuda_lowers_the_kl_as_on_the_cpu(pair, tmp_path):
    """``convert --distill`` (the teacher's top-k cache and the student's steps) on the conversion's
    device: the distilled model is as close to SRC as the CPU's (fp32, TF32 off) and closer than the
    merge alone."""
    from click.testing import CliRunner
    from conftest import load

    from mha2gqa.cli import main
    from mha2gqa.convert.engine.layers import calibration_ids

    def run(device: str, name: str) -> Path:
        text = str(pair["text"])
        calibration = ["--calibration", text, "--calibration-tokens", "1024", "--calibration-seq-len", "64"]
        distill = ["--distill", "--distill-steps", "16", "--distill-lr", "5e-3"]
        args = ["convert", str(pair["src"]), str(tmp_path / name), "-g", "1", "--method", "mean", "-q"]
        args += ["--device", device, *calibration, *distill]
        done = CliRunner().invoke(main, args)
        assert done.exit_code == 0, done.output
        return tmp_path / name

    ids = calibration_ids(pair["src"], str(pair["text"]), 1024, 64)

    def kl(folder: Path) -> float:
        with torch.no_grad():
            p, q = (torch.log_softmax(load(f)(ids).logits, -1) for f in (pair["src"], folder))
        return float((p.exp() * (p - q)).sum(-1).mean())

    merged = convert_checkpoint(pair["src"], tmp_path / "merged", 1, progress=False).output
    cpu, gpu = kl(run("cpu", "on-cpu")), kl(run("cuda", "on-gpu"))
    assert _close(gpu, cpu, 0.05) and gpu < 0.9 * kl(merged), (gpu, cpu, kl(merged))
