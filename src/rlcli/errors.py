"""The one exception type the CLI turns into a one-line message (see ``cli/main.py``)."""


class RlcliError(Exception):
    """A problem the user can fix; the message says what was wrong and where."""
