"""The one exception type that means "the user asked for something invalid"."""


class UsageError(Exception):
    """Bad input: entry points print its message as one line and exit with status 2."""
