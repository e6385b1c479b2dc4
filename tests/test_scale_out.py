"""A conversion on several processes (torchrun, gloo on CPU) equals one process: the calibration
windows are split by rank, the statistics and the refit's gradients, held-out errors and normal
equations summed across ranks; rank 0 merges, checks and writes."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import llama_with_tokenizer, story_text, torchrun
from safetensors.torch import load_file
from test_distributed import run_ok
from test_resume import killed_once

from mha2gqa.core.resume import resume_folder

STATS_SCRIPT = """
import sys, torch
from mha2gqa.convert.calibration.streaming import CalibrationText, PassOptions, collect
from mha2gqa.core.ranks import ranks
src, text, out = sys.argv[1:4]
stats = collect(src, 2, CalibrationText(text, 1024, 64), PassOptions("cpu", compact=False))
if ranks().main:
    torch.save({i: (l.v_gram, l.k_plane_gram, l.k_rest_gram, l.q_plane_energy, l.tokens, stats.tokens)
                for i, l in stats.layers.items()}, out)
"""


FIT_SCRIPT = """
import os, sys, torch
import torch.distributed as dist
from mha2gqa.convert.refit.fit import FitData, FitSteps, fit_layer, solve_output
from mha2gqa.convert.refit.objective import PLAIN
from mha2gqa.core.ranks import ranks
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    dist.init_process_group("gloo")
team = ranks()
g = torch.Generator().manual_seed(0)
x, w = torch.randn(10, 4, 6, generator=g), torch.randn(6, 6, generator=g)
y = x + torch.tanh(x @ w.T) @ w + 0.01 * torch.randn(10, 4, 6, generator=g)  # o(tanh(q(x))) on the stream
o_proj, seen = torch.nn.Linear(6, 6, bias=False), set()
def forward(values, windows):
    seen.update(windows)
    h = torch.tanh(x[windows] @ values["q"].T)
    return x[windows] + torch.func.functional_call(o_proj, {"weight": values["o"]}, (h,))
start = {"q": torch.eye(6), "o": torch.eye(6)}
targets = lambda ws: y[ws]
data = FitData(targets, 10, per_call=2, objective=PLAIN, ranks=team)
result = fit_layer(forward, start, ["q", "o"], data, FitSteps(12, 0.05, 4, 3))
result = solve_output(result, forward, data, o_proj)
assert seen == set(range(team.rank, 10, team.size)), (team.rank, sorted(seen))  # its own windows alone
if team.main:
    torch.save({**result.values, "errors": torch.tensor([result.loss_before, result.loss_after]),
                "steps": result.steps, "ridge": result.ridge}, sys.argv[1])
"""


TURNS_SCRIPT = """
import sys, time, torch.distributed as dist
from mha2gqa.uptrain.sharding import in_turns
dist.init_process_group("gloo")
def load():
    start = time.monotonic(); time.sleep(0.5)
    return (dist.get_rank(), start, time.monotonic())
rank, start, end = in_turns(load)
with open(sys.argv[1] + str(rank), "w") as f:
    f.write(f"{start} {end}")
"""


def test_sharded_processes_load_their_models_one_at_a_time(tmp_path):
    """Under FSDP each process loads the whole model before it keeps its shard: in turns, the host
    holds one whole model at a time (in rank order), not one a process."""
    script = tmp_path / "turns.py"
    script.write_text(TURNS_SCRIPT)
    run_ok([*torchrun(), str(script), str(tmp_path / "rank")])
    (s0, e0), (s1, e1) = ([float(x) for x in (tmp_path / f"rank{r}").read_text().split()] for r in (0, 1))
    assert s0 < e0 <= s1 < e1  # rank 1 began once rank 0 was done (monotonic clocks: one machine)


def test_two_ranks_fit_a_layer_as_one_process_does_each_on_its_own_windows(tmp_path):
    """The refit's fit (Adam steps, held-out checks, the probe, the o_proj solve) on two gloo ranks,
    each running only its own windows: the same steps and values as one process, float noise apart."""
    script = tmp_path / "fit.py"
    script.write_text(FIT_SCRIPT)
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    subprocess.run([sys.executable, str(script), str(one)], check=True)
    run_ok([*torchrun(), str(script), str(two)])
    a, b = torch.load(one), torch.load(two)
    assert a["steps"] == b["steps"] and a["ridge"] == b["ridge"]  # the same decisions
    assert a["ridge"] is not None  # the closed-form o_proj was taken: its sums were summed
    assert torch.allclose(a["errors"], b["errors"], rtol=1e-6)
    assert a["errors"][1] < a["errors"][0]  # it fitted
    for role in ("q", "o"):
        assert torch.allclose(a[role], b[role], atol=1e-5), role


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scale")
    text = story_text(tmp / "t.txt", 400)
    return llama_with_tokenizer(tmp / "mha", text), text


def test_two_ranks_gather_the_statistics_one_process_gathers(source, tmp_path):
    src, text = source
    script = tmp_path / "stats.py"
    script.write_text(STATS_SCRIPT)
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    subprocess.run([sys.executable, str(script), str(src), str(text), str(one)], check=True)
    run_ok([*torchrun(), str(script), str(src), str(text), str(two)])
    a, b = torch.load(one), torch.load(two)
    assert a.keys() == b.keys() and len(a) >= 2
    for layer in a:
        *grams_a, tokens_a, total_a = a[layer]
        *grams_b, tokens_b, total_b = b[layer]
        assert (tokens_a, total_a) == (tokens_b, total_b) and tokens_a > 0
        for x, y in zip(grams_a, grams_b, strict=True):
            assert x.shape == y.shape
            if not x.numel():  # (no non-rotary key dimensions)
                continue
            scale = x.abs().max()
            assert scale > 0
            assert (x - y).abs().max() <= 1e-6 * scale  # summed in another order: float noise only


def _float32(extra) -> list[str]:
    """``extra`` with its refit and distillation in float32 on every machine (``auto`` is bf16 autocast
    where the CPU computes it): the runs compared here agree to rounding."""
    pinned = ["--refit-precision", "no"] * ("--refit" in extra) + ["--distill-precision", "no"] * ("--distill" in extra)
    return [*extra, *pinned]


def _convert(src, text, dst, *extra: str, processes: int = 1) -> str:
    args = ["-m", "mha2gqa.cli", "convert", str(src), str(dst), "-g", "2", "--calibration", str(text)]
    args += ["--calibration-tokens", "1024", "--calibration-seq-len", "64", "--device", "cpu", "-q", *_float32(extra)]
    if processes == 1:
        done = subprocess.run([sys.executable, *args], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout
    return run_ok([*torchrun(), *args])


@pytest.mark.parametrize(
    "extra",
    [
        ("--method", "svd"),
        ("--method", "svd", "--refit", "--refit-steps", "8"),
        # not uniform: the guard compares it with uniform counts (on rank 0), then every rank refits
        ("--method", "svd", "--per-layer", "auto", "--kv-budget", "1.5", "--refit", "--refit-steps", "4"),
        ("--method", "mean", "--grouping", "similarity"),
        # the layer-output cost: each rank runs its share of the windows again, the errors summed
        ("--method", "svd", "--per-layer", "auto", "--kv-budget", "1.5", "--allocation-cost", "output"),
    ],
)
def test_a_conversion_on_two_ranks_equals_one_process(source, tmp_path, extra):
    src, text = source
    one, two = tmp_path / "one", tmp_path / "two"
    _convert(src, text, one, *extra)
    printed = _convert(src, text, two, *extra, processes=2)
    assert printed.count("converted") <= 1  # rank 0 alone speaks and writes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]  # nothing else beside DST
    a, b = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name].float(), b[name].float(), rtol=1e-4, atol=1e-5), name
    rec_a, rec_b = (json.loads((d / "mha2gqa_conversion.json").read_text()) for d in (one, two))
    assert rec_a["conversion"]["calibration"]["tokens"] == rec_b["conversion"]["calibration"]["tokens"]
    assert rec_a["conversion"]["num_kv_heads_per_layer"] == rec_b["conversion"]["num_kv_heads_per_layer"]
    if "--per-layer" in extra:  # the same allocation
        alloc_a, alloc_b = (r["conversion"]["per_layer_allocation"] for r in (rec_a, rec_b))
        assert alloc_a["chosen"] == alloc_b["chosen"]
        assert alloc_a["cost"] == pytest.approx(alloc_b["cost"], rel=1e-4)
        for layer, costs in alloc_a["costs"].items():  # every layer's cost at every count
            assert costs == pytest.approx(alloc_b["costs"][layer], rel=1e-4, abs=1e-9)
    if "--refit" in extra:
        la, lb = rec_a["conversion"]["refit"]["layers"], rec_b["conversion"]["refit"]["layers"]
        for x, y in zip(la, lb, strict=True):
            assert x["loss_after"] == pytest.approx(y["loss_after"], rel=1e-4)


def test_too_few_windows_for_the_ranks_is_one_line(source, tmp_path):
    src, text = source
    args = ["-m", "mha2gqa.cli", "convert", str(src), str(tmp_path / "out"), "-g", "2", "--method", "svd"]
    args += ["--calibration", str(text), "--calibration-tokens", "64", "--calibration-seq-len", "64", "--guard", "off"]
    done = subprocess.run([*torchrun(), *args, "--device", "cpu"], capture_output=True, text=True)
    assert done.returncode != 0
    assert "Error: --calibration" in done.stderr and "1 window(s) for 2 processes" in done.stderr
    ours = [ln for ln in done.stderr.splitlines() if ln.strip().startswith('File "') and "torch" not in ln]
    assert [ln for ln in ours if "<frozen" not in ln] == []  # torchrun's own traceback only
    assert not (tmp_path / "out").exists()


def test_convert_refit_distill_sharded_on_two_ranks_equals_one_process(source, tmp_path):
    """``convert --refit --distill --sharding fsdp`` under torchrun: the statistics, the refit and the
    distillation (FSDP, each rank a shard and half of every step's windows) shared by two ranks; the
    published model is one process's, float noise apart, with the same records."""
    src, text = source
    one, two = tmp_path / "one", tmp_path / "two"
    extra = ("--method", "svd", "--refit", "--refit-steps", "4", "--distill", "--distill-steps", "4")
    _convert(src, text, one, *extra)
    printed = _convert(src, text, two, *extra, "--sharding", "fsdp", processes=2)
    assert printed.count("uptrain done") == 1  # rank 0 alone speaks
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]  # no scratch or kept work left
    a, b = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert a.keys() == b.keys()
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert worst <= 1e-5, worst
    up_a, up_b = (json.loads((d / "mha2gqa_uptrain.json").read_text())["uptrain"] for d in (one, two))
    assert up_a["steps"] == up_b["steps"] == 4
    assert up_b["settings"]["sharding"] == "fsdp" and up_a["settings"]["sharding"] == "none"
    guards = [json.loads((d / "mha2gqa_conversion.json").read_text())["conversion"]["guard"] for d in (one, two)]
    stages = [[(s["stage"], s["outcome"]) for s in g["stages"]] for g in guards]
    assert stages[0] == stages[1] and [s for s, _ in stages[0]] == ["merge", "refit", "distill"]


@pytest.mark.parametrize(
    ("family", "sharding"),
    [("phi3", "none"), ("gemma2", "fsdp")],  # fused qkv; soft caps, sliding windows, 4 norms a layer
)
def test_families_beyond_llama_refit_and_distill_on_two_ranks_as_one_process(family, sharding, tmp_path):
    """The two-rank paths (statistics, refit, the guard on rank 0, the distillation under DDP or FSDP
    and its checkpoint scores) on layouts other than Llama's: one process's model and stages."""
    from conftest import random_model, tiny_config
    from test_methods import with_tokenizer

    text = story_text(tmp_path / "t.txt", 400)
    src = with_tokenizer(random_model(tiny_config(family, vocab_size=300), seed=4), tmp_path / "mha", text)
    one, two = tmp_path / "one", tmp_path / "two"
    extra = ("--method", "svd", "--refit", "--refit-steps", "4", "--distill", "--distill-steps", "3")
    _convert(src, text, one, *extra)
    _convert(src, text, two, *extra, "--sharding", sharding, processes=2)
    a, b = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert a.keys() == b.keys()
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    # DDP's averaged gradients round apart from one process's sums, and Adam makes a gradient near zero
    # a visible share of a step (here lr x RMS ~3e-4): phi3's one element in 1.5M worst, 5.5e-6 with the
    # distillation's loss over the whole logits and 1.03e-5 taken 32 tokens at a time (each a rounding
    # draw); a wrong split of windows or a missed reduction moves weights by whole steps
    assert worst <= 3e-5, worst
    guards = [json.loads((d / "mha2gqa_conversion.json").read_text())["conversion"]["guard"] for d in (one, two)]
    stages = [[(s["stage"], s["outcome"], s["detail"].split(":")[0]) for s in g["stages"]] for g in guards]
    assert stages[0] == stages[1] and [s[0] for s in stages[0]] == ["merge", "refit", "distill"]


def test_distill_settings_a_launcher_cannot_share_are_refused_before_any_work(source, tmp_path):
    src, text = source
    args = ["-m", "mha2gqa.cli", "convert", str(src), str(tmp_path / "out"), "-g", "2", "--device", "cpu"]
    args += ["--calibration", str(text), "--distill", "--distill-batch", "3"]
    done = subprocess.run([*torchrun(), *args], capture_output=True, text=True)
    assert done.returncode != 0 and "Error: --distill-batch 3 windows cannot be shared by 2 processes" in done.stderr
    one = subprocess.run(
        [sys.executable, *args[:-3], "--distill", "--sharding", "fsdp"], capture_output=True, text=True
    )
    assert one.returncode != 0 and "Error: --sharding fsdp shards the distillation across processes" in one.stderr
    assert not (tmp_path / "out").exists()


def test_a_killed_sharded_distillation_resumes_on_two_ranks(source, tmp_path):
    """A real SIGKILL of every process once the sharded distillation has checkpointed, then the same
    torchrun command with --resume: the uninterrupted two-rank run's model, nothing left beside it."""
    src, text = source
    extra = ["--method", "svd", "--refit", "--refit-steps", "4", "--distill", "--distill-steps", "30"]
    extra += ["--sharding", "fsdp"]
    _convert(src, text, tmp_path / "whole", *extra, processes=2)
    dst = tmp_path / "out"
    args = [*torchrun(), "-m", "mha2gqa.cli", "convert", str(src), str(dst), "-g", "2"]
    args += ["--calibration", str(text), "--calibration-tokens", "1024", "--calibration-seq-len", "64"]
    args += ["--device", "cpu", "-q", *_float32(extra)]
    checkpoints = resume_folder(dst) / "distilled" / "checkpoints"
    killed_once(args, lambda: any(checkpoints.glob("step-*")))  # torchrun and both ranks
    assert not dst.exists() and any(checkpoints.glob("step-*"))
    done = subprocess.run([*args, "--resume", "--remove-stale"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(dst / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "whole"]
