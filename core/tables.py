"""One table, three renderings: aligned terminal text, Markdown and HTML. Every table mha2gqa shows
(the eval summary, the report, bench, plan, inspect, job and demo summaries) is built as a
:class:`Table` and rendered here, so the same numbers look the same everywhere."""

from __future__ import annotations

import html
from dataclasses import dataclass, field

#: Cell texts the HTML rendering colours.
VERDICT_CLASSES = {"FAIL": "fail", "pass": "pass"}


@dataclass
class Table:
    """``header`` and ``rows`` of cell strings; the first column is left-aligned, the rest right."""

    header: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def add(self, *cells: object) -> None:
        self.rows.append([str(c) for c in cells])

    def text(self, indent: str = "") -> list[str]:
        """Lines of aligned columns (two spaces between columns)."""
        widths = [max([len(h), *(len(r[i]) for r in self.rows if i < len(r))]) for i, h in enumerate(self.header)]

        def line(cells: list[str]) -> str:
            parts = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=False))]
            return (indent + "  ".join(parts)).rstrip()

        return [line(self.header), *(line(r) for r in self.rows)]

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.header) + " |", "|" + "---|" * len(self.header)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in self.rows]
        return "\n".join(lines)

    def html(self) -> str:
        def cell(c: str) -> str:
            cls = VERDICT_CLASSES.get(c)
            return f'<td class="{cls}">{html.escape(c)}</td>' if cls else f"<td>{html.escape(c)}</td>"

        head = "".join(f"<th>{html.escape(h)}</th>" for h in self.header)
        body = "".join("<tr>" + "".join(cell(c) for c in row) + "</tr>" for row in self.rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
