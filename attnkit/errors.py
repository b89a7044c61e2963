"""The one exception type the CLI turns into a one-line message and a non-zero exit."""


class AttnkitError(Exception):
    """A user-facing error: bad input, unsupported model, missing file.

    Raise it with a message that says what is wrong and, where possible, what to do.
    The CLI prints `attnkit: error: <message>` and exits with status 2.
    """
