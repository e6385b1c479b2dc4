"""How much held-out evaluation an uptraining run does by default: enough to follow the run, never
most of it. A forward pass costs one unit a token, a training step three (forward and backward) plus
one for a distillation teacher; an evaluation scores its tokens with the student, and with the
teacher when one is loaded. Without ``--eval-tokens`` the evaluations together get
:data:`EVAL_SHARE` of the run's compute (whole windows, one at least, :data:`MAX_EVAL_TOKENS` at
most); given, a share above :data:`WARN_SHARE` is said before the run starts."""

from __future__ import annotations

from dataclasses import dataclass

#: The share of a run's compute its evaluations get by default.
EVAL_SHARE = 0.2
#: A share of evaluation said before the run starts when ``--eval-tokens`` asks for more.
WARN_SHARE = 0.25
#: Held-out tokens per evaluation at most, by default (a long run's evaluations stop growing here).
MAX_EVAL_TOKENS = 65536


@dataclass(frozen=True)
class EvalBudget:
    """A run's evaluations: ``tokens`` held-out tokens scored ``count`` times, ``share`` of its compute."""

    tokens: int
    count: int
    share: float

    def line(self, asked: bool) -> str:
        """What the evaluations cost, said before the run."""
        how = "--eval-tokens" if asked else "by default, --eval-tokens to change"
        return (
            f"held-out evaluation: {self.tokens:,} tokens x {self.count} evaluations, about {self.share:.0%} of the "
            f"run's compute ({how})"
        )


def evaluations(total_steps: int, every: int) -> int:
    """Evaluations of a run: at step 0, every ``every`` steps and at the last step."""
    return 1 + total_steps // every + (1 if total_steps % every else 0)


def eval_budget(
    total_steps: int,
    tokens_per_step: int,
    every: int,
    window: int,
    teacher_trains: bool,
    teacher_scores: bool,
    asked: int | None,
    available: int,
) -> EvalBudget:
    """The evaluations of a run of ``total_steps`` steps of ``tokens_per_step`` tokens, evaluated every
    ``every`` steps in windows of ``window``; ``teacher_trains``: a teacher forward per training token
    (kd/mix with a live teacher); ``teacher_scores``: the teacher scores the held-out text too;
    ``asked``: ``--eval-tokens`` (None: the default); ``available``: held-out tokens there are."""
    count = evaluations(total_steps, every)
    train = total_steps * tokens_per_step * (3 + teacher_trains)
    per_token = 1 + teacher_scores
    if asked is None:
        fair = EVAL_SHARE * train / (count * per_token)
        tokens = max(window, min(MAX_EVAL_TOKENS, int(fair) // window * window))
    else:
        tokens = asked
    tokens = min(tokens, available // window * window) if available >= window else available
    share = count * tokens * per_token / (count * tokens * per_token + train)
    return EvalBudget(tokens, count, share)
