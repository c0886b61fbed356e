"""What ``rlcli learn status|history`` show, and the plot of the score per round."""

from __future__ import annotations

import json
from pathlib import Path

from rlcli.learn.folder import EVALUATED, PLAN, PLOT, RECEIPT, TRAINED, learn_dir, rounds


def stage(folder: Path) -> str:
    for name, label in ((RECEIPT, "done"), (EVALUATED, "evaluated"), (TRAINED, "trained")):
        if (folder / name).exists():
            return label
    return "planned"


def history(alias: str) -> list[dict]:
    """One row per round: its stage, decision and held-out scores (both sides)."""
    out = []
    for folder in rounds(alias):
        plan = json.loads((folder / PLAN).read_text())
        row = {
            "round": plan["round"],
            "stage": stage(folder),
            "decision": None,
            "trained_on": plan["traces"]["trained_on"],
            "held_out": None,
            "why": None,
        }
        if (folder / RECEIPT).exists():
            receipt = json.loads((folder / RECEIPT).read_text())
            held = receipt["scores"].get("held_out")
            row |= {
                "decision": receipt["decision"],
                "why": receipt["why"],
                "seconds": sum(receipt["seconds"].values()),
            }
            if held:
                row["held_out"] = (
                    f"{100 * held['current']['mean']:.1f} -> {100 * held['candidate']['mean']:.1f}"
                )
        out.append(row)
    return out


def status(alias: str) -> dict:
    found = rounds(alias)
    last = found[-1] if found else None
    return {
        "alias": alias,
        "folder": str(learn_dir(alias)),
        "rounds": len(found),
        "last_round": last.name if last else None,
        "last_stage": stage(last) if last else None,
    }


def plot(alias: str) -> Path | None:
    """The held-out score of the served adapter and of each round's candidate."""
    receipts = [
        json.loads((f / RECEIPT).read_text()) for f in rounds(alias) if (f / RECEIPT).exists()
    ]
    receipts = [r for r in receipts if r["scores"].get("held_out")]
    if not receipts:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["round"] for r in receipts]
    current = [100 * r["scores"]["held_out"]["current"]["mean"] for r in receipts]
    candidate = [100 * r["scores"]["held_out"]["candidate"]["mean"] for r in receipts]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(x, current, "o-", label="served at the start of the round")
    ax.plot(x, candidate, "s--", label="candidate")
    for r, y in zip(receipts, candidate, strict=True):
        ax.annotate(
            r["decision"],
            (r["round"], y),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
            fontsize=8,
        )
    ax.set_xlabel("round")
    ax.set_ylabel("held-out score (0-100)")
    ax.set_title(f"rlcli learn --alias {alias}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = learn_dir(alias) / PLOT
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
