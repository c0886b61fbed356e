"""A user's own reward for their JSONL rows (``train rl --reward FILE.py:FUNCTION``), the habit
of TRL's ``reward_funcs``: ``FUNCTION(question, answer, **row) -> float`` for every sampled
answer, where ``answer`` is the model's text and ``row`` the row's other fields (its own
``"answer"``, if it has one, arrives as ``reference``).

The function runs in its own process (``reward_worker.py``) started by the recipe child:
``Scorer`` sends it one call at a time and kills and restarts it when a call takes longer than
the timeout. A call that raises, returns something other than a number, or times out scores 0,
is counted in the step's metrics (``reward_error``) and written, with its row's id, to
``reward_errors.jsonl`` in the run folder. ``check_spec`` is the parent's check before any
server work: the file, its syntax and the name, without running the user's code. The cookbook
``Env`` that calls the scorer is ``reward_env.py`` (this module imports no cookbook).
"""

from __future__ import annotations

import ast
import json
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from rlcli.errors import RlcliError

ERRORS_FILE = "reward_errors.jsonl"
STARTUP_TIMEOUT_S = 120.0  # importing the user's module (it may import a big library)


def check_spec(spec: str, flag: str = "--reward") -> tuple[Path, str]:
    """(absolute file, function name) of ``FILE.py:FUNCTION``; one line if either is wrong."""
    file, colon, name = spec.rpartition(":")
    if not colon or not file or not name.isidentifier():
        raise RlcliError(f"{flag} {spec}: expected FILE.py:FUNCTION, e.g. rewards.py:score")
    path = Path(file).expanduser()
    if not path.is_file():
        raise RlcliError(f"{flag} {spec}: no such file {file}")
    try:
        tree = ast.parse(path.read_text(), str(path))
    except SyntaxError as e:
        raise RlcliError(f"{flag} {spec}: {file} line {e.lineno}: {e.msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RlcliError(f"{flag} {spec}: cannot read {file} ({e})") from None
    defined = _top_level_names(tree)
    if name not in defined:
        functions = ", ".join(sorted(defined)) or "none"
        raise RlcliError(
            f"{flag} {spec}: {file} defines no {name!r} (top-level names: {functions})"
        )
    return path.resolve(), name


def _top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def row_kwargs(fields: dict) -> dict:
    """The keyword arguments of a row: its fields but the question, ``answer`` as ``reference``."""
    out = {k: v for k, v in fields.items() if k != "question"}
    if "answer" in out:
        out["reference"] = out.pop("answer")
    return out


class Scorer:
    """The user's function behind a pipe to its worker process; thread-safe, one call at a
    time. ``__call__`` returns (reward, None) or (0.0, why it failed)."""

    def __init__(self, path: str, name: str, timeout: float, errors_path: str | None) -> None:
        self.path, self.name, self.timeout = path, name, timeout
        self.errors_path = Path(errors_path) if errors_path else None
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def __call__(self, row_id: str, question: str, answer: str, kwargs: dict):
        request = {"question": question, "answer": answer, "kwargs": kwargs}
        with self.lock:
            reply = self._ask(json.dumps(request))
        if "reward" in reply:
            return reply["reward"], None
        error = reply["error"]
        if self.errors_path is not None:
            with self.errors_path.open("a") as f:
                f.write(json.dumps({"row": row_id, "error": error}) + "\n")
        print(f"rlcli: --reward on {row_id}: {error}", file=sys.stderr, flush=True)
        return 0.0, error

    def _start(self) -> None:
        argv = [sys.executable, "-m", "rlcli.envs.reward_worker", self.path, self.name]
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        first = self._read(STARTUP_TIMEOUT_S)
        if first is None or "fatal" in first:
            why = first["fatal"] if first else f"no answer in {STARTUP_TIMEOUT_S:g}s"
            self.close()
            raise RlcliError(f"--reward {self.path}:{self.name}: cannot load it ({why})")

    def _ask(self, line: str) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self._read(self.timeout)
        if reply is None:  # hung or died: a fresh worker for the next call
            died = self.proc.poll() is not None
            self.close()
            return {"error": "the process running it died" if died else
                    f"took longer than {self.timeout:g}s (--reward-timeout)"}  # fmt: skip
        return reply

    def _read(self, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            line = self.proc.stdout.readline()
            if not line:
                return None  # the worker exited
            if line.strip():
                return json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


_scorers: dict[tuple, Scorer] = {}


def scorer(path: str, name: str, timeout: float, errors_path: str | None) -> Scorer:
    """One worker per function in this process, shared by every env that uses it."""
    key = (path, name, timeout, errors_path)
    if key not in _scorers:
        _scorers[key] = Scorer(path, name, timeout, errors_path)
    return _scorers[key]
