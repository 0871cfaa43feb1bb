"""The one exception type sparda raises for bad input or configuration."""


class SpardaError(Exception):
    """A user-facing error: one line saying what is wrong and how to fix it.

    The CLI prints ``error: <message>`` and exits with code 2, with no traceback.
    Library callers can catch it like any other exception.
    """

    exit_code = 2
