"""The one exception type for user errors: bad input, bad options, unsafe output paths."""


class Mha2GqaError(Exception):
    """A problem with what the user asked for. The message is one line that says what is wrong
    and how to fix it; the CLI prints it without a traceback and exits non-zero."""
