"""The one error type users see: a single sentence, exit status 2, no traceback."""


class K31Error(Exception):
    """Invalid input: names the offending setting and the valid choices."""

    exit_code = 2
