"""The :class:`Recipe`: what one conversion makes, parsed once from wherever it was given.

The command line (``convert``'s options, a ``--recipe`` file or a shipped recipe's name, which become
its defaults), a job file's sweep cell (a recipe name such as ``svd+refit+distill`` with the job's
``convert`` section) and the demo (a job) all produce this one value; :func:`~mha2gqa.pipeline.prepare`
takes it. Below the pipeline nothing sees it: each stage gets its own settings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mha2gqa.convert.settings import ConvertSettings
from mha2gqa.core.recipe_file import parse_recipe, recipe_name
from mha2gqa.pipeline.distill import DistillSettings, split_options


@dataclass(frozen=True)
class Recipe:
    """The stages of one conversion and their settings: the conversion (merge, ``--refit``, the stage
    guard) as ``convert`` says, then the distillation where ``distill.distill`` is on."""

    convert: ConvertSettings
    distill: DistillSettings = field(default_factory=DistillSettings)

    @classmethod
    def from_options(cls, options: dict[str, Any], progress: bool = True) -> Recipe:
        """A ``convert`` command line's options (both settings' fields; checked by
        :func:`~mha2gqa.pipeline.prepare`)."""
        convert, distill = split_options(options)
        return cls(ConvertSettings(**convert, progress=progress), DistillSettings(**distill))

    @classmethod
    def named(cls, name: str, convert: dict[str, Any], distill: dict[str, Any] | None = None) -> Recipe:
        """A recipe name (``method[+refit][+distill]``, as a job's ``methods`` lists it) with further
        settings (``convert``: ConvertSettings fields; ``distill``: DistillSettings fields, used where
        the name distils), every value checked. A recipe that neither reads nor distils on the
        calibration text drops it (a sweep gives one text to all its recipes)."""
        method, refit, distilling = parse_recipe(name)
        settings = ConvertSettings(**{**convert, "method": method, "refit": refit})
        if not settings.reads_calibration and not distilling:
            settings = dataclasses.replace(settings, calibration=None)
        settings = settings.check()
        d = DistillSettings(distill=True, **(distill or {})) if distilling else DistillSettings()
        return cls(settings, d.check(settings))

    @property
    def distilling(self) -> bool:
        """A distillation follows the conversion."""
        return self.distill.distill

    @property
    def name(self) -> str:
        """``method[+refit][+distill]``: the inverse of :meth:`named`."""
        return recipe_name(self.convert.method, self.convert.refit, self.distilling)

    def sections(self) -> dict[str, dict[str, Any]]:
        """The recipe file's sections: every setting that shapes the model."""
        return {"convert": self.convert.recipe(), **({"distill": self.distill.recipe()} if self.distilling else {})}

    def replace(self, **convert: Any) -> Recipe:
        """This recipe with some of the conversion's settings changed (how a run is laid out: its
        progress, its log)."""
        return dataclasses.replace(self, convert=dataclasses.replace(self.convert, **convert))
