"""No stage a job runs is silent for more than one unit of its work: between two things the user sees
(a log line, an update of a shown progress bar), at most one layer's work (calibration, refit) or one
generation, batch or step of the whole model. Counted on the hooks, not on time: work is decoder-layer
forward calls, so the test holds on a loaded machine and at any speed. A shown bar's update reaches the
user at most :data:`~mha2gqa.core.progress.PLAIN_SECONDS` later (a plain line in the job's log), so
a stage is silent for at most that plus one unit."""

from __future__ import annotations

import collections
import dataclasses

import torch

#: Tokens of each sample generation and probe continuation here: the largest unit of work of the whole
#: model (one forward a token)
UNIT = 6


def _layer_key(module: torch.nn.Module) -> object:
    """A decoder layer's index (the original's, the student's and the teacher's layer ``i`` are one
    layer's work), else the module itself."""
    attention = getattr(module, "self_attn", None)
    return getattr(attention, "layer_idx", None) if attention is not None else module


def test_no_stage_of_a_demo_job_does_more_than_one_unit_of_work_unheard(tmp_path, monkeypatch):
    from tqdm import std

    from mha2gqa.jobs import DemoRequest, run_job

    monkeypatch.setenv("MHA2GQA_CACHE", str(tmp_path))
    job = DemoRequest(steps=3, num_kv_heads=(2,), methods=("svd+refit+distill",), uptrain_steps=4).job()
    job.eval = dataclasses.replace(job.eval, sample_tokens=UNIT, greedy_tokens=UNIT)
    events: list[tuple[str, object]] = []
    real_update = std.tqdm.update

    def update(self, n=1):
        if not self.disable:
            events.append(("heard", f"bar {self.desc}"))
        return real_update(self, n)

    def forward(module, args, output):
        if type(module).__name__.endswith("DecoderLayer"):
            events.append(("work", _layer_key(module)))

    monkeypatch.setattr(std.tqdm, "update", update)
    handle = torch.nn.modules.module.register_module_forward_hook(forward)
    try:
        run_job(job, tmp_path / "run", log=lambda line: events.append(("heard", line)))
    finally:
        handle.remove()
    stretches, after = [(collections.Counter(), "start")], []
    for kind, what in events:
        if kind == "work":
            stretches[-1][0][what] += 1
        else:
            after.append(what)
            stretches.append((collections.Counter(), what))
    work = sum(sum(c.values()) for c, _ in stretches)
    assert work > 1000 and len(stretches) > 100  # (the job ran: conversion, refit, distillation, evaluations)
    for (layers, before), then in zip(stretches, [*after, "end"], strict=True):
        if len(layers) > 1:  # the whole model's work: one generation, batch or step at most
            assert max(layers.values()) <= UNIT, (dict(layers), before, then)
    heard = [what for kind, what in events if kind == "heard"]
    for stage in ("bar guard:", "bar refitting", "bar teacher pass", "bar disjoint", "bar attention similarity",
                  "bar samples", "bar generative probe", "  layer 3: held-out error"):  # fmt: skip
        assert any(str(h).startswith(stage) for h in heard), stage
