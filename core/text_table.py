"""One table, three renderings: aligned terminal text, Markdown and HTML. Every table mha2gqa shows
(the eval summary, the report, bench, plan, inspect, job and demo summaries) is built as a
:class:`Table` and rendered here, so the same numbers look the same everywhere."""

from __future__ import annotations

import html
from dataclasses import dataclass, field


def _verdict_class(cell: str) -> str | None:
    """The HTML class that colours a verdict cell: ``pass`` green, ``borderline...`` amber, ``FAIL...``,
    ``fail...`` and a task's significant ``drop:`` red."""
    if cell == "pass":
        return "pass"
    if cell.startswith(("FAIL", "fail", "drop:")):
        return "fail"
    return "borderline" if cell.startswith("borderline") else None


@dataclass
class Table:
    """``header`` and ``rows`` of cell strings; the first column is left-aligned, the rest right."""

    header: list[str]
    rows: list[list[str]] = field(default_factory=list)
    links: list[str | None] = field(default_factory=list)  # per row: where its first cell links to

    def add(self, *cells: object, link: str | None = None) -> None:
        self.rows.append([str(c) for c in cells])
        self.links.append(link)

    def _link(self, i: int) -> str | None:
        return self.links[i] if i < len(self.links) else None

    def text(self, indent: str = "") -> list[str]:
        """Lines of aligned columns (two spaces between columns)."""
        widths = [max([len(h), *(len(r[i]) for r in self.rows if i < len(r))]) for i, h in enumerate(self.header)]

        def line(cells: list[str]) -> str:
            parts = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=False))]
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
        def cell(c: str, link: str | None = None) -> str:
            cls = _verdict_class(c)
            text = f'<a href="{html.escape(link)}">{html.escape(c)}</a>' if link else html.escape(c)
            return f'<td class="{cls}">{text}</td>' if cls else f"<td>{text}</td>"

        head = "".join(f"<th>{html.escape(h)}</th>" for h in self.header)
        body = "".join(
            "<tr>" + "".join(cell(c, self._link(i) if j == 0 else None) for j, c in enumerate(row)) + "</tr>"
            for i, row in enumerate(self.rows)
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
