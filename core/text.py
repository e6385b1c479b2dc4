"""Evaluation text: local files or ``datasets`` names, as documents, and their tokens.

Sources: ``path.txt`` (``doc_split``: the whole file, paragraphs separated by blank lines, or
lines), ``path.jsonl`` / ``path.json`` and ``path.parquet`` (one document per row, ``text_field``),
or a ``datasets`` name ``name[:config]:split`` such as ``wikitext:wikitext-2-raw-v1:test`` (needs
the hub, or a local ``datasets`` cache).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mha2gqa.core.errors import Mha2GqaError, SettingError, first_line

if TYPE_CHECKING:
    import torch

DOC_SPLITS = {"file": "document", "paragraph": "paragraph", "line": "line"}
_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class TextSource:
    """Where a text comes from: a file or a ``datasets`` name ``source``, the ``text_field`` of its
    rows, and how a ``.txt`` file splits into documents (``doc_split``: :data:`DOC_SPLITS`)."""

    source: str
    text_field: str = "text"
    doc_split: str = "file"


@dataclass
class TextData:
    """Documents in order, and where they came from."""

    source: str
    documents: list[str]
    text_field: str | None
    doc_split: str | None

    @property
    def joined(self) -> str:
        """The documents as one text, as the token stream reads them: joined by blank lines."""
        return "\n\n".join(self.documents)

    @property
    def characters(self) -> int:
        return sum(map(len, self.documents))

    def sha256(self) -> str:
        h = hashlib.sha256()
        for d in self.documents:
            h.update(d.encode("utf-8"))
            h.update(b"\0")
        return h.hexdigest()

    def describe(self) -> dict:
        return {
            "source": self.source,
            "text_field": self.text_field,
            "doc_split": self.doc_split,
            "documents": len(self.documents),
            "characters": self.characters,
            "sha256": self.sha256(),
        }


def check_text_source(source: str | None, setting: str = "data") -> None:
    """The cheap checks of a text source, before anything is loaded: a local file must exist and
    be of a known type; anything else must look like a ``datasets`` name (``name[:config]:split``)."""
    if source is None:
        return
    path = Path(source).expanduser()
    if path.suffix.lower() in _BUILDERS or path.exists():  # a file ("org/name:split" is a datasets name)
        if path.is_dir():
            raise SettingError(
                setting, f"{{name}} {source} is a folder: give one text file (.txt, .jsonl, .json or .parquet)"
            )
        if not path.is_file():
            raise SettingError(setting, f"{{name}} {source}: no such file")
        if path.suffix.lower() not in _BUILDERS:
            raise SettingError(
                setting, f"{{name}} {source}: unsupported file type; use .txt, .jsonl, .json or .parquet"
            )
        return
    parts = source.split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise SettingError(
            setting, f"{{name}} {source}: not a file, and not a datasets name like 'wikitext:wikitext-2-raw-v1:test'"
        )


def open_source(source: str, text_field: str, doc_split: str, setting: str):
    """``(datasets.Dataset, field, doc_split used)`` of ``source``: Arrow tables on disk, memory-mapped
    (a local file is converted once into ``datasets``' cache)."""
    import datasets

    check_text_source(source, setting)
    datasets.disable_progress_bars()
    path = Path(source).expanduser()
    suffix = path.suffix.lower()
    if path.is_file():
        if doc_split not in DOC_SPLITS:
            raise SettingError("doc_split", f"{{name}} must be one of {', '.join(DOC_SPLITS)}")
        if suffix != ".parquet":
            _check_utf8(path, source, setting)
        kwargs = {"sample_by": DOC_SPLITS[doc_split]} if suffix == ".txt" else {}
        try:
            ds = datasets.load_dataset(_BUILDERS[suffix], data_files=str(path), split="train", **kwargs)
        except Exception as e:
            raise SettingError(setting, f"{{name}} {source}: cannot be read as {suffix[1:]}: {first_line(e)}") from None
        field = "text" if suffix == ".txt" else text_field
        split_used = doc_split if suffix == ".txt" else None
    else:
        parts = source.split(":")
        name, config, split = (parts[0], None, parts[1]) if len(parts) == 2 else parts
        try:
            ds = datasets.load_dataset(name, config, split=split)
        except Exception as e:
            raise SettingError(
                setting,
                f"{{name}} {source}: cannot load it with datasets ({type(e).__name__}: {first_line(e, 200)})",
            ) from None
        field, split_used = text_field, None
    if field not in ds.column_names:
        raise SettingError(
            setting,
            f"{{name}} {source}: no text field {field!r} (fields: {', '.join(ds.column_names)}); pass --text-field",
        )
    return ds, field, split_used


def load_text(source: str, text_field: str = "text", doc_split: str = "file", setting: str = "data") -> TextData:
    """Read ``source`` into documents (empty ones dropped). Raises :class:`SettingError` naming
    ``setting`` (``data``, ``calibration``, ``eval_data``...)."""
    ds, field, split_used = open_source(source, text_field, doc_split, setting)
    docs = [d for d in ds[field] if isinstance(d, str) and d.strip()]
    if not docs:
        raise SettingError(setting, f"{{name}} {source}: no text")
    return TextData(source, docs, field, split_used)


#: The longest piece of text tokenized in one call (characters): longer documents are cut at the last
#: line break before it, so that memory never grows with a document's length.
PIECE_CHARS = 1 << 16


def text_pieces(
    source: str, text_field: str = "text", doc_split: str = "file", setting: str = "data"
) -> Iterator[tuple[int, str]]:
    """``(document number, piece)`` of every non-empty document of ``source`` in order, documents
    longer than :data:`PIECE_CHARS` cut at line breaks; read row batch by row batch from the
    memory-mapped Arrow table, never whole (a ``.txt`` file that is one document, ``doc_split``
    ``file``, is read piece by piece from the file itself). Raises :class:`SettingError` when there
    is no text."""
    path = Path(source).expanduser()
    if doc_split == "file" and path.suffix.lower() == ".txt" and path.is_file():
        check_text_source(source, setting)
        _check_utf8(path, source, setting)
        empty = True
        for piece in _file_pieces(path):
            empty = empty and not piece.strip()
            yield 0, piece
        if empty:
            raise SettingError(setting, f"{{name}} {source}: no text")
        return
    ds, field, _ = open_source(source, text_field, doc_split, setting)
    number = 0
    for batch in ds.iter(batch_size=256):
        for doc in batch[field]:
            if not isinstance(doc, str) or not doc.strip():
                continue
            for piece in _cut(doc):
                yield number, piece
            number += 1
    if number == 0:
        raise SettingError(setting, f"{{name}} {source}: no text")


def _file_pieces(path: Path) -> Iterator[str]:
    """A text file's content in the pieces :func:`_cut` makes of it, read a piece at a time."""
    with open(path, encoding="utf-8", newline="") as f:
        buffer = ""
        while True:
            block = f.read(PIECE_CHARS)
            buffer += block
            while len(buffer) > PIECE_CHARS:  # a cut depends only on the first PIECE_CHARS + 1 characters
                piece = next(_cut(buffer))
                yield piece
                buffer = buffer[len(piece) :]
            if not block:
                yield from _cut(buffer)
                return


def _cut(doc: str) -> Iterator[str]:
    """``doc`` in pieces of at most :data:`PIECE_CHARS` characters, each ending at a line break where
    one exists in its second half."""
    start = 0
    while start < len(doc):
        end = min(start + PIECE_CHARS, len(doc))
        if end < len(doc):
            brk = doc.rfind("\n", start + PIECE_CHARS // 2, end)
            end = brk + 1 if brk >= 0 else end
        yield doc[start:end]
        start = end


def _check_utf8(path: Path, source: str, setting: str) -> None:
    """Text files must be UTF-8 (checked in 1 MiB pieces, so memory stays small)."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    done = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                bad = chunk[e.start : e.start + 1]
                raise SettingError(
                    setting,
                    f"{{name}} {source}: file is not UTF-8 text (byte {done + e.start} is "
                    f"{bad!r}); convert it, e.g. iconv -f latin1 -t utf-8",
                ) from None
            if not chunk:
                return
            done += len(chunk)


def token_stream(tokenizer, data: TextData, max_tokens: int | None = None) -> torch.Tensor:
    """The documents joined by blank lines, tokenized once, with one BOS at the start when the
    tokenizer has one; cut to ``max_tokens``. ``-> [N]`` int64."""
    import torch

    ids = tokenizer(data.joined, add_special_tokens=False, verbose=False)["input_ids"]
    if tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id, *ids]
    return torch.tensor(ids[:max_tokens] if max_tokens else ids, dtype=torch.long)


def document_tokens(
    tokenizer, data: TextData, max_tokens: int | None = None, special_tokens: bool = False
) -> tuple[list[list[int]], list[str]]:
    """Per-document token lists (without the tokenizer's special tokens, or with them), whole
    documents in order until their total reaches ``max_tokens``. Returns ``(token lists, the
    documents used)``."""
    out: list[list[int]] = []
    used: list[str] = []
    total = 0
    for doc in data.documents:
        if max_tokens and total >= max_tokens:
            break
        ids = tokenizer(doc, add_special_tokens=special_tokens, verbose=False)["input_ids"]
        out.append(ids)
        used.append(doc)
        total += len(ids)
    return out, used


def prefix_token(tokenizer) -> int:
    """The token lm-evaluation-harness puts before each document: BOS, else EOS."""
    token = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if token is None:
        raise Mha2GqaError("the tokenizer has neither a BOS nor an EOS token to start rolling windows with")
    return token
