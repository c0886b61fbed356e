"""``python -m rlcli.recipes.child RUN_DIR``: run the recipe a spec describes (see runner.py).

A failure ends with one ``rlcli-error:`` line (the exception, and where the full log is),
which the parent shows as the error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rlcli.recipes.runner import SPEC, SUMMARY


def main(run_dir: str) -> int:
    try:
        return _run(Path(run_dir))
    except Exception as e:  # the full traceback stays in console.log; the user gets one line
        import traceback

        traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0][:500]
        print(
            f"rlcli-error: the run failed with {type(e).__name__}: {first} "
            f"(details: {Path(run_dir) / 'console.log'})",
            flush=True,
        )
        return 1


def _run(folder: Path) -> int:
    spec = json.loads((folder / SPEC).read_text())
    if spec["recipe"] == "sl":
        from rlcli.recipes import sl

        summary = sl.run_in_child(spec)
    elif spec["recipe"] == "rl":
        from rlcli.recipes import rl

        summary = rl.run_in_child(spec)
    else:
        print(f"rlcli-error: unknown recipe {spec['recipe']!r}", flush=True)
        return 2
    (folder / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
