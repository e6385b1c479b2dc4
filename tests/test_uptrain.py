"""Uptraining: losses, data order, what trains, exact resume, the output, and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import FIXTURES, llama_with_tokenizer, load, requires_fixtures, save, story_text
from reference import top_k_distillation_formula
from safetensors.torch import load_file

from mha2gqa.cli import main
from mha2gqa.convert import convert_checkpoint
from mha2gqa.core import typed
from mha2gqa.core.devices import PRECISIONS
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.model_info import ModelInfo
from mha2gqa.core.models import load_model
from mha2gqa.core.records import UPTRAIN_RECORD
from mha2gqa.core.runlog import RunEnd, RunEval, RunHistory, RunStart, RunTrain, read_log, to_json
from mha2gqa.core.uptrain_guard import published_outcome
from mha2gqa.eval.tables import recovery_table
from mha2gqa.uptrain import UptrainSettings, uptrain
from mha2gqa.uptrain.checkpoints import checkpoint_dirs
from mha2gqa.uptrain.data import WindowOrder, pack_windows
from mha2gqa.uptrain.objectives import combined, cross_entropy, distillation
from mha2gqa.uptrain.params import select_trainable
from mha2gqa.uptrain.record import UptrainRecord


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """An MHA parent with a tokenizer, its mean conversion to 2 KV heads, and training/held-out text."""
    root = tmp_path_factory.mktemp("uptrain")
    text = story_text(root / "train.txt", 600)
    held = story_text(root / "held.txt", 120)
    parent = llama_with_tokenizer(root / "parent", text)
    student = convert_checkpoint(parent, root / "student", 2, "mean", progress=False).output
    return {"root": root, "text": text, "held": held, "parent": parent, "student": student}


def _settings(models, out: Path, **kw) -> UptrainSettings:
    base = dict(
        data=str(models["text"]),
        output=str(out),
        seq_len=32,
        batch_size=4,
        lr=3e-3,
        max_steps=12,
        eval_data=str(models["held"]),
        eval_tokens=512,
        progress=False,
        mixed_precision="no",  # float32 on every machine: the runs compared here agree to rounding
    )
    return UptrainSettings(**{**base, **kw})


def _quiet(*_):
    return None


# ---- losses -------------------------------------------------------------------------------------


def test_distillation_from_itself_is_exactly_zero_with_zero_gradient(tiny_checkpoint):
    model = load(tiny_checkpoint("llama"))
    ids = torch.randint(0, 96, (2, 16))
    student = model(ids).logits
    with torch.no_grad():
        teacher = model(ids).logits
    for t in (1.0, 2.0):
        loss = distillation(student, teacher, t)
        assert loss.item() == 0.0
        (grad,) = torch.autograd.grad(loss, student, retain_graph=True)
        assert grad.abs().max().item() == 0.0
    params = [p for p in model.parameters()]
    grads = torch.autograd.grad(distillation(model(ids).logits, teacher), params)
    assert max(g.abs().max().item() for g in grads) == 0.0


def test_distillation_matches_hand_computed_kl():
    s = torch.tensor([[[0.0, 1.0, 2.0]]])
    t = torch.tensor([[[2.0, 0.0, 0.0]]])
    p, q = torch.softmax(t[0, 0], -1), torch.softmax(s[0, 0], -1)
    assert distillation(s, t).item() == pytest.approx(float((p * (p / q).log()).sum()), rel=1e-6)
    p2, q2 = torch.softmax(t[0, 0] / 2, -1), torch.softmax(s[0, 0] / 2, -1)
    assert distillation(s, t, 2.0).item() == pytest.approx(4 * float((p2 * (p2 / q2).log()).sum()), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "vocab", "k"), [(70, 50, 7), (33, 9, 9), (5, 300, 1)])  # 2 x tokens: 4, 3, 1 chunks
def test_top_k_distillation_and_its_gradient_are_the_formulas(dtype, tokens, vocab, k):
    """The top-K distillation, taken :data:`ROWS` tokens at a time with its analytic gradient, gives
    the loss and the gradient autograd gives of its formula: token counts across and inside a chunk,
    K below and equal to the vocabulary (no bucket), temperatures, a teacher's rest that underflowed,
    float64, float32 and bfloat16 logits (the gradient in the logits' dtype)."""
    from mha2gqa.uptrain.objectives import distillation_top_k

    g = torch.Generator().manual_seed(tokens + k)
    teacher = torch.log_softmax(torch.randn(2, tokens, vocab, generator=g, dtype=torch.float64) * 3, -1)
    values, indices = teacher.topk(k, -1)
    rest = torch.log1p(-values.exp().sum(-1).clamp(max=1 - 1e-12))
    rest[0, 0] = -math.inf  # a tail with no mass
    student = (torch.randn(2, tokens, vocab, generator=g, dtype=torch.float64) * 2).to(dtype).requires_grad_()
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-5}[dtype]
    for temperature in (1.0, 2.5):
        args = (values.float(), indices.to(torch.int32), rest.float(), temperature)
        if dtype is torch.float64:
            args = (values, indices, rest, temperature)
        ours = distillation_top_k(student, *args)
        (grad,) = torch.autograd.grad(ours, student)
        ref = top_k_distillation_formula(student, *args)
        (ref_grad,) = torch.autograd.grad(ref, student)
        assert ours.dtype == ref.dtype and grad.dtype == dtype
        torch.testing.assert_close(ours, ref, rtol=tol, atol=tol)
        torch.testing.assert_close(grad.double(), ref_grad.double(), rtol=tol * 10, atol=tol * 10)
        assert float(ref.detach()) > 0


def test_distillation_gradient_matches_autograd_of_the_formula():
    s = torch.randn(2, 3, 11, dtype=torch.float64, requires_grad=True)
    t = torch.randn(2, 3, 11, dtype=torch.float64)
    for temp in (1.0, 3.0):
        (ours,) = torch.autograd.grad(distillation(s, t, temp), s)
        ref = (
            torch.nn.functional.kl_div(
                torch.log_softmax(s.flatten(0, 1) / temp, -1),
                torch.log_softmax(t.flatten(0, 1) / temp, -1),
                log_target=True,
                reduction="batchmean",
            )
            * temp**2
        )
        (theirs,) = torch.autograd.grad(ref, s)
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


def test_cross_entropy_equals_transformers_loss(tiny_checkpoint):
    model = load(tiny_checkpoint("llama"))
    ids = torch.randint(0, 96, (2, 17))
    with torch.no_grad():
        ours = cross_entropy(model(ids[:, :-1]).logits, ids[:, 1:])
        theirs = model(ids, labels=ids).loss  # scores the first 16 next tokens, as ours does
        theirs_16 = model(ids[:, :-1], labels=ids[:, :-1]).loss
    assert ours.item() != theirs_16.item()
    manual = torch.nn.functional.cross_entropy(model(ids[:, :-1]).logits.flatten(0, 1), ids[:, 1:].flatten())
    assert ours.item() == pytest.approx(manual.item(), rel=1e-6)
    assert theirs.item() == pytest.approx(ours.item(), rel=1e-5)


def test_mix_weights_its_parts():
    logits, teacher = torch.randn(1, 4, 7), torch.randn(1, 4, 7)
    targets = torch.randint(0, 7, (1, 4))
    loss, parts = combined("mix", logits, targets, teacher, 0.25, 1.0)
    assert loss.item() == pytest.approx(0.75 * parts["ce"] + 0.25 * parts["kd"], rel=1e-6)
    assert set(combined("ce", logits, targets, None, 0.25, 1.0)[1]) == {"ce"}


# ---- data ---------------------------------------------------------------------------------------


def test_windows_make_every_token_a_target_once():
    ids = torch.arange(1, 102)  # 101 tokens
    w = pack_windows(ids, 25)
    assert w.shape == (4, 26)
    targets = w[:, 1:].flatten()
    assert targets.tolist() == list(range(2, 102))  # every token after the first, once
    assert torch.equal(w[1, 0], w[0, -1])
    with pytest.raises(Mha2GqaError, match="too little text for one training window of 200"):
        pack_windows(ids, 200)


def test_window_order_is_a_seeded_permutation_per_epoch():
    order = WindowOrder(10, 4, seed=3)
    first = torch.cat([order.batch(s) for s in range(5)])  # 20 = two epochs
    assert sorted(first[:10].tolist()) == list(range(10)) and sorted(first[10:].tolist()) == list(range(10))
    assert not torch.equal(first[:10], first[10:])
    again = WindowOrder(10, 4, seed=3)
    assert torch.equal(again.batch(3), order.batch(3))  # any step, without replaying the others
    assert not torch.equal(WindowOrder(10, 4, seed=4).batch(0), order.batch(0))
    assert order.epoch(5) == 2.0


# ---- what trains --------------------------------------------------------------------------------


def test_train_kv_selects_only_the_key_value_projections(tiny_checkpoint):
    from mha2gqa.core.architecture import resolve

    folder = tiny_checkpoint("qwen3", num_key_value_heads=2)  # has a shared k_norm, which trains with K
    model = load(folder)
    cfg = json.loads((folder / "config.json").read_text())
    arch = resolve(cfg)
    fam, dims = arch.family, arch.dims
    kv = select_trainable(model, fam, dims, "kv")
    assert kv.names and all(("k_proj" in n or "v_proj" in n or "k_norm" in n) for n in kv.names)
    assert sum("k_norm" in n for n in kv.names) == dims.num_layers
    attn = select_trainable(model, fam, dims, "attention")
    assert all("self_attn" in n for n in attn.names) and any("o_proj" in n for n in attn.names)
    assert [p.requires_grad for p in model.parameters()].count(True) == len(attn.names)
    everything = select_trainable(model, None, dims, "all")
    assert everything.count == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("family", "groups"), [("phi3", 2), ("falcon", 2), ("gpt_bigcode", 1)])
def test_train_kv_on_fused_qkv_leaves_query_rows_bit_exact(family, groups, models, tiny_checkpoint, tmp_path):
    """Stacked ``[q; k; v]`` (Phi-3) and grouped ``[G, H/G + 2, d]`` (Falcon, GPTBigCode) layouts: the
    query rows, wherever the layout puts them, stay bit-exact; the K/V rows train."""
    from transformers import AutoTokenizer

    from mha2gqa.core.architecture import dims_of
    from mha2gqa.core.families import families

    src = tiny_checkpoint(family, vocab_size=300)
    student = convert_checkpoint(src, tmp_path / "gqa", groups, "mean", progress=False).output
    AutoTokenizer.from_pretrained(models["parent"]).save_pretrained(student)
    out = tmp_path / "run"
    uptrain(str(student), _settings(models, out, train="kv", max_steps=4, eval_data=None), log=_quiet)
    before, after = load_file(student / "model.safetensors"), load_file(out / "model.safetensors")
    fam = families()[family]
    dims = dims_of(json.loads((student / "config.json").read_text()))
    q_rows = torch.tensor(fam.q_rows(dims.num_heads, dims.num_kv_heads, dims.head_dim))
    kv_rows = torch.tensor(
        sorted(set(range((dims.num_heads + 2 * dims.num_kv_heads) * dims.head_dim)) - set(q_rows.tolist()))
    )
    fused = fam.qkv_proj.rsplit(".", 1)[-1]
    changed = []
    for name, t in before.items():
        if fused in name:
            assert torch.equal(after[name][q_rows], t[q_rows]), name
            assert not torch.equal(after[name][kv_rows], t[kv_rows]), name
        elif not torch.equal(after[name], t):
            changed.append(name)
    assert changed == []


# ---- a run --------------------------------------------------------------------------------------


def test_uptrain_improves_and_writes_a_stock_gqa_model(models, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    result = uptrain(
        str(models["student"]),
        _settings(models, out, max_steps=30, teacher=str(models["parent"]), save_total_limit=2),
        log=_quiet,
    )
    assert result.complete and result.steps == 30 and result.tokens == 30 * 4 * 32
    evals = result.evals
    assert [e.step for e in evals] == [0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30]
    assert evals[-1].ppl < 0.1 * evals[0].ppl  # (the parent is random: KL to it grows under ce)
    assert evals[0].teacher_ppl == pytest.approx(evals[-1].teacher_ppl, rel=1e-9)
    assert [s for s, _ in checkpoint_dirs(out)] == [27, 30]  # save_total_limit
    ckpt = checkpoint_dirs(out)[0][1]  # a Hugging Face model with its card and records, plus trainer state
    assert AutoModelForCausalLM.from_pretrained(ckpt).config.num_key_value_heads == 2
    assert json.loads((ckpt / "mha2gqa_uptrain.json").read_text())["uptrain"]["steps"] == 27
    assert "## Conversion" in (ckpt / "README.md").read_text() and (ckpt / "optimizer.bin").is_file()
    log = read_log(out)
    assert isinstance(log[0], RunStart) and isinstance(log[-1], RunEnd)
    assert [r.step for r in log if isinstance(r, RunTrain)] == [10, 20, 30]
    assert [r for r in log if isinstance(r, RunEval)] == evals  # the log holds what the run returned
    model = AutoModelForCausalLM.from_pretrained(out)  # stock transformers
    assert model.config.num_key_value_heads == 2 and model.config.use_cache  # generation keeps its cache
    with torch.no_grad():
        cache = model(torch.tensor([[1, 5, 7, 9]]), use_cache=True).past_key_values
    assert cache.layers[0].keys.shape[1] == 2  # the KV cache holds G heads
    record = json.loads((out / "mha2gqa_uptrain.json").read_text())["uptrain"]
    assert record["steps"] == 30 and record["last_eval"]["ppl"] == evals[-1].ppl
    typed_record = UptrainRecord.read(out)  # the typed record reads back what was written
    assert typed_record.steps == 30 and typed_record.to_json() == (out / "mha2gqa_uptrain.json").read_text()
    damaged = json.loads(typed_record.to_json())
    damaged["uptrain"]["steps"] = "thirty"
    with pytest.raises(Mha2GqaError, match=r"damaged uptraining record.*steps"):
        UptrainRecord.from_dict(damaged, "x.json")
    assert (out / "mha2gqa_conversion.json").is_file()
    card = (out / "README.md").read_text()
    assert "uptrained" in card and "## Conversion" in card
    assert not list(out.glob(".*tmp*")) and not list((out / "checkpoints").glob(".*"))


def test_kd_objective_moves_toward_the_teacher(models, tmp_path):
    result = uptrain(
        str(models["student"]),
        _settings(models, tmp_path / "kd", objective="kd", max_steps=20, teacher=str(models["parent"])),
        log=_quiet,
    )
    assert result.evals[-1].kl_mean < 0.8 * result.evals[0].kl_mean
    losses = [r.parts["kd"] for r in read_log(tmp_path / "kd") if isinstance(r, RunTrain)]
    assert losses[-1] < losses[0]


def test_resume_continues_the_same_trajectory(models, tmp_path):
    common = dict(max_steps=200, save_every=50, eval_every=100, log_every=50)
    straight = tmp_path / "straight"
    uptrain(str(models["student"]), _settings(models, straight, **common), log=_quiet)
    split = tmp_path / "split"
    first = uptrain(str(models["student"]), _settings(models, split, stop_after=100, **common), log=_quiet)
    assert not first.complete and first.steps == 100 and not (split / "config.json").exists()
    second = uptrain(str(models["student"]), _settings(models, split, resume=True, **common), log=_quiet)
    assert second.complete and second.steps == 200
    a, b = load_file(straight / "model.safetensors"), load_file(split / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)
    steps = [(r.TYPE, getattr(r, "step", None)) for r in read_log(split)]
    assert steps.count(("eval", 100)) == 1 and ("resume", 100) in steps
    evals_a = [r.ppl for r in read_log(straight) if isinstance(r, RunEval)]
    evals_b = [r.ppl for r in read_log(split) if isinstance(r, RunEval)]
    assert evals_a == pytest.approx(evals_b, rel=1e-6)


def test_accumulation_and_checkpointing_do_not_change_the_run(models, tmp_path):
    """4 windows in one micro-batch == 2 x 2 accumulated == 4 x 1 with activation checkpointing."""
    kw = dict(max_steps=5, eval_data=None, objective="mix", teacher=str(models["parent"]))
    runs = {"plain": {}, "accum": {"grad_accum": 2}, "ckpt": {"grad_accum": 4, "gradient_checkpointing": True}}
    weights = {}
    for name, extra in runs.items():
        uptrain(str(models["student"]), _settings(models, tmp_path / name, **kw, **extra), log=_quiet)
        weights[name] = load_file(tmp_path / name / "model.safetensors")
    for name in ("accum", "ckpt"):
        for k, v in weights["plain"].items():
            torch.testing.assert_close(weights[name][k], v, rtol=1e-5, atol=1e-6)


def test_max_tokens_sets_the_steps_and_one_epoch_is_the_default(models, tmp_path):
    r = uptrain(
        str(models["student"]),
        _settings(models, tmp_path / "a", max_steps=None, max_tokens=1000, eval_data=None),
        log=_quiet,
    )
    assert r.total_steps == 8  # ceil(1000 / (4 x 32))
    r = uptrain(str(models["student"]), _settings(models, tmp_path / "b", max_steps=None, eval_data=None), log=_quiet)
    windows = read_log(tmp_path / "b")[0].windows
    assert r.total_steps == -(-windows // 4) and read_log(tmp_path / "b")[-2].epoch >= 1.0


def test_cli_uptrain_then_eval(models, tmp_path):
    out = tmp_path / "cli"
    r = CliRunner().invoke(
        main,
        [
            "uptrain",
            str(models["student"]),
            "--data",
            str(models["text"]),
            "--output",
            str(out),
            *["--seq-len", "32", "--batch-size", "4", "--grad-accum", "2", "--max-steps", "6", "--eval-data"],
            str(models["held"]),
            "--eval-tokens",
            "256",
            "--teacher",
            str(models["parent"]),
            "--objective",
            "mix",
            "-q",
        ],
    )
    assert r.exit_code == 0, r.output
    assert r.output.startswith("uptrain done: 6 steps") and len(r.output.splitlines()) == 1  # -q: the result only
    r = CliRunner().invoke(
        main,
        [
            "eval",
            "--original",
            str(models["parent"]),
            "--converted",
            str(out),
            "--data",
            str(models["held"]),
            *["--seq-len", "32", "--max-tokens", "256", "-q", "--output"],
            str(tmp_path / "res.json"),
        ],
    )
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "res.json").read_text())
    assert res["models"]["converted"]["num_kv_heads"] == 2 and res["agreement"]["kl"]["mean"] > 0


def test_report_draws_the_recovery_curves(models, tmp_path):
    runs = []
    for objective in ("ce", "kd"):
        out = tmp_path / f"run-{objective}"
        uptrain(
            str(models["student"]),
            _settings(models, out, objective=objective, max_steps=6, teacher=str(models["parent"])),
            log=_quiet,
        )
        runs += ["--uptrain", str(out)]
    md = tmp_path / "r.md"
    r = CliRunner().invoke(main, ["report", *runs, "--md", str(md), "--html", str(tmp_path / "r.html")])
    assert r.exit_code == 0, r.output
    text = md.read_text()
    assert "## Uptraining recovery" in text and "| run-ce | ce | all | 6 / 6 | 768 |" in text
    assert "| run-kd | kd |" in text and "x →" in text
    assert (tmp_path / "r_files" / "recovery.png").stat().st_size > 5000
    assert "data:image/png;base64," in (tmp_path / "r.html").read_text()
    bogus = tmp_path / "bogus.jsonl"
    train = next(r for r in read_log(tmp_path / "run-ce") if isinstance(r, RunTrain))
    bogus.write_text(json.dumps(to_json(train)) + "\n")  # whole records, but no start record
    r = CliRunner().invoke(main, ["report", "--uptrain", str(bogus)])
    assert r.exit_code == 1 and "not a log of `mha2gqa uptrain`" in r.output
    bogus.write_text('{"type": "train", "step": 1}\n')
    r = CliRunner().invoke(main, ["report", "--uptrain", str(bogus)])
    assert r.exit_code == 1 and "bogus.jsonl: line 1 (train).tokens is missing; the log is damaged" in r.output
    assert CliRunner().invoke(main, ["report"]).exit_code == 1


def test_lora_adapters_merge_into_a_stock_model_and_resume_exactly(models, tmp_path):
    pytest.importorskip("peft")
    kw = dict(train="attention", lora_rank=4, max_steps=8, save_every=4, eval_data=None)
    straight = tmp_path / "straight"
    result = uptrain(str(models["student"]), _settings(models, straight, **kw), log=_quiet)
    assert result.complete
    ckpt = checkpoint_dirs(straight)[-1][1]
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    before, after = load_file(models["student"] / "model.safetensors"), load_file(straight / "model.safetensors")
    assert before.keys() == after.keys()  # merged: no adapter tensors left
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(any(p in k for p in ("q_proj", "k_proj", "v_proj", "o_proj")) for k in changed)
    split = tmp_path / "split"
    uptrain(str(models["student"]), _settings(models, split, stop_after=4, **kw), log=_quiet)
    uptrain(str(models["student"]), _settings(models, split, resume=True, **kw), log=_quiet)
    resumed = load_file(split / "model.safetensors")
    for k in after:
        torch.testing.assert_close(resumed[k], after[k], rtol=1e-6, atol=1e-7)


def test_a_second_run_in_one_process_uses_its_own_precision(models, tmp_path):
    """Accelerate keeps its state process-wide: a second run (a job's next stage, a library user's loop)
    with another precision was refused, and one with another device would have run on the first's."""

    def precision(out: Path, mp: str) -> str:
        uptrain(str(models["student"]), _settings(models, out, max_steps=2, mixed_precision=mp), log=_quiet)
        return next(r for r in read_log(out) if isinstance(r, RunStart)).mixed_precision

    assert precision(tmp_path / "a", "no") == "no"
    assert precision(tmp_path / "b", "bf16") == "bf16"
    assert precision(tmp_path / "c", "no") == "no"


@pytest.mark.parametrize("native", [True, False])
def test_auto_precision_is_bf16_where_the_device_multiplies_it_natively(monkeypatch, models, tmp_path, native):
    """``auto`` takes bf16 autocast on any device that computes bfloat16 natively (a CPU with AMX is
    1.6x faster a step), float32 elsewhere; ``no`` and ``bf16`` are taken as given."""
    import mha2gqa.uptrain.setup as setup

    monkeypatch.setattr("mha2gqa.core.models.computes_bf16", lambda device: native)
    given = {mp: _settings(models, tmp_path, mixed_precision=mp) for mp in PRECISIONS}
    chosen = {mp: setup.accelerator(s).mixed_precision for mp, s in given.items()}
    assert chosen == {"auto": "bf16" if native else "no", "no": "no", "bf16": "bf16"}


def test_computes_bf16_asks_the_device():
    """A CPU answers from its instruction set (AMX tiles or AVX512-BF16: Linux lists them as flags), a
    device that is neither CPU nor GPU never."""
    from mha2gqa.core.models import computes_bf16

    info = Path("/proc/cpuinfo")
    if not info.is_file():
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    flags = set(next(line for line in info.read_text().splitlines() if line.startswith("flags")).split())
    assert computes_bf16(torch.device("cpu")) is bool(flags & {"amx_tile", "avx512_bf16"})
    assert computes_bf16(torch.device("meta")) is False


# ---- bad input ----------------------------------------------------------------------------------


def _cli_error(args: list[str]) -> str:
    r = CliRunner().invoke(main, ["uptrain", *args])
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output and r.output.startswith("Error: ")
    assert r.output.count("\n") == 1
    return r.output


def test_bad_inputs_are_one_line_errors(models, tmp_path):
    student, text = str(models["student"]), str(models["text"])
    base = ["--data", text, "--seq-len", "32", "--max-steps", "2", "-q"]
    other_text = tmp_path / "other.txt"
    other_text.write_text("\n".join(f"a quick brown fox {i} jumps over lazy dogs" for i in range(200)))
    other = llama_with_tokenizer(tmp_path / "other", other_text)
    assert "tokenizer mismatch" in _cli_error(
        [student, *base, "--output", str(tmp_path / "a"), "--objective", "kd", "--teacher", str(other)]
    )
    assert "not GQA-shaped" in _cli_error(
        [str(models["parent"]), *base, "--output", str(tmp_path / "b"), "--train", "kv"]
    )
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("the cat")
    assert "too little text for one training window" in _cli_error(
        [student, "--data", str(tiny), "--seq-len", "32", "--output", str(tmp_path / "c"), "-q"]
    )
    assert "pass --teacher" in _cli_error([student, *base, "--output", str(tmp_path / "d"), "--objective", "kd"])
    assert "multiple of --grad-accum" in _cli_error(
        [student, *base, "--output", str(tmp_path / "e"), "--batch-size", "6", "--grad-accum", "4"]
    )
    assert "is (or contains) the student model" in _cli_error([student, *base, "--output", student])
    assert "choose auto, cpu, cuda or cuda:N" in _cli_error(
        [student, *base, "--output", str(tmp_path / "f"), "--device", "gpu0"]
    )
    for name in ("a", "b", "c", "d", "e", "f"):
        assert not (tmp_path / name).exists()  # refused before anything was written


def test_an_existing_run_is_never_clobbered(models, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    args = [
        str(models["student"]),
        "--data",
        str(models["text"]),
        *["--seq-len", "32", "--max-steps", "2", "--output"],
        str(out),
        "-q",
    ]
    assert "pass --resume" in _cli_error(args)
    assert (out / "keep.txt").read_text() == "precious"
    assert "was not written by mha2gqa" in _cli_error([*args, "--overwrite"])  # not ours: never replaced
    assert "was not written by mha2gqa" in _cli_error([*args, "--resume"])
    assert (out / "keep.txt").read_text() == "precious"
    ours = tmp_path / "ours"
    r = CliRunner().invoke(main, ["uptrain", *args[:-3], "--output", str(ours), "-q"])
    assert r.exit_code == 0, r.output
    (ours / "leftover.txt").write_text("from the previous run")
    r = CliRunner().invoke(main, ["uptrain", *args[:-3], "--output", str(ours), "-q", "--overwrite"])
    assert r.exit_code == 0, r.output
    assert not (ours / "leftover.txt").exists() and (ours / "config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_resume_with_other_settings_is_refused(models, tmp_path):
    out = tmp_path / "run"
    uptrain(str(models["student"]), _settings(models, out, max_steps=4, stop_after=2, eval_data=None), log=_quiet)
    with pytest.raises(Mha2GqaError, match=r"--resume: lr is 0\.001 here but 0\.003"):
        uptrain(
            str(models["student"]),
            _settings(models, out, max_steps=4, lr=1e-3, resume=True, eval_data=None),
            log=_quiet,
        )


def test_train_all_needs_no_family_definition(tmp_path, models):
    """--train all works for any causal LM with a tokenizer (GPT-2 has no family definition here)."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    folder = save(GPT2LMHeadModel(cfg), tmp_path / "gpt2")
    AutoTokenizer.from_pretrained(models["parent"]).save_pretrained(folder)
    result = uptrain(str(folder), _settings(models, tmp_path / "run", max_steps=3), log=_quiet)
    assert result.complete and result.evals[-1].ppl < result.evals[0].ppl
    with pytest.raises(Mha2GqaError, match="unsupported model family"):
        uptrain(str(folder), _settings(models, tmp_path / "run2", train="attention"), log=_quiet)


# ---- the real model -----------------------------------------------------------------------------


def _stories_run(tmp_path: Path, method: str, **settings) -> list[dict]:
    """stories260K converted to 1 KV head by ``method`` (calibrated on the first half of the text) and
    uptrained with the default objective on its first 85% at 8 x 256, lr 1e-3, evaluated on
    the rest against the original; returns the evaluations."""
    text = (FIXTURES / "text" / "tinystories_train_head.txt").read_text(encoding="utf-8")
    cut = int(len(text) * 0.85)
    for name, body in {"train": text[:cut], "calib": text[: len(text) // 2], "held": text[cut:]}.items():
        (tmp_path / f"{name}.txt").write_text(body)
    calibration = dict(calibration=str(tmp_path / "calib.txt"), calibration_tokens=32768, calibration_seq_len=512)
    student = convert_checkpoint(FIXTURES / "stories260K", tmp_path / method, 1, method, progress=False, **calibration)
    base = dict(
        data=str(tmp_path / "train.txt"),
        output=str(tmp_path / f"{method}-up"),
        seq_len=256,
        batch_size=8,
        lr=1e-3,
        eval_data=str(tmp_path / "held.txt"),
        teacher=str(FIXTURES / "stories260K"),
        progress=False,
    )
    return uptrain(str(student.output), UptrainSettings(**base, **settings), log=_quiet).evals


@requires_fixtures("stories260K", "text/tinystories_train_head.txt")
def test_stories260k_one_kv_head_recovers_quickly_from_svd(tmp_path):
    """The issue's setting, shortened: svd -> 1 KV head, 60 steps of 8 x 256 on the first 85% of the
    text at lr 1e-3, evaluated on the rest. (The 300-step curves are benchmarks/uptrain_recovery.py.)"""
    ratios = [e.ppl_ratio for e in _stories_run(tmp_path, "svd", max_steps=60, eval_every=30, eval_tokens=16384)]
    assert ratios[0] > 3.0  # svd alone: about x3.7
    assert ratios[-1] < 1.5  # 60 steps: about x1.4


@pytest.mark.slow
@requires_fixtures("stories260K", "text/tinystories_train_head.txt")
def test_stories260k_acceptance_300_steps(tmp_path):
    """The issue's acceptance run in full (~4 min on 2 cores; `pytest -m slow`): svd <= x1.3 and mean
    <= x1.7 after 300 steps, and svd passes mean's 300-step perplexity within 50 steps."""
    ratios = {}
    for method in ("svd", "mean"):
        evals = _stories_run(tmp_path, method, max_steps=300, eval_every=50, eval_tokens=None)
        ratios[method] = {e.step: e.ppl_ratio for e in evals}
    assert ratios["svd"][300] <= 1.3 and ratios["mean"][300] <= 1.7
    assert ratios["svd"][50] <= ratios["mean"][300]


def test_default_evaluation_is_scaled_to_the_run_and_an_expensive_one_is_said():
    from mha2gqa.uptrain.eval_budget import EVAL_SHARE, MAX_EVAL_TOKENS, eval_budget, evaluations

    assert evaluations(30, 3) == 11 and evaluations(30, 7) == 6  # step 0, every 7th, and the last
    # 30 steps of 8 x 256 tokens with a live kd teacher: 61,440 x 4 = 245,760 units; 11 evaluations x 2 models
    b = eval_budget(30, 2048, 3, 256, teacher_trains=True, teacher_scores=True, asked=None, available=10**6)
    assert b.tokens == 2048 and b.count == 11  # 0.2 x 245,760 / 22 = 2,234.2 -> whole windows of 256
    assert abs(b.share - 11 * 2048 * 2 / (11 * 2048 * 2 + 245_760)) < 1e-12 and b.share <= EVAL_SHARE
    assert "2,048 tokens x 11 evaluations, about 15% of the run's compute (by default" in b.line(asked=False)
    asked = eval_budget(30, 2048, 3, 256, teacher_trains=True, teacher_scores=True, asked=65536, available=10**6)
    assert asked.tokens == 65536 and asked.share > 0.5 and "(--eval-tokens)" in asked.line(asked=True)
    long = eval_budget(10**5, 2048, 10**4, 256, teacher_trains=False, teacher_scores=False, asked=None, available=10**6)
    assert long.tokens == MAX_EVAL_TOKENS  # a long run's evaluations stop growing
    short = eval_budget(1, 64, 1, 256, teacher_trains=False, teacher_scores=False, asked=None, available=10**6)
    assert short.tokens == 256  # one window at least
    assert eval_budget(30, 2048, 3, 256, False, False, None, available=700).tokens == 512  # what there is, whole


# ---- the guard: the published model is the best the held-out evaluations scored -----------------


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(Path(folder) / "model.safetensors")


def test_guard_undoes_a_run_that_hurts_and_fail_or_off_say_otherwise(models, tmp_path):
    """A learning rate of 1 wrecks the student: the guard publishes it as given (bit for bit), and
    the record, card and summary say undone; ``fail`` refuses to publish; ``off`` publishes the wreck."""
    hurt = dict(objective="kd", teacher=str(models["parent"]), lr=1.0, max_steps=6, eval_every=3)
    out = tmp_path / "on"
    result = uptrain(str(models["student"]), _settings(models, out, **hurt), log=_quiet)
    guard = result.guard
    assert guard.outcome == "undone" and guard.step == 0 and guard.figure == "KL" and guard.last > guard.before
    assert guard.before == result.evals[0].kl_mean and guard.published == guard.before
    student = _weights(models["student"])
    published = _weights(out)
    assert published.keys() == student.keys() and all(torch.equal(published[k], student[k]) for k in student)
    record = UptrainRecord.read(out)
    assert record.guard == guard and record.steps == 0 and record.last_eval == result.evals[0]
    assert "| guard | undone - held-out KL" in (out / "README.md").read_text()
    for field, value, said in (("outcome", "improved", "outcome 'improved'"), ("step", 4, "step 4 cannot be published"),
                               ("before", float("nan"), "a figure is not a non-negative number")):  # fmt: skip
        tampered = json.loads(record.to_json())
        tampered["uptrain"]["guard"][field] = value
        with pytest.raises(Mha2GqaError, match=f"x.json: damaged uptraining record \\(uptrain.guard: {said}"):
            UptrainRecord.from_dict(tampered, "x.json")
    assert "guard: undone - held-out KL" in result.summary()
    assert (out / "mha2gqa_conversion.json").is_file()
    info = load_model(str(out), torch.device("cpu"), torch.float32).describe()  # as results and tables name it
    assert (info.uptrain_outcome, info.recipe) == ("undone", "mean+uptrain(undone)")
    assert typed.read(ModelInfo, json.loads(json.dumps(info.to_dict())), "m") == info
    with pytest.raises(Mha2GqaError, match=r"m.uptrain_outcome is 'improved', not one of 'kept', 'kept in part'"):
        typed.read(ModelInfo, {**info.to_dict(), "uptrain_outcome": "improved"}, "m")
    tampered = json.loads((out / UPTRAIN_RECORD).read_text())
    tampered["uptrain"]["guard"]["outcome"] = "improved"
    (tmp_path / "tampered").mkdir()
    (tmp_path / "tampered" / UPTRAIN_RECORD).write_text(json.dumps(tampered))
    with pytest.raises(Mha2GqaError, match=r"tampered/mha2gqa_uptrain.json: damaged uptraining record \(uptrain"):
        published_outcome(tmp_path / "tampered")
    end = read_log(out)[-1]  # the log says which model the run published, and the report shows it
    assert isinstance(end, RunEnd) and (end.step, end.published, end.guard) == (6, 0, guard.line())
    assert "| step 0: undone (the student) |" in recovery_table([RunHistory.read(out)]).markdown()
    log = out / "uptrain_log.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("\n".join([*lines[:-1], lines[-1].replace('"published": 0', '"published": 7')]) + "\n")
    with pytest.raises(
        Mha2GqaError, match=r"uptrain_log.jsonl: line \d+ \(end\).published is 7, not a step from 0 to 6"
    ):
        read_log(out)

    failed = tmp_path / "fail"
    with pytest.raises(
        Mha2GqaError, match=r"did not help \(held-out KL .* -> .*\); with --guard fail no final model is written"
    ):
        uptrain(str(models["student"]), _settings(models, failed, guard="fail", **hurt), log=_quiet)
    assert not (failed / "config.json").exists() and checkpoint_dirs(failed)

    off = tmp_path / "off"
    unguarded = uptrain(str(models["student"]), _settings(models, off, guard="off", **hurt), log=_quiet)
    assert unguarded.guard is None and UptrainRecord.read(off).steps == 6
    assert published_outcome(off) is None and published_outcome(tmp_path) is None  # not judged; no record
    assert "published" not in json.loads((off / "uptrain_log.jsonl").read_text().splitlines()[-1])
    assert "| step 6 |" in recovery_table([RunHistory.read(off)]).markdown()
    assert not torch.equal(
        _weights(off)["model.layers.0.self_attn.k_proj.weight"], student["model.layers.0.self_attn.k_proj.weight"]
    )


def test_guard_keeps_an_earlier_checkpoint_across_a_resume(models, tmp_path, monkeypatch):
    """Held-out scores that are best at step 3 of 12 (a run that passed its best): the pruning spares
    step 3's checkpoint through a stop and a resume, and its model is what the run publishes."""
    from mha2gqa.uptrain import guard as guard_module

    scores = {0: 5.0, 3: 1.0, 6: 3.0, 9: 4.0, 12: 2.0}
    monkeypatch.setattr(guard_module.Figure, "of", lambda self, ev: scores[ev.step])
    common = dict(max_steps=12, eval_every=3, save_total_limit=1)
    out = tmp_path / "run"
    uptrain(str(models["student"]), _settings(models, out, stop_after=6, **common), log=_quiet)
    assert [s for s, _ in checkpoint_dirs(out)] == [3, 6]
    step3 = _weights(checkpoint_dirs(out)[0][1])
    result = uptrain(str(models["student"]), _settings(models, out, resume=True, **common), log=_quiet)
    assert [s for s, _ in checkpoint_dirs(out)] == [3, 12]
    assert result.guard.outcome == "kept in part" and (result.guard.step, result.guard.published) == (3, 1.0)
    assert (result.guard.before, result.guard.last) == (5.0, 2.0)
    published = _weights(out)
    assert all(torch.equal(published[k], step3[k]) for k in step3)
    record = UptrainRecord.read(out)
    assert record.steps == 3 and record.last_eval.step == 3 and record.guard == result.guard
    assert "| guard | step 3 of 12 kept - held-out perplexity 5 -> 2; step 3: 1 |" in (out / "README.md").read_text()
    assert "| step 3 of 12: the best |" in recovery_table([RunHistory.read(out)]).markdown()
    assert published_outcome(out) == "kept in part"
    assert load_model(str(out), torch.device("cpu"), torch.float32).describe().recipe.endswith("+uptrain(in part)")


def test_guard_chooses_by_the_runs_objective():
    """Hand-made evaluations: ce compares perplexity, kd the KL, mix the weighted sum; no KL measured
    (a cached teacher): perplexity; not finite: the worst; ties to the earlier model; no step 0: None."""
    from mha2gqa.uptrain.guard import Figure, best_so_far, choose

    def ev(step, ppl, kl=None):
        return RunEval(step=step, tokens=0, nll=math.log(ppl), ppl=ppl, eval_tokens=64, kl_mean=kl)

    evals = [ev(0, 10.0, 0.5), ev(2, 12.0, 0.2), ev(4, 9.0, 0.3)]
    assert choose(evals, 4, [2], Figure("ce")).outcome == "kept"  # perplexity 9 < 10 < 12
    kd = choose(evals, 4, [2], Figure("kd"))
    assert (kd.outcome, kd.step, kd.figure, kd.before, kd.last) == ("kept in part", 2, "KL", 0.5, 0.3)
    assert choose(evals, 4, [], Figure("kd")).step == 4  # step 2's model was not kept
    mix = choose(evals, 4, [2], Figure("mix", 0.5))  # 0.5 ln(ppl) + 0.5 KL: 1.401, 1.342, 1.249
    assert mix.step == 4 and mix.before == pytest.approx(0.5 * math.log(10) + 0.25)
    cached = [ev(0, 10.0), ev(4, 11.0)]
    assert choose(cached, 4, [], Figure("kd")).outcome == "undone"
    assert choose(cached, 4, [], Figure("kd")).figure == "perplexity"
    assert choose([ev(0, 10.0), ev(4, 10.0)], 4, [], Figure("ce")).outcome == "undone"  # no better: undone
    assert choose([ev(0, 10.0), ev(4, math.inf)], 4, [], Figure("ce")).last == math.inf
    assert choose([ev(4, 9.0)], 4, [], Figure("ce")) is None
    assert best_so_far(evals, Figure("kd")) == 2 and best_so_far(evals[:1], Figure("kd")) is None


def test_guard_fail_without_held_out_text_is_refused(models, tmp_path):
    student, text = str(models["student"]), str(models["text"])
    argv = [student, "--data", text, "--seq-len", "32", "--max-steps", "2", "-q", "--guard", "fail"]
    assert "--guard fail judges the run on held-out text: give --eval-data" in _cli_error(
        [*argv, "--output", str(tmp_path / "g")]
    )
    assert not (tmp_path / "g").exists()


def test_heldout_tokens_evaluate_on_the_datas_tail_and_never_train_on_it(models, tmp_path):
    """``--heldout-tokens N``: the last N tokens of --data are the evaluation (and guard) text, and no
    training window reads them; with --eval-data, or more than the text can spare, one-line errors."""
    from mha2gqa.uptrain.prepare import prepare

    held = prepare(
        str(models["student"]), _settings(models, tmp_path / "h", eval_data=None, heldout_tokens=256), 1, _quiet
    )
    whole = prepare(str(models["student"]), _settings(models, tmp_path / "w", eval_data=None), 1, _quiet)
    total = held.store.total
    assert whole.store.total == total and not whole.eval_windows
    assert held.num_windows == (total - 256 - 1) // 32 and held.num_windows * 32 + 1 <= total - 256
    tail = torch.from_numpy(held.store.tokens(total - 256, 256))
    windows = torch.cat([ids for ids, _ in held.eval_windows])
    assert len(held.eval_windows) >= 1 and torch.equal(windows, tail[: windows.numel()])
    student, text = str(models["student"]), str(models["text"])
    base = [student, "--data", text, "--seq-len", "32", "--max-steps", "2", "-q"]
    assert "--heldout-tokens evaluates on --data's last tokens: give it or --eval-data" in _cli_error(
        [*base, "--output", str(tmp_path / "a"), "--heldout-tokens", "64", "--eval-data", str(models["held"])]
    )
    assert f"--heldout-tokens {total:,} leaves 0 of --data's {total:,} tokens" in _cli_error(
        [*base, "--output", str(tmp_path / "b"), "--heldout-tokens", str(total)]
    )
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
