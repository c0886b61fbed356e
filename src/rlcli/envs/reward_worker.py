"""``python -m rlcli.envs.reward_worker FILE FUNCTION``: the process a user's ``--reward`` runs in.

It loads ``FUNCTION`` from ``FILE`` once, says ``{"ready": true}`` (or ``{"fatal": why}``), then
answers one JSON line per request ``{"question", "answer", "kwargs"}`` with ``{"reward": x}`` or
``{"error": "TypeName: message"}``. Whatever the function prints goes to stderr (the run's
``console.log``), never into the replies. Its own process, so a call that hangs can be killed
(``reward_fn.Scorer``) without stopping the run, and nothing here imports torch or tinker.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys


def load(path: str, name: str):
    spec = importlib.util.spec_from_file_location("rlcli_user_reward", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # its own helper modules
    spec.loader.exec_module(module)
    function = getattr(module, name, None)
    if not callable(function):
        raise TypeError(f"{name} in {path} is not a function")
    return function


def score(function, request: dict) -> dict:
    try:
        value = function(request["question"], request["answer"], **request["kwargs"])
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e).strip()[:300]}"}
    if isinstance(value, bool) or not isinstance(value, int | float):
        return {"error": f"returned {type(value).__name__} {value!r:.80}, not a number"}
    if not math.isfinite(value):
        return {"error": f"returned {value}, not a finite number"}
    return {"reward": float(value)}


def main(path: str, name: str) -> int:
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr  # the function's prints must not corrupt the replies

    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    try:
        function = load(path, name)
    except BaseException as e:  # a SyntaxError, an ImportError, a sys.exit in the module
        reply({"fatal": f"{type(e).__name__}: {str(e).strip()[:300]}"})
        return 1
    reply({"ready": True})
    for line in sys.stdin:
        if line.strip():
            reply(score(function, json.loads(line)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
