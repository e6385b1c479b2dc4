"""A text named so that a record, a card or a recipe can travel: a local file by its file name and
sha256 (never the path of the machine that read it), a ``datasets`` name as given; and a sketch of
its lines, so that ``eval`` can still tell how much of its own text the conversion read, on any
machine, without the file.

The sketch: the sorted, distinct 32-bit hashes of the text's compared lines (stripped, at least
:data:`MIN_LINE` characters), the :data:`SKETCH_LINES` smallest where there are more (a bottom-k
sample: the share of another text's lines found in it is estimated on that text's lines whose hash
falls under the largest one kept), packed big-endian and base64-encoded.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

#: Lines shorter than this are not compared (blank lines, headings and boilerplate repeat anyway).
MIN_LINE = 40
#: The most line hashes a sketch keeps (4 bytes each: at most 88 KB of base64 in a record).
SKETCH_LINES = 16_384
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class TextRef:
    """A text as a record names it: ``name`` (a file's name, or the ``datasets`` name), the file's
    ``sha256`` (None for a ``datasets`` name), its ``lines`` sketch and how many distinct compared
    lines the text has (``lines_total``; more than the sketch holds where it is a sample)."""

    name: str
    sha256: str | None = None
    lines: str = ""
    lines_total: int = 0

    def __post_init__(self) -> None:
        """Read back from a record, checked: a tampered sha256 or sketch is refused, not misread."""
        from mha2gqa.core.typed import RecordError

        if self.sha256 is not None and not _SHA256.fullmatch(self.sha256):
            raise RecordError("text.sha256 is not a sha256 (64 hex digits)")
        try:
            raw = base64.b64decode(self.lines.encode("ascii"), validate=True)
        except (ValueError, UnicodeEncodeError):
            raise RecordError("text.lines is not a line sketch (base64)") from None
        if len(raw) % 4 or len(raw) // 4 > min(self.lines_total, SKETCH_LINES):
            raise RecordError("text.lines does not hold whole 4-byte hashes, at most lines_total of them")

    def hashes(self) -> list[int]:
        raw = base64.b64decode(self.lines.encode("ascii"))
        return [int.from_bytes(raw[i : i + 4], "big") for i in range(0, len(raw), 4)]

    def share_of(self, lines: set[str]) -> float:
        """The share of ``lines`` (compared lines of another text) that are lines of this text."""
        kept = set(self.hashes())
        mine = {line_hash(line) for line in lines}
        if len(kept) < self.lines_total and kept:  # a sample: compare the lines it would have kept
            bound = max(kept)
            mine = {h for h in mine if h <= bound}
        return len(mine & kept) / len(mine) if mine else 0.0

    def same_as(self, source: str) -> bool:
        """``source`` (a path or a ``datasets`` name) is this very text."""
        path = Path(source).expanduser()
        if self.sha256 is None or not path.is_file():
            return self.sha256 is None and source == self.name
        return text_sha256(source) == self.sha256


def text_sha256(source: str) -> str | None:
    """A local file's sha256 (once per version of it); None for a ``datasets`` name."""
    path = Path(source).expanduser()
    return file_digest(str(path.resolve()), *_stamp(path)) if path.is_file() else None


def portable_name(source: str) -> str:
    """A local file's name (no folder: the reader's machine has its own); else ``source`` as given."""
    path = Path(source).expanduser()
    return path.name if path.is_file() else source


def compared_lines(documents: Iterable[str]) -> set[str]:
    """The lines of ``documents`` that overlap is measured on: stripped, at least :data:`MIN_LINE` long."""
    return {line.strip() for doc in documents for line in doc.splitlines() if len(line.strip()) >= MIN_LINE}


def line_hash(line: str) -> int:
    return int.from_bytes(hashlib.sha256(line.encode("utf-8")).digest()[:4], "big")


def sketch(documents: Sequence[str]) -> tuple[str, int]:
    """``(the packed sketch, the distinct compared lines)`` of ``documents`` (see the module doc)."""
    hashes = sorted({line_hash(line) for line in compared_lines(documents)})
    kept = hashes[:SKETCH_LINES]
    return base64.b64encode(b"".join(h.to_bytes(4, "big") for h in kept)).decode("ascii"), len(hashes)


def text_ref(source: str, text_field: str = "text") -> TextRef:
    """``source`` named portably, with its sketch (read once per file version and field)."""
    path = Path(source).expanduser()
    if path.is_file():
        return _file_ref(str(path.resolve()), text_field, *_stamp(path))
    from mha2gqa.core.text import load_text

    lines, total = sketch(load_text(source, text_field, setting="calibration").documents)
    return TextRef(source, None, lines, total)


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


@cache
def _file_ref(path: str, text_field: str, size: int, mtime: int) -> TextRef:
    from mha2gqa.core.text import load_text

    lines, total = sketch(load_text(path, text_field, setting="calibration").documents)
    return TextRef(Path(path).name, file_digest(path, size, mtime), lines, total)


@cache
def file_digest(path: str, size: int, mtime: int) -> str:
    """A file's sha256, once per version of it (``size``, ``mtime``: the version)."""
    from mha2gqa.core.cache import file_sha256

    return file_sha256(Path(path))
