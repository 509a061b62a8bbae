"""Errors a user can act on. The CLI prints them as one line, never a traceback."""


class TellerError(Exception):
    """Unusable input or a failed stage: the message names the file, the record and the fix."""


class InputError(TellerError):
    """A source file cannot be read at all (corrupt, truncated beyond repair, unknown schema)."""

    def __init__(self, path, what: str, fix: str):
        self.path = str(path)
        super().__init__(f"{path}: {what}; {fix}")
