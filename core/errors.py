"""The exception types for user errors: bad input, bad options, unsafe output paths."""

from __future__ import annotations


class Mha2GqaError(Exception):
    """A problem with what the user asked for. The message is one line that says what is wrong
    and how to fix it; the CLI prints it without a traceback and exits non-zero."""


class OutOfSpace(Mha2GqaError):
    """The disk (or quota) filled up: the machine's state stopped the run, not a decision of its own,
    so a resumable run keeps its finished work for ``--resume`` once space is freed."""


class SettingError(Mha2GqaError):
    """A bad value of one named setting (a field of a settings dataclass).

    ``message`` contains ``{name}`` where the setting is named: the library says ``calibration_tokens``,
    the CLI ``--calibration-tokens``, a job file ``convert.calibration_tokens`` (:meth:`render`).
    """

    def __init__(self, setting: str, message: str) -> None:
        self.setting = setting
        self.template = message if "{name}" in message else "{name} " + message
        super().__init__(self.render(setting))

    def render(self, name: str) -> str:
        """The message with the setting called ``name``."""
        return self.template.replace("{name}", name)


def config_errors() -> tuple[type[BaseException], ...]:
    """What transformers raises for a config whose values it refuses (a field of the wrong type or a
    bad combination): ``ValueError``, and huggingface_hub's strict-dataclass errors where it has them."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: configs are not strict dataclasses
        return (ValueError,)
    return (ValueError, StrictDataclassError)


def disk_full(e: BaseException) -> bool:
    """``e`` is the OS saying the disk (or the user's quota) is full."""
    import errno

    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def first_line(e: BaseException, limit: int | None = None) -> str:
    """``e``'s message as one line for a one-line error: its first non-blank line (cut to ``limit``
    characters), or its type's name when it says nothing."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return (lines[0] if lines else type(e).__name__)[:limit]
