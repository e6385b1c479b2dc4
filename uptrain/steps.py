"""One uptraining step and what the loop records: forward and backward over a step's micro-batches,
the train record's running sums, and the held-out evaluation."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from mha2gqa.core.runlog import RunEval, RunTrain
from mha2gqa.uptrain.objectives import combined
from mha2gqa.uptrain.settings import UptrainSettings
from mha2gqa.uptrain.teacher_cache import CachedTeacher


def accumulate(acc, model, teacher, fetch, micro_batches, s: UptrainSettings):
    """Forward and backward over this process's micro-batches of one step (``[micro]`` window indices
    each, ``fetch`` gives their ``[micro, seq_len + 1]`` tokens), gradients synchronised on the last
    only; ``teacher(k, inputs)``: micro-batch k's teacher logits or cached top-K form. Returns the
    mean loss and parts."""
    loss_sum, parts_sum = 0.0, {}
    n = len(micro_batches)
    for k, idx in enumerate(micro_batches):
        chunk = fetch(idx).to(acc.device)
        inputs, targets = chunk[:, :-1], chunk[:, 1:]
        if s.sharded:
            model.set_requires_gradient_sync(k == n - 1)
            sync = contextlib.nullcontext()
        else:
            sync = contextlib.nullcontext() if k == n - 1 else acc.no_sync(model)
        with sync, acc.autocast():
            logits = model(input_ids=inputs, use_cache=False).logits
            target = None
            if s.objective != "ce":
                with torch.no_grad():
                    target = teacher(k, inputs)
                if isinstance(target, dict):
                    target = {name: v.to(acc.device) for name, v in target.items()}
            loss, parts = combined(s.objective, logits, targets, target, s.kd_weight, s.temperature)
            acc.backward(loss / n)
        loss_sum += float(loss.detach()) / n
        for name, v in parts.items():
            parts_sum[name] = parts_sum.get(name, 0.0) + v / n
    return loss_sum, parts_sum


class TrainWindow:
    """Loss and timing sums between two train records (evaluations and checkpoints not timed)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.count, self.seconds = 0, 0.0

    def add(self, loss: float, parts: dict[str, float], seconds: float) -> None:
        for k, v in {"loss": loss, **parts}.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.count += 1
        self.seconds += seconds

    def record(
        self, step: int, tokens_per_step: int, epoch: float, lr: float, grad_norm, peak_memory_mib: list[float]
    ) -> RunTrain:
        sums = {k: v / self.count for k, v in self.sums.items()}
        rec = RunTrain(
            step=step,
            tokens=step * tokens_per_step,
            epoch=round(epoch, 4),
            loss=sums.pop("loss"),
            lr=lr,
            grad_norm=float(grad_norm) if grad_norm is not None else None,
            tokens_per_second=self.count * tokens_per_step / max(self.seconds, 1e-9),
            step_seconds=self.seconds / self.count,
            peak_memory_mib=peak_memory_mib,
            parts=sums,
        )
        self.__init__()
        return rec


@torch.no_grad()
def evaluate_heldout(
    acc, model, teacher, windows, batch_size: int, *, step: int, tokens: int, seq_len: int | None
) -> RunEval:
    """Held-out perplexity of the student (and the teacher's, with KL and top-1 agreement to it) at
    ``step`` (``tokens`` trained so far), windows split over processes; the harness's scoring pass."""
    from mha2gqa.eval.harness import scored_pass

    model.eval()
    try:
        with acc.autocast():
            models = [teacher, model] if teacher is not None else [model]
            res = scored_pass(models, windows, batch_size, progress=False, desc="eval")
    finally:
        model.train()
    nll = res.nll(len(models) - 1)
    ppl = math.exp(nll)
    scores = RunEval(step=step, tokens=tokens, seq_len=seq_len, nll=nll, ppl=ppl, eval_tokens=res.tokens)
    if teacher is None:
        return scores
    teacher_ppl = math.exp(res.nll(0))
    return replace(
        scores,
        teacher_ppl=teacher_ppl,
        ppl_ratio=ppl / teacher_ppl,
        kl_mean=res.agreement.kl.mean,
        top1_agreement=res.agreement.top1_agreement,
    )


def peak_memory_mib(acc) -> list[float]:
    """Each process's peak memory so far in MiB (CUDA allocations on a GPU, else resident memory), in
    rank order. Collective."""
    from mha2gqa.core.memory import peak_memory
    from mha2gqa.core.ranks import ranks

    return ranks().gather(round(peak_memory(acc.device) / 2**20, 1))


def teacher_targets(
    cached: CachedTeacher | None, teacher: torch.nn.Module | None, step: int, first: int, micro: int
) -> Callable[[int, torch.Tensor], Any] | None:
    """``(k, inputs) ->`` micro-batch k's teacher logits (a live ``teacher``) or its rows of the
    ``cached`` teacher's outputs for ``step`` (this process's rows start at ``first``); None without
    a teacher."""
    if cached is not None:
        return lambda k, _: cached.targets(step - 1, slice(first + k * micro, first + (k + 1) * micro))
    if teacher is not None:
        return lambda k, inputs: teacher(input_ids=inputs, use_cache=False).logits
    return None
