"""The uptraining loop: a converted GQA model trained on text by cross-entropy, distillation from
its MHA parent, or both, with ``accelerate`` for devices, processes and mixed precision.

``--batch-size`` is the *global* batch of one optimizer step (sequences); it is split over
``accelerate`` processes and ``--grad-accum`` micro-batches, so one command gives the same run on
one device or many. Which windows a step reads depends only on ``(seed, step)``, and checkpoints
hold the optimizer, scheduler and RNG state, so a resumed run continues the same trajectory.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mha2gqa.core.checkpoint import portable_model
from mha2gqa.core.conversion_record import UNDONE, GuardMode, read_conversion_record
from mha2gqa.core.dtypes import by_name
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.records import UPTRAIN_LOG, now
from mha2gqa.core.runlog import RunEnd, RunEval, RunLog, RunResume, RunStart, read_log
from mha2gqa.core.signals import check as check_signals
from mha2gqa.core.uptrain_guard import UptrainGuard
from mha2gqa.uptrain.checkpoints import (
    StepFiles,
    check_output,
    checkpoint_dirs,
    final_from_checkpoint,
    final_from_student,
    prepare_output,
    save_checkpoint,
    save_final,
)
from mha2gqa.uptrain.data import WindowOrder
from mha2gqa.uptrain.guard import Figure, best_so_far, choose
from mha2gqa.uptrain.prepare import Uptraining, check_resume, prepare, resume_point
from mha2gqa.uptrain.record import UptrainRecord, portable_settings, training_text_ref
from mha2gqa.uptrain.settings import UptrainSettings
from mha2gqa.uptrain.setup import accelerator, cached_teacher, load_models, load_state, optimizing, rank_rows
from mha2gqa.uptrain.sharding import save_optimizer, zero_rows
from mha2gqa.uptrain.steps import TrainWindow, accumulate, evaluate_heldout, peak_memory_mib, teacher_targets


@dataclass
class UptrainResult:
    """What :func:`uptrain` did."""

    output: Path
    steps: int
    total_steps: int
    tokens: int
    complete: bool
    evals: list[RunEval] = field(default_factory=list)
    seconds: float = 0.0
    teacher_cache: Path | None = None  # set when the run was only the teacher pass (--teacher-only)
    processes: int = 1
    sharded: bool = False  # --sharding fsdp: parameters, gradients and optimizer state sharded over the processes
    guard: UptrainGuard | None = None  # --guard's decision on the finished run (None: off, or nothing measured)

    def summary(self) -> str:
        if self.teacher_cache is not None:
            return f"teacher pass done in {self.seconds:.1f} s: {self.teacher_cache} (train with the same settings)"
        state = "done" if self.complete else f"stopped at step {self.steps} of {self.total_steps} (--resume continues)"
        how = f" on {self.processes} processes" if self.processes > 1 else ""
        how += (" (FSDP: sharded)" if self.processes > 1 else " (FSDP)") if self.sharded else ""
        line = (
            f"uptrain {state}: {self.steps:,} steps, {self.tokens:,} tokens{how} in {self.seconds:.1f} s -> "
            f"{self.output}"
        )
        if self.evals:
            first, last = self.evals[0], self.evals[-1]
            line += f"; held-out perplexity {first.ppl:.4f} (step {first.step}) -> {last.ppl:.4f}"
            if last.ppl_ratio is not None:
                line += f" (x{last.ppl_ratio:.3f} the teacher, KL {last.kl_mean:.4f})"
        if self.guard is not None:
            line += f"; guard: {self.guard.line()}"
        return line


#: what sees each checkpoint of a run as it is written: ``watch(step, folder)``, on every process
Watch = Callable[[int, Path], None]


@dataclass
class UptrainPlan:
    """One uptraining run decided and checked (:func:`prepare_uptrain`), before any weights load or
    anything is written: the settings, the processes, the windows (:class:`Uptraining`), and where a
    resumed run starts."""

    student: str
    settings: UptrainSettings
    acc: Any  # accelerate.Accelerator
    up: Uptraining
    resume_from: Path | None
    start_step: int
    say: Callable[[str], None]
    started: float


def prepare_uptrain(student: str, settings: UptrainSettings, log: Callable[[str], None] = print) -> UptrainPlan:
    """Every check of an uptraining run (settings, models, data, output folder, the checkpoint to
    resume from) before any work: a bad input fails here in one line, nothing loaded or written."""
    from mha2gqa.core.checkpoint import check_loadable, check_models

    started = time.perf_counter()
    s = settings.check()
    check_models(CONVERTED=student, **{"--teacher": s.teacher})
    check_loadable("the student", student)
    if s.teacher:
        check_loadable("--teacher", s.teacher)
    acc = accelerator(s)
    say = log if acc.is_main_process else (lambda *_: None)
    up = prepare(student, s, acc.num_processes, say)
    inputs = {
        "the student model": up.student_folder,
        "the --teacher model": up.teacher_folder,
        "the --data text": s.data,
        "the --eval-data text": s.eval_data,
    }
    output = Path(s.output)
    if not s.teacher_only:  # (a teacher pass writes only the cache)
        check_output(output, s.resume, s.overwrite, inputs)
    resume_from, start_step = resume_point(output, s.resume and not s.teacher_only, up.run)
    if resume_from is not None:  # its weights whole before anything loads
        check_resume(resume_from)
    return UptrainPlan(student, s, acc, up, resume_from, start_step, say, started)


class _Trainer:
    """One run's state and its named stages: log records, evaluations, checkpoints, the step loop."""

    def __init__(self, plan: UptrainPlan, watch: Watch | None = None) -> None:
        from accelerate.utils import set_seed

        self.watch = watch

        s, up, acc, student = plan.settings, plan.up, plan.acc, plan.student
        self.student, self.s, self.started, self.acc, self.up, self.say = student, s, plan.started, acc, up, plan.say
        self.main = acc.is_main_process
        self.output = Path(s.output)
        self.tokens_per_step = s.batch_size * up.seq_len
        self.resume_from, self.start_step = plan.resume_from, plan.start_step
        self.text = training_text_ref(s.data, s.text_field)  # the records name the text portably
        set_seed(s.seed)
        self.order = WindowOrder(up.num_windows, s.batch_size, s.seed)
        self.cached = cached_teacher(up, s, acc, self.order, self.say) if s.teacher_top_k else None
        if s.teacher_only:
            return
        teacher = f" and the teacher {s.teacher}" if s.teacher and not self.cached else ""
        self.say(f"loading the student {student}{teacher} ({up.num_windows:,} training windows ready)")
        model, self.trainable, self.teacher = load_models(up, s, acc, self.resume_from)
        self.conv_record = read_conversion_record(up.student_folder)
        if self.main:  # everything is checked: now the output folder may be written
            prepare_output(self.output, s.resume, s.overwrite)
        acc.wait_for_everyone()
        self.model, self.optimizer, self.scheduler = optimizing(acc, model, self.trainable, s, up.total)
        if self.resume_from is not None:
            load_state(acc, self.resume_from, (self.model, self.optimizer) if s.sharded else None)
        self.log = RunLog(self.output / UPTRAIN_LOG, self.main, self.start_step if self.resume_from else None)
        # every evaluation of the run so far (a resumed run's earlier ones come from its log)
        resumed = self.start_step and self.main
        self.evals = [r for r in read_log(self.output / UPTRAIN_LOG) if isinstance(r, RunEval)] if resumed else []

    def announce(self) -> None:
        """The start (or resume) record and the opening lines."""
        s, up, acc = self.s, self.up, self.acc
        total_params = sum(p.numel() for p in self.model.parameters())
        if self.resume_from is not None:
            self.say(f"resuming from {self.resume_from} (step {self.start_step:,})")
            self.log.write(RunResume(self.start_step, now(), str(self.resume_from)))
        else:
            if s.resume:
                self.say(f"--resume: no checkpoint in {self.output}; starting from step 0")
            self.log.write(
                RunStart(  # the log travels with the model: no folder of this machine in it
                    created=now(),
                    student=portable_model(self.student),
                    teacher=portable_model(s.teacher) if s.teacher else None,
                    settings=portable_settings(up.run),
                    windows=up.num_windows,
                    tokens_per_step=self.tokens_per_step,
                    total_steps=up.total,
                    trainable_parameters=self.trainable.count,
                    parameters=total_params,
                    num_heads=up.dims.num_heads,
                    num_kv_heads=up.dims.num_kv_heads,
                    processes=acc.num_processes,
                    device=str(acc.device),
                    mixed_precision=acc.mixed_precision,
                    eval_seq_len=up.eval_seq_len,
                )
            )
        self.say(
            f"uptrain: {self.trainable.count:,} of {total_params:,} parameters ({s.train}), objective "
            f"{s.objective}, {up.num_windows:,} windows of {up.seq_len}, {up.total:,} steps x "
            f"{s.batch_size} on {acc.num_processes} x {acc.device} "
            f"({'full precision' if acc.mixed_precision == 'no' else acc.mixed_precision + ' mixed precision'})"
        )
        if s.guard != "off" and not up.eval_windows:
            self.say("note: no --eval-data: --guard cannot check the run; the last step's model is published unchecked")
        if up.max_positions and up.seq_len < up.max_positions:
            self.say(
                f"note: training windows of {up.seq_len} tokens do not reach positions {up.seq_len}-"
                f"{up.max_positions - 1}; evaluate at the model's full length (--eval-seq-len) to see "
                "them"
            )

    def evaluate(self, step: int) -> None:
        if not self.up.eval_windows:
            return
        record = evaluate_heldout(
            self.acc,
            self.model,
            self.teacher,
            self.up.eval_windows,
            self.s.eval_batch_size or self.up.micro,
            step=step,
            tokens=step * self.tokens_per_step,
            seq_len=self.up.eval_seq_len,
        )
        self.evals.append(record)
        self.log.write(record)
        against = (
            f" (x{record.ppl_ratio:.3f} the teacher's, KL {record.kl_mean:.4f})" if record.ppl_ratio is not None else ""
        )
        self.say(f"step {step:,}/{self.up.total:,}: held-out perplexity {record.ppl:.3f}{against}")

    def model_files(self, step: int, guard: UptrainGuard | None = None) -> dict[str, str]:
        """Model card, uptraining record and conversion record of the model at ``step`` (``guard``: the
        guard's decision that publishes it)."""
        evals = [ev for ev in self.evals if ev.step <= step]
        record = UptrainRecord(
            student=self.student,
            settings=self.up.run,
            steps=step,
            tokens=step * self.tokens_per_step,
            warmup_steps=self.s.warmup_steps,
            trainable_parameters=self.trainable.count,
            processes=self.acc.num_processes,
            mixed_precision=str(self.acc.mixed_precision),
            first_eval=evals[0] if evals else None,
            last_eval=evals[-1] if evals else None,
            guard=guard,
            text=self.text,
        )
        return record.portable(self.s.text_field).files(self.conv_record, self.up.student_folder)

    def checkpoint(self, step: int) -> None:
        """Checkpoint ``step``; shown to the watch (every process) unless it is the last step's, which the
        final model follows."""
        state = {
            "step": step,
            "tokens": step * self.tokens_per_step,
            "settings": self.up.run,
            "student": self.student,
            "source_dtype": self.up.source_dtype,
            "created": now(),
        }
        folder = save_checkpoint(
            self.acc,
            self.model,
            self.up.tokenizer,
            self.output,
            StepFiles(step, state, self.model_files(step)),
            self.s.save_total_limit,
            (lambda folder: save_optimizer(self.model, self.optimizer, folder)) if self.s.sharded else None,
            spare=best_so_far(self.evals, self.figure) if self.guarded_whole else None,
        )
        if self.watch is not None and step < self.up.total:
            self.watch(step, folder)

    def step(self, step: int) -> tuple[float, dict[str, float], Any]:
        """One optimizer step; returns its loss, the loss parts and the gradient norm."""
        s, micro, acc = self.s, self.up.micro, self.acc
        batch = self.order.batch(step - 1)
        mine = batch[rank_rows(s, acc)]
        fetch = lambda idx: self.up.store.windows(idx, self.up.seq_len)  # noqa: E731
        teacher = teacher_targets(self.cached, self.teacher, step, rank_rows(s, acc).start, micro)
        loss, parts = accumulate(acc, self.model, teacher, fetch, mine.split(micro), s)
        if s.sharded:  # the fused query rows' hooks went with the unsharded parameters
            for name, rows in self.trainable.masked_rows.items():
                zero_rows(self.trainable.param(name), rows)
        grad_norm = acc.clip_grad_norm_(self.trainable.params, s.max_grad_norm) if s.max_grad_norm > 0 else None
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        stats = torch.tensor([loss, *parts.values()], device=acc.device)
        stats = acc.reduce(stats, "mean") if acc.num_processes > 1 else stats
        if not all(math.isfinite(float(x)) for x in stats):
            raise Mha2GqaError(
                f"uptrain: the loss became {float(stats[0])} at step {step}; lower --lr or check the "
                "data and the model (nothing after the last checkpoint was kept)"
            )
        return float(stats[0]), {k: float(stats[i + 1]) for i, k in enumerate(parts)}, grad_norm

    def train(self) -> int:
        """The step loop from the start (or resume) step to the end or ``stop_after``; returns the last step."""
        from mha2gqa.core.progress import bar as progress_bar

        s, up = self.s, self.up
        if self.start_step == 0:
            self.evaluate(0)
        elif self.watch is not None and self.start_step < up.total:  # a stop may have come before the watch saw it
            self.watch(self.start_step, self.resume_from)
        stop = min(up.total, self.start_step + s.stop_after) if s.stop_after else up.total
        bar = progress_bar(
            total=up.total,
            initial=self.start_step,
            unit="step",
            desc="uptrain",
            disable=not (s.progress and self.main),
        )
        window = TrainWindow()
        step = self.start_step
        for step in range(self.start_step + 1, stop + 1):
            check_signals()
            t0 = time.perf_counter()
            loss, parts, grad_norm = self.step(step)
            window.add(loss, parts, time.perf_counter() - t0)
            bar.update(1)
            if step % s.log_every == 0 or step == stop:
                rec = window.record(
                    step,
                    self.tokens_per_step,
                    self.order.epoch(step),
                    self.scheduler.get_last_lr()[0],
                    grad_norm,
                    peak_memory_mib(self.acc),
                )
                self.log.write(rec)
                bar.set_postfix(loss=f"{rec.loss:.4f}", tok_s=f"{rec.tokens_per_second:,.0f}")
            if step % up.eval_every == 0 or step == up.total:
                self.evaluate(step)
            if step % up.save_every == 0 or step == stop:
                self.checkpoint(step)
        bar.close()
        return step

    @property
    def figure(self) -> Figure:
        """What the guard compares: the run's objective on the held-out text."""
        return Figure(self.s.objective, self.s.kd_weight)

    @property
    def guarded_whole(self) -> bool:
        """The guard may publish an earlier checkpoint: it is on, and checkpoints hold whole models (not
        LoRA adapters)."""
        return self.s.guard != "off" and not self.s.lora_rank

    def finish(self, step: int) -> UptrainResult:
        up = self.up
        complete = step >= up.total
        guard = self.judge(step) if complete else None
        result = UptrainResult(
            self.output,
            step,
            up.total,
            step * self.tokens_per_step,
            complete,
            self.evals,
            time.perf_counter() - self.started,
            processes=self.acc.num_processes,
            sharded=self.s.sharded,
            guard=guard,
        )
        if complete:
            self.publish(step, guard)
            published, line = (guard.step, guard.line()) if guard is not None else (None, None)
            self.log.write(RunEnd(step, step * self.tokens_per_step, now(), result.seconds, published, line))
        return result

    def judge(self, step: int) -> UptrainGuard | None:
        """The guard's decision on the run ended at ``step`` (made on the main process, given to every
        one; None: off, or nothing measured); ``--guard fail`` raises where the run did not help."""
        from mha2gqa.core.ranks import ranks

        if self.s.guard == GuardMode.OFF:
            return None
        kept = lambda: [at for at, _ in checkpoint_dirs(self.output)] if self.guarded_whole else []  # noqa: E731
        guard = ranks().decide(lambda: choose(self.evals, step, kept(), self.figure))
        if guard is None:
            return None
        if guard.outcome == UNDONE and self.s.guard == GuardMode.FAIL:
            raise Mha2GqaError(
                f"uptrain: the run did not help ({guard.moved}); with --guard fail no final model is written "
                f"(the checkpoints stay in {self.output}; --guard undo publishes the student as given)"
            )
        self.say(f"uptrain guard: {guard.line()}")
        return guard

    def publish(self, step: int, guard: UptrainGuard | None) -> None:
        """The final model into the output folder: the last step's, or the one ``guard`` chose (an
        earlier checkpoint's, or the student as given)."""
        at = guard.step if guard is not None else step
        files = self.model_files(at, guard)
        if at == step:
            dtype = by_name(self.up.source_dtype).torch if self.up.source_dtype else None
            save_final(self.acc, self.model, self.up.tokenizer, self.output, dtype, files, self.s.sharded)
            return
        if self.main:
            if at == 0:
                final_from_student(self.up.student_folder, self.output, files)
            else:
                final_from_checkpoint(dict(checkpoint_dirs(self.output))[at], self.output, files)
        self.acc.wait_for_everyone()


def run_uptrain(plan: UptrainPlan, watch: Watch | None = None) -> UptrainResult:
    """Carry out the planned run (:func:`prepare_uptrain`): the teacher pass, the models, the steps,
    the checkpoints and the final model; ``watch(step, folder)`` sees each checkpoint before the last."""
    from mha2gqa.core.signals import Terminated

    trainer = _Trainer(plan, watch)
    if plan.settings.teacher_only:
        seconds = time.perf_counter() - trainer.started
        return UptrainResult(trainer.output, 0, trainer.up.total, 0, False, [], seconds, trainer.cached.cache.folder)
    trainer.announce()
    try:
        steps = trainer.train()
    except Terminated as e:
        e.kept = (
            f"the checkpoints written so far stay in {plan.settings.output} (no final model): run the same command "
            "with --resume to continue from the last one"
        )
        raise
    return trainer.finish(steps)


def uptrain(
    student: str, settings: UptrainSettings, log: Callable[[str], None] = print, watch: Watch | None = None
) -> UptrainResult:
    """Uptrain the model at ``student`` (folder or hub id) as ``settings`` say; see the module doc.
    ``watch``: called on every process with each checkpoint but the last (step, folder), and with the
    checkpoint a resumed run starts from."""
    return run_uptrain(prepare_uptrain(student, settings, log), watch)
