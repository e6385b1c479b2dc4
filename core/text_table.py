"""One table, three renderings: aligned terminal text, Markdown and HTML. Every table mha2gqa shows
(the eval summary, the report, bench, plan, inspect, job and demo summaries) is built as a
:class:`Table` and rendered here, so the same numbers look the same everywhere."""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field

#: A cell that reads as a number (``4,096``, ``1.03x``, ``-0.5%``, ``78.4 → 80.1``): right-aligned.
_NUMBER = re.compile(r"^[-+−~≈]?\.?\d")
#: Cells that say nothing (an empty figure): they do not make a column text.
_BLANK = ("", "-", "—", "n/a")


def _verdict_class(cell: str) -> str | None:
    """The HTML class that colours a verdict cell: ``pass`` green, ``borderline...`` amber, ``FAIL...``,
    ``fail...`` and a task's significant ``drop:`` red, ``NOT VALID...`` grey."""
    if cell == "pass":
        return "pass"
    if cell.startswith(("FAIL", "fail", "drop:")):
        return "fail"
    if cell.startswith("NOT VALID"):
        return "not-valid"
    return "borderline" if cell.startswith("borderline") else None


@dataclass
class Table:
    """``header`` and ``rows`` of cell strings; the first column and every column of text are
    left-aligned, columns of numbers right-aligned."""

    header: list[str]
    rows: list[list[str]] = field(default_factory=list)
    links: list[str | None] = field(default_factory=list)  # per row: where its first cell links to

    def add(self, *cells: object, link: str | None = None) -> None:
        self.rows.append([str(c) for c in cells])
        self.links.append(link)

    def _link(self, i: int) -> str | None:
        return self.links[i] if i < len(self.links) else None

    def numeric(self) -> list[bool]:
        """Per column: every cell that says something reads as a number (the first column never)."""
        return [
            i > 0 and all(_NUMBER.match(r[i]) for r in self.rows if i < len(r) and r[i].strip() not in _BLANK)
            for i in range(len(self.header))
        ]

    def text(self, indent: str = "") -> list[str]:
        """Lines of aligned columns (two spaces between columns)."""
        widths = [max([len(h), *(len(r[i]) for r in self.rows if i < len(r))]) for i, h in enumerate(self.header)]
        numeric = self.numeric()

        def line(cells: list[str]) -> str:
            parts = [
                c.rjust(w) if numeric[i] else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=False))
            ]
            return (indent + "  ".join(parts)).rstrip()

        return [line(self.header), *(line(r) for r in self.rows)]

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.header) + " |", "|" + "---|" * len(self.header)]
        for i, row in enumerate(self.rows):
            cells = [c.replace("|", "\\|") for c in row]
            if self._link(i) and cells:
                cells[0] = f"[{cells[0]}]({self._link(i)})"
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def html(self) -> str:
        numeric = self.numeric()

        def classes(j: int, c: str | None = None) -> str:
            names = [n for n in (None if numeric[j] else "text", c and _verdict_class(c)) if n]
            return f' class="{" ".join(names)}"' if names else ""

        def cell(j: int, c: str, link: str | None = None) -> str:
            text = f'<a href="{html.escape(link)}">{html.escape(c)}</a>' if link else html.escape(c)
            return f"<td{classes(j, c)}>{text}</td>"

        head = "".join(f"<th{classes(j)}>{html.escape(h)}</th>" for j, h in enumerate(self.header))
        body = "".join(
            "<tr>" + "".join(cell(j, c, self._link(i) if j == 0 else None) for j, c in enumerate(row)) + "</tr>"
            for i, row in enumerate(self.rows)
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
