"""The data layer's one error: a problem the user can fix, reported as one line by the entry points."""


class DataError(ValueError):
    """A data problem the user can fix: missing, empty or corrupt corpus or token files."""
