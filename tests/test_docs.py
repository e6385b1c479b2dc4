"""The README and docs/ stay true to the code: the front door stays short, the method and family
tables list what the registry and the JSON definitions hold, and every link lands somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mha2gqa.convert.methods import METHODS
from mha2gqa.convert.plan.groupings import GROUPINGS
from mha2gqa.core.families import families
from mha2gqa.core.retarget import retargets

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "journal").glob("*.md"))]


def text(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def test_the_readme_is_a_front_door():
    readme = text("README.md")
    assert len(readme.splitlines()) <= 120  # a newcomer reads it in two minutes; the rest lives in docs/
    first = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).splitlines()
    assert "mha2gqa demo" in first[0] and "pytest" in first[1]  # the two set-up commands come first
    setup, tests = (line.split("  #")[0].strip() for line in first[:2])
    assert setup.startswith("python3 -m venv .venv && . .venv/bin/activate && ") and "[dev]" not in setup
    assert tests in text(".ci/run").splitlines()  # CI runs exactly the README's test command
    assert "## Which method to use" in readme and "## What a good result looks like" in readme
    first_screen = "\n".join(readme.splitlines()[:60])  # the advice comes before the demo's output
    assert "## Which method to use" in first_screen and "## What a good result looks like" in first_screen


def test_the_methods_page_describes_and_the_journal_keeps_the_dated_runs():
    """docs/methods.md says what each method is and costs today (at most 400 lines, no dated headings);
    the dated runs live in docs/journal/."""
    methods = text("docs/methods.md")
    assert len(methods.splitlines()) <= 400
    dated = [h for h in methods.splitlines() if h.startswith("#") and re.search(r"\b20\d\d-\d\d-\d\d\b", h)]
    assert not dated, dated
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text("README.md")), "the README says things without dates"
    assert list((ROOT / "docs" / "journal").glob("*.md"))


def test_the_verdict_thresholds_are_the_code_s():
    from mha2gqa.eval.verdict import SOURCE, thresholds_table

    assert thresholds_table() in text("README.md")
    page = text("docs/evaluation.md")
    assert thresholds_table() in page and "## What a good result looks like" in page
    assert SOURCE.split("#")[0] == "docs/evaluation.md"


def test_every_method_and_grouping_is_documented():
    methods = text("docs/methods.md")
    for name in METHODS:
        assert re.search(rf"^\| `{name}`", methods, re.M), name
    for name in GROUPINGS:
        assert f"--grouping {name}" in methods, name


def test_the_family_table_lists_every_family_and_re_targeting():
    page = text("docs/families.md")
    for fam in families().values():
        assert f"| {fam.family} | `{fam.architectures[0]}` |" in page
    for spec in retargets().values():
        assert f"| `{spec.architectures[0]}`" in page and f"| `{spec.target}` |" in page, spec.source


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    out = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_lands(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: {target} does not exist"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{page.name}: no heading #{anchor} in {dest.name}"


def test_the_options_reference_is_generated_from_the_commands():
    from mha2gqa.options_doc import options_reference

    assert text("docs/options.md") == options_reference(), "run: python -m mha2gqa.options_doc > docs/options.md"


def test_the_family_feature_table_is_generated_from_the_refusals():
    from mha2gqa.families_doc import BEGIN, END, feature_table

    page = text("docs/families.md")
    block = page[page.index(BEGIN) : page.index(END) + len(END)] + "\n"
    assert block == feature_table(), "run: python -m mha2gqa.families_doc and paste it into docs/families.md"


#: the packages docs/architecture.md lays out, as their folders in the checkout
PACKAGES = ("core", "convert", "eval", "serving", "uptrain", "pipeline", "mha2gqa")


def _tree_blocks(page: str) -> dict[str, str]:
    """The architecture tree's text under each top-level folder (``core/``, ``convert/``...)."""
    tree = page[page.index("```\npyproject.toml") :]
    tree = tree[: tree.index("\n```", 4)]
    blocks: dict[str, list[str]] = {}
    current = None
    for line in tree.splitlines():
        head = re.match(r"^(\w+)/\s", line)
        if head:
            current = head.group(1)
        if current:
            blocks.setdefault(current, []).append(line)
    return {k: "\n".join(v) for k, v in blocks.items()}


def test_the_architecture_page_names_every_module_and_no_module_that_is_gone():
    """Drift-tested like docs/options.md: every module of every package is named in its package's part
    of the tree (or by its path), and every ``name.py`` the page names exists."""
    page = text("docs/architecture.md")
    blocks = _tree_blocks(page)
    unnamed = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if path.name == "__init__.py" or rel in page:
                continue
            if not re.search(rf"(?<![\w/]){re.escape(path.name)}\b", blocks.get(package, "")):
                unnamed.append(rel)
    assert not unnamed, f"docs/architecture.md does not name {unnamed}"
    existing = {p.name for folder in (*PACKAGES, "benchmarks", "tests") for p in (ROOT / folder).rglob("*.py")}
    gone = sorted({n for n in re.findall(r"(?<![\w/])(\w+\.py)\b", page)} - existing)
    assert not gone, f"docs/architecture.md names modules that do not exist: {gone}"


def test_the_docs_spell_the_shipped_recommended_recipe_s_distillation():
    """The recipe file, the usage page and the README's table name the same distillation length."""
    from mha2gqa.core.recipe_file import named_recipes, read_recipe

    steps = read_recipe(named_recipes()["recommended"])["distill"]["distill_steps"]
    assert f"--distill-steps {steps}" in text("docs/usage.md") and f"{steps} steps" in text("README.md")
