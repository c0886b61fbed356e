"""The exception types the CLI turns into a one-line message (see ``cli/main.py``); the Python
API (``rlcli.api``) raises the same ones."""


class RlcliError(Exception):
    """A problem the user can fix; the message says what was wrong and where.

    ``exit_code`` is the process's exit status (1 unless the error stands for a signal:
    130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP, as shells report them).
    """

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Cancelled(RlcliError):
    """A run stopped as asked (``rlcli runs cancel``): its exit code is not 0, but nothing went
    wrong, so the CLI prints the message without ``error:``."""


class RunFailed(RlcliError):
    """A run that started and did not finish (the recipe failed, the server went away, a
    signal stopped it): ``run_dir`` is its folder, ``error`` the one line its record keeps."""

    def __init__(self, message: str, run_dir, error: str, exit_code: int = 1) -> None:
        super().__init__(message, exit_code=exit_code)
        self.run_dir = str(run_dir)
        self.error = error
