"""Errors the user can fix; the CLI prints them as one line and exits with status 2."""


class InputError(ValueError):
    """Bad input: the message names the problem and, where there is a list, the valid choices."""


def one_line(exc: BaseException, limit: int = 400) -> str:
    """A library's (often multi-line) exception message as one line."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
