"""Is this a valid comparison? Checked from the configs and records before any model loads.

A swapped pair (the "converted" model has more KV heads than the "original", or the original's
conversion record names the other folder as its source) and a pair with different vocabularies are
refused with the fix. Evaluation text that is (or overlaps) the text the conversion was calibrated or
refitted on is flagged: its numbers flatter the conversion.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mha2gqa.core.architecture import dims_of
from mha2gqa.core.checkpoint import read_config, resolve_folder
from mha2gqa.core.conversion_record import read_conversion_record
from mha2gqa.core.dims import config_value
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.text import TextData, load_text
from mha2gqa.core.text_ref import TextRef, compared_lines
from mha2gqa.core.uptrain_guard import published_run

#: Share of the evaluation text's lines found in the calibration text above which it is flagged.
FLAG_SHARE = 0.01


def _kv_heads(config: dict[str, Any]) -> int:
    """KV heads over all layers (a per-layer checkpoint's sum)."""
    dims = dims_of(config)
    return sum(dims.kv_heads_of(layer) for layer in range(dims.num_layers))


def check_pair(original: str, converted: str, revision: str | None = None) -> None:
    """Refuse a pair that is swapped or whose vocabularies differ (both configs are read; nothing loads)."""
    folders = [resolve_folder(p, revision)[0] for p in (original, converted)]
    configs = [read_config(f) for f in folders]
    counts = []
    for label, folder, config in zip(("--original", "--converted"), folders, configs, strict=True):
        try:
            counts.append(_kv_heads(config))
        except Mha2GqaError as e:
            raise Mha2GqaError(f"{label} {folder}: {e}") from None
    record = read_conversion_record(folders[0])
    if record is not None:
        source = Path(record.source.path).expanduser()  # (a record before ./NAME: the folder's path)
        config_file = folders[1] / "config.json"
        same_config = config_file.is_file() and (
            hashlib.sha256(config_file.read_bytes()).hexdigest() == record.source.config_sha256
        )
        if (source.is_absolute() and source.exists() and source.resolve() == folders[1].resolve()) or same_config:
            raise Mha2GqaError(
                f"--original {original} was converted from --converted {converted}: the pair is swapped; "
                f"pass --original {converted} --converted {original}"
            )
    before, after = counts
    if after > before:
        raise Mha2GqaError(
            f"--converted {converted} has more KV heads ({after} over all layers) than --original {original} "
            f"({before}): the pair looks swapped; pass the model it was converted from as --original"
        )
    vocab = [config_value(c, "vocab_size") for c in configs]
    if None not in vocab and vocab[0] != vocab[1]:
        raise Mha2GqaError(
            f"--original {original} and --converted {converted} have different vocabularies ({vocab[0]:,} vs "
            f"{vocab[1]:,} tokens): compare a model with its own conversion"
        )


@dataclass(frozen=True)
class Overlap:
    """The evaluation text against what the conversion read: ``share`` of its lines (of at least
    :data:`MIN_LINE` characters) also in ``text``, ``same``: the same text outright."""

    text: str
    use: str  # "calibration" or "refit"
    same: bool
    share: float
    lines: int

    @property
    def flagged(self) -> bool:
        return self.same or self.share >= FLAG_SHARE

    def warning(self) -> str:
        what = "is the same text as" if self.same else f"shares {self.share:.1%} of its lines with"
        return (
            f"warning: the evaluation text {what} the conversion's {self.use} text {self.text}: its numbers "
            "flatter the conversion; evaluate on held-out text"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "flagged": self.flagged}


def calibration_overlap(data: TextData, source: str, converted_folder: Path, text_field: str) -> Overlap | None:
    """How much of the evaluation text ``data`` (read from ``source``) the conversion in
    ``converted_folder`` was calibrated or refitted on (from the record's sha256 and line sketch of
    the text, on any machine; a record before them: from the file it names, where it still is), or
    trained on; None when it read no text."""
    record = read_conversion_record(converted_folder)
    facts = record.conversion if record else None
    if facts is None:
        return None
    texts: dict[
        str, tuple[str, TextRef | None]
    ] = {}  # text -> what read it; a refit usually reads the calibration text
    if facts.refit is not None:
        texts[facts.refit.data] = ("refit", facts.refit.text)
    if facts.calibration is not None and facts.calibration.data:
        texts.setdefault(facts.calibration.data, ("calibration", facts.calibration.text))
    run = published_run(converted_folder)  # convert --distill, or an uptraining run: it read text too
    trained = run.training_text if run is not None else None
    if trained:
        texts.setdefault(trained[0], ("training", trained[1]))
    found: Overlap | None = None
    mine = compared_lines(data.documents)
    for text, (use, ref) in texts.items():
        got = (
            _against_ref(ref, text, use, source, mine)
            if ref
            else _against_file(text, use, source, data, mine, text_field)
        )
        if got is not None and got.same:
            return got
        if got is not None and (found is None or got.share > found.share):
            found = got
    return found


def _against_ref(ref: TextRef, text: str, use: str, source: str, mine: set[str]) -> Overlap:
    if ref.same_as(source):
        return Overlap(text, use, True, 1.0, len(mine))
    return Overlap(text, use, False, ref.share_of(mine), len(mine))


def _against_file(text: str, use: str, source: str, data: TextData, mine: set[str], text_field: str) -> Overlap | None:
    """The evaluation text against the file a record names by its path (None: moved, or a dataset name)."""
    path, here = Path(text).expanduser(), Path(source).expanduser()
    if text == source or (path.is_file() and here.is_file() and path.resolve() == here.resolve()):
        return Overlap(text, use, True, 1.0, len(mine))
    if not path.is_file():
        return None  # a dataset name, or moved since: nothing here to compare with
    try:
        theirs = load_text(text, text_field, setting=use)
    except Mha2GqaError:
        return None
    if "".join(theirs.documents) == "".join(data.documents):
        return Overlap(text, use, True, 1.0, len(mine))
    share = len(mine & compared_lines(theirs.documents)) / len(mine) if mine else 0.0
    return Overlap(text, use, False, share, len(mine))
