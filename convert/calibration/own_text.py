"""``--self-text SHARE``: the calibration text the stages read, partly written by the source model itself.

The source writes documents from its own distribution (:mod:`mha2gqa.core.self_text`, seeded by
``--seed``, cached), as many tokens as ``SHARE`` of ``--calibration-tokens`` needs (a quarter more, for
tokenizers that cut the two kinds differently); they are mixed into the user's text at ``SHARE`` of the
characters, every stretch holding both, and the statistics, the refit and ``--distill`` all read the
mix. The user's text enters the mix only before its last windows, which stay the stage guard's
(scored as without ``--self-text``); the model writes a second, smaller sample apart (another seed),
which no stage reads and the guard scores as a text of its own. The record names the user's text and
what the model wrote into it (:class:`~mha2gqa.core.conversion_record.OwnText`), never a cache path.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mha2gqa.convert.settings import GUARD_WINDOWS, ConvertSettings, calibration_window
from mha2gqa.core.conversion_record import OwnText
from mha2gqa.core.errors import Mha2GqaError, SettingError

#: written tokens per token of the model's share of the calibration budget (the two kinds of text
#: tokenize differently: the mix must still reach the budget)
MARGIN = 1.25
#: the name the stage guard gives the held-out sample the model writes apart
SAMPLE_NAME = "the model's own text"
#: the seed of that sample, after the mix's: another stretch of the model's distribution
SAMPLE_SEED_OFFSET = 1
#: the resume fingerprint's record of the mix the stages read (known once the model has written its
#: text: a stopped run's kept layers were fitted on that mix, and a run at other --threads may write another)
FINGERPRINT_KEY = "text the model wrote (--self-text)"


@dataclass(frozen=True)
class OwnTextFiles:
    """The texts ``--self-text`` made: ``mix`` (the stages read it), ``sample`` (the guard's held-out
    sample of the model's own text, None where the guard is off) and the record's facts."""

    mix: Path
    sample: Path | None
    facts: OwnText


def own_text(
    folder: Path, s: ConvertSettings, positions: int | None, log: Callable[[str], None] | None, reads: int = 0
) -> OwnTextFiles:
    """The mix of ``s.calibration`` and the text the model in ``folder`` writes (``s.self_text`` of it),
    and the guard's sample, written or found in the cache (``positions``: the model's, for the window;
    ``reads``: the tokens a later stage reads of the mix, the distillation's)."""
    from mha2gqa.core.self_text import SelfTextSettings, mix_file, self_text

    assert s.self_text is not None and s.calibration
    seed = s.seed % 2**31
    sampling = SelfTextSettings(tokens=_tokens(s, reads), seed=seed, device=s.device).check()
    user = _before_guard(folder, s, positions)
    if not user.strip():
        raise SettingError(
            "calibration",
            f"{{name}} {s.calibration}: nothing of it comes before the stage guard's last windows to mix "
            "--self-text into: give a longer text",
        )
    written = self_text(str(folder), sampling, log=log, progress=s.progress)
    if written.tokens == 0:
        raise Mha2GqaError(f"{folder}: the model wrote no text for --self-text (every document ended at once)")
    mix, share, sha = mix_file(written, user, s.self_text)
    sample = None
    if s.guard != "off":
        window = calibration_window(s.calibration_seq_len, positions)
        apart = SelfTextSettings(
            tokens=math.ceil(GUARD_WINDOWS * window * MARGIN), seed=(seed + SAMPLE_SEED_OFFSET) % 2**31, device=s.device
        )
        sample = self_text(str(folder), apart.check(), log=log, progress=s.progress).path
    facts = OwnText(s.self_text, round(share, 6), written.tokens, written.documents, seed, sampling.temperature,
                    sampling.top_p, written.sha256, sha)  # fmt: skip
    if log:
        log(f"self-text: {share:.0%} of the calibration text ({mix.stat().st_size:,} bytes) written by the model")
    return OwnTextFiles(mix, sample, facts)


def _tokens(s: ConvertSettings, reads: int = 0) -> int:
    """Tokens the model writes: its share of what the stages read (the calibration budget, or the
    distillation's ``reads`` where they are more: the mix ends where the model's text does, so every
    window a stage reads is a distinct one), and a margin."""
    return max(1, math.ceil(s.self_text * max(s.calibration_tokens, reads) * MARGIN))


def _before_guard(folder: Path, s: ConvertSettings, positions: int | None) -> str:
    """The user's text, less its end where the stage guard's windows are (with as much again as a
    margin: decoded tokens may not give back every character), when the guard is on."""
    from mha2gqa.convert.guard import guard_windows
    from mha2gqa.core.models import load_tokenizer
    from mha2gqa.core.text import load_text

    text = load_text(s.calibration, setting="calibration").joined
    if s.guard == "off":
        return text
    ids, _, _ = guard_windows(folder, s.calibration, calibration_window(s.calibration_seq_len, positions))
    if ids is None:
        return text
    tail = load_tokenizer(folder).decode(ids.flatten().tolist(), skip_special_tokens=True)
    return text[: max(0, len(text) - 2 * len(tail))]


def with_own_text(c, log: Callable[[str], None] | None = None, s: ConvertSettings | None = None, reads: int = 0):
    """The conversion ``c`` with its ``--self-text`` written (``c.own``), once; ``s``: the settings that
    ask for it where the conversion's own do not read text (a recipe that only distils); ``reads``: the
    tokens the distillation after it reads."""
    from mha2gqa.core.dims import max_positions

    s = s or c.settings
    if c.own is not None or s.self_text is None or not c.changes:
        return c
    own = own_text(c.ckpt.folder, s, max_positions(c.ckpt.config), log, reads)
    fingerprint = c.fingerprint and c.fingerprint | {FINGERPRINT_KEY: {"mix sha256": own.facts.mix_sha256}}
    return dataclasses.replace(c, own=own, fingerprint=fingerprint)
