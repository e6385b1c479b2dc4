"""The recipe file a conversion writes beside its model: the settings that made it, which
``mha2gqa convert SRC DST --recipe FILE`` (and a job's ``convert`` section) runs again.

    # mha2gqa recipe: `mha2gqa convert SRC DST --recipe mha2gqa_recipe.yaml` makes this model again
    recipe: svd+refit+distill
    convert: {num_kv_heads: 1, method: svd, calibration: /data/train.txt, refit: true, ...}
    distill: {distill: true, distill_steps: 24, distill_lr: 0.0015}

Every setting that shapes the output is written (not only those given), so a later mha2gqa whose
defaults moved makes the same model from it; settings of the machine and the run (device, progress,
overwrite...) are not. The llm-compressor and mergekit convention: the recipe travels with the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from mha2gqa.core.errors import Mha2GqaError

RECIPE_FILE = "mha2gqa_recipe.yaml"
#: the sections a recipe file may hold, in the order written
SECTIONS = ("convert", "distill")
_HEADER = "# mha2gqa recipe: `mha2gqa convert SRC DST --recipe {name}` makes this model again\n"


#: the stages a recipe name adds to its method: ``svd+refit`` is ``--method svd --refit``, and
#: ``svd+refit+distill`` adds ``--distill``
REFIT, DISTILL = "+refit", "+distill"


def recipe_name(method: str, refit: bool, distill: bool) -> str:
    """``method[+refit][+distill]``: what a recipe runs, as a job's ``methods`` names it."""
    return method + (REFIT if refit else "") + (DISTILL if distill else "")


def parse_recipe(recipe: str) -> tuple[str, bool, bool]:
    """``(method, refit, distill)`` of a recipe name (the inverse of :func:`recipe_name`)."""
    return recipe.split("+", 1)[0], REFIT in recipe, recipe.endswith(DISTILL)


def recipe_text(name: str, sections: dict[str, dict[str, Any]]) -> str:
    """The file's text: a header line, the recipe's name (for the reader: the settings are what
    runs), then each section."""
    body = {"recipe": name, **{k: sections[k] for k in SECTIONS if sections.get(k)}}
    return _HEADER.format(name=RECIPE_FILE) + yaml.safe_dump(body, sort_keys=False)


def write_recipe(folder: Path, name: str, sections: dict[str, dict[str, Any]]) -> Path:
    """Write the recipe file into ``folder`` (a staged output, published with it); returns its path."""
    path = Path(folder) / RECIPE_FILE
    path.write_text(recipe_text(name, sections), encoding="utf-8")
    return path


def named_recipes() -> dict[str, Path]:
    """The recipes that ship with the package (``configs/recipes/``), by name: ``--recipe recommended``."""
    from importlib import resources

    folder = resources.files("mha2gqa.configs") / "recipes"
    return {p.name.removesuffix(".yaml"): Path(str(p)) for p in folder.iterdir() if p.name.endswith(".yaml")}


def recipe_path(value: str) -> Path:
    """The recipe file ``--recipe VALUE`` names: a file, else a shipped recipe's name (refused in one
    line when it is neither)."""
    path = Path(value).expanduser()
    if path.exists() or "/" in value or value.endswith((".yaml", ".yml")):
        return path
    named = named_recipes()
    if value not in named:
        raise Mha2GqaError(f"recipe {value!r}: no such file, and the shipped recipes are {', '.join(sorted(named))}")
    return named[value]


def read_recipe(path: Path) -> dict[str, dict[str, Any]]:
    """A recipe file's sections (``convert``, and ``distill`` where it has one), its shape checked:
    damaged, foreign or edited into another shape, one line naming the file."""
    path = Path(path)

    def bad(why: str) -> Mha2GqaError:
        return Mha2GqaError(f"recipe {path}: {why}")

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise bad(f"cannot be read ({e.strerror or e})") from None
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        raise bad(f"not a YAML file ({' '.join(str(e).split())[:120]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("convert"), dict):
        raise bad("not a recipe: it needs a 'convert' mapping (the file a conversion writes as " + RECIPE_FILE + ")")
    unknown = sorted(set(data) - {"recipe", *SECTIONS})
    if unknown:
        raise bad(f"unknown key {unknown[0]!r}; a recipe holds recipe, {', '.join(SECTIONS)}")
    sections = {k: data[k] for k in SECTIONS if k in data}
    for name, section in sections.items():
        if not isinstance(section, dict) or not all(isinstance(k, str) for k in section):
            raise bad(f"'{name}' must be a mapping of settings")
    return sections
