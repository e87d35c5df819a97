"""Errors the user can fix; the CLI prints them as one line and exits with status 2."""


class InputError(ValueError):
    """Bad input: the message names the problem and, where there is a list, the valid choices."""
