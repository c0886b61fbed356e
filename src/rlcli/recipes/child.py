"""``python -m rlcli.recipes.child RUN_DIR``: run the recipe a spec describes (see runner.py).

Errors rlcli can explain are printed as one ``rlcli-error:`` line, which the parent shows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rlcli.recipes.runner import SPEC, SUMMARY


def main(run_dir: str) -> int:
    folder = Path(run_dir)
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
