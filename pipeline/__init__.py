"""The pipeline floor, between the commands (CLI, jobs, demo) and the stages (``convert``, ``uptrain``):
a :class:`Recipe` parsed once, :func:`prepare` checking every stage before any work, and
:meth:`Prepared.run` doing them (convert, refit, guard, distil, publish). The distillation after a
conversion and its rate backoff live here; nothing below this floor imports it.
"""

from mha2gqa.pipeline.recipe import Recipe
from mha2gqa.pipeline.run import Outcome, Prepared, PreparedUptrain, prepare, prepare_uptrain

__all__ = ["Outcome", "Prepared", "PreparedUptrain", "Recipe", "prepare", "prepare_uptrain"]
