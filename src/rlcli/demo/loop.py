"""``rlcli demo --loop``: the continual-learning loop, start to finish, offline.

A model is served behind an alias with capture on; each round a stream of fresh two-digit
additions goes through ``/v1`` to the alias (captured, as any app's calls are), a scripted
judge posts a verdict for each answer to ``POST /v1/feedback`` (score 1 for the sum, else 0
with the sum as a correction), and ``learn`` runs one round on the capture folder (held out by
trace id, trained from the alias's state, promoted only past the gate: ``learn/round.py``).
After the rounds one more is trained on shuffled verdicts (every answer judged wrong, the
correction a wrong sum): the gate must refuse it.

``run_loop`` is the loop on a server that is already running (``benchmarks/learn_loop_smollm2.py``
calls ``run_loop_demo`` too, so the demo and its receipt are one code path); ``run_loop_demo``
starts the server, keeps the run folder (``record.DemoFolder``: ``runs list`` shows it), and
writes ``receipt.json`` and ``scores.png`` in it; ``summary_lines`` is the one screen it ends on.
"""

from __future__ import annotations

import json
import random
import shutil
import textwrap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rlcli.errors import RlcliError

QUESTION = "What is {a} + {b}? Reply with the number only."
MAX_TOKENS = 12  # an answer is a number: a longer one is wrong anyway
JUDGE = "scripted-judge"
LEARNED_POINTS = 5.0  # the served alias must gain this many held-out points to have "learned"


@dataclass
class LoopSettings:
    """What the loop does (``DemoConfig``'s --rounds, --questions, --epochs, --lr, --seed)."""

    rounds: int = 3
    questions: int = 24
    epochs: int = 3
    lr: float = 1e-3
    seed: int = 0
    margin: float = 1.0  # held-out points a candidate must gain to be promoted (learn's gate)


# ---- the questions and the judge ------------------------------------------------------------


def make_questions(rng: random.Random, n: int) -> list[tuple[int, int]]:
    return [(rng.randint(10, 49), rng.randint(10, 49)) for _ in range(n)]


def ask(base_url: str, alias: str, questions: list[tuple[int, int]]) -> list[tuple[str, str]]:
    """(trace id, answer) per question, asked of the alias through /v1 as any app would
    (greedy, together so the server batches them); the id is the capture's header."""
    import openai

    from rlcli import trace_format

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="tml-dummy", max_retries=2)

    def one(q: tuple[int, int]) -> tuple[str, str]:
        raw = client.chat.completions.with_raw_response.create(
            model=alias, max_tokens=MAX_TOKENS, temperature=0, seed=0,
            messages=[{"role": "user", "content": QUESTION.format(a=q[0], b=q[1])}],
        )  # fmt: skip
        trace_id = raw.headers.get(trace_format.TRACE_ID_HEADER)
        if not trace_id:
            raise RlcliError(f"{base_url}: the server is not capturing (no trace id in /v1)")
        return trace_id, raw.parse().choices[0].message.content or ""

    try:
        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(one, questions))
    except openai.APIError as e:
        raise RlcliError(f"asking {alias} at {base_url}/v1 failed: {e}") from None


def right(answer: str, a: int, b: int) -> bool:
    return answer.strip().rstrip(".") == str(a + b)


def judge(questions, replies, rng: random.Random, shuffled: bool) -> list[dict]:
    """The scripted judge's verdicts, as ``POST /v1/feedback`` bodies: score 1 for the right
    sum, else 0 and the sum as the correction; ``shuffled``: every answer 0 and a wrong sum
    as the correction (the round the gate must refuse)."""
    verdicts = []
    for (a, b), (trace_id, answer) in zip(questions, replies, strict=True):
        good = right(answer, a, b) and not shuffled
        target = str(a + b + rng.randint(1, 9)) if shuffled else str(a + b)
        verdicts.append({
            "run_id": trace_id, "key": "correct", "score": 1 if good else 0,
            "correction": None if good else target, "source": JUDGE,
        })  # fmt: skip
    return verdicts


def post_feedback(base_url: str, verdicts: list[dict]) -> None:
    import httpx

    with httpx.Client(base_url=base_url, timeout=30) as client:
        for verdict in verdicts:
            reply = client.post("/v1/feedback", json=verdict)
            if reply.status_code != 200:
                raise RlcliError(f"POST {base_url}/v1/feedback: {reply.status_code} {reply.text}")


def wait_on_disk(folder: Path, ids: set[str], timeout: float = 60.0) -> None:
    """Until every trace and its verdict are in the capture folder (its writer thread
    appends soon after the reply), so the round reads them all."""
    from rlcli import trace_format

    deadline = time.monotonic() + timeout
    while True:
        traces = {r.get("id") for r in trace_format.read(folder, trace_format.TRACES)}
        judged = {r.get("run_id") for r in trace_format.read(folder, trace_format.FEEDBACK)}
        if ids <= traces and ids <= judged:
            return
        if time.monotonic() > deadline:
            raise RlcliError(f"{folder}: the captured traces or verdicts were not written in time")
        time.sleep(0.2)


# ---- the loop -------------------------------------------------------------------------------


def run_loop(
    base_url: str,
    model: str,
    capture: Path,
    alias: str,
    settings: LoopSettings,
    say: Callable[[str], None],
    on_round: Callable[[dict], None] | None = None,
) -> dict:
    """The rounds on a capturing server: the alias set to ``model``, ``settings.rounds``
    rounds of asked -> judged -> ``learn``, the served alias against the base model on every
    held-out question of those rounds, then the shuffled round. ``on_round``: each round's row."""
    from rlcli.client import aliases
    from rlcli.learn.round import LearnOptions, run_round

    aliases.set_alias(base_url, alias, model, why="the base model", by="rlcli demo --loop")
    rng = random.Random(settings.seed)
    rows: list[dict] = []
    out: dict = {"alias": alias, "model": model, "capture": str(capture), "rounds": rows}
    plan = [False] * settings.rounds + [True]  # the last round: shuffled verdicts
    for number, shuffled in enumerate(plan, start=1):
        kind = "shuffled verdicts" if shuffled else "verdicts"
        questions = make_questions(rng, settings.questions)
        asked = time.time()
        say(f"round {number}: asking {alias} {len(questions)} additions through /v1 (captured)")
        replies = ask(base_url, alias, questions)
        verdicts = judge(questions, replies, rng, shuffled)
        say(f"round {number}: the judge posts {len(verdicts)} {kind} to /v1/feedback")
        post_feedback(base_url, verdicts)
        wait_on_disk(capture, {v["run_id"] for v in verdicts})
        opts = LearnOptions(
            alias=alias, traces=[str(capture)], base_url=base_url, epochs=settings.epochs,
            lr=settings.lr, max_tokens=MAX_TOKENS, margin=settings.margin, seed=settings.seed,
            min_traces=min(8, settings.questions),
        )  # fmt: skip
        receipt = run_round(opts, say)
        held = receipt["scores"].get("held_out", {})
        current = (held.get("current") or {}).get("mean")
        candidate = (held.get("candidate") or {}).get("mean")
        right_asked = sum(right(r[1], *q) for q, r in zip(questions, replies, strict=True))
        row = {
            "round": number, "shuffled_verdicts": shuffled, "decision": receipt["decision"],
            "why": receipt["why"], "asked": len(questions),
            "right_while_asked": right_asked,
            "held_out_n": (held.get("current") or {}).get("n", 0),
            "held_out_current": current, "held_out_candidate": candidate,
            "held_out_served_after": candidate if receipt["decision"] == "promoted" else current,
            "regression": receipt["scores"].get("regression"), "seconds": receipt["seconds"],
            "capture_to_decision_s": round(time.time() - asked, 1), "traces": receipt["traces"],
        }  # fmt: skip
        rows.append(row)
        if on_round is not None:
            on_round(row)
        if number == settings.rounds:  # before the shuffled round: what the loop learned
            out["held_out_all"] = _held_out_all(base_url, model, alias, say)
    out["verdict"] = verdict(out)
    return out


def _held_out_all(base_url: str, model: str, alias: str, say: Callable[[str], None]) -> dict:
    """The base model and the served alias on every held-out question so far (the honest
    rounds': none was trained on, and their right answers are right)."""
    from rlcli.client import aliases
    from rlcli.learn import gate
    from rlcli.learn.folder import PLAN, rounds

    pool = []
    for folder in rounds(alias):
        pool += [t for t in json.loads((folder / PLAN).read_text())["held_out"] if t["target"]]
    if not pool:
        return {"questions": 0}
    prompts, targets = [t["prompt"] for t in pool], [t["target"] for t in pool]
    served = aliases.resolve(base_url, alias)["checkpoint"]
    say(f"all {len(pool)} held-out questions so far: the base model against the served alias")
    before = gate.score_all(gate.answers(base_url, model, prompts, MAX_TOKENS), targets, None, [])
    after = before
    if served != model:
        after = gate.score_all(
            gate.answers(base_url, served, prompts, MAX_TOKENS), targets, None, []
        )
    return {
        "questions": len(pool), "base": before.summary(), "served_after": after.summary(),
        "gain_points": round(100 * (after.mean - before.mean), 1), "served": served,
    }  # fmt: skip


def verdict(out: dict) -> dict:
    """Did it learn, and did the gate refuse the shuffled round? ``learned``: a round was
    promoted and the served alias gained ``LEARNED_POINTS`` or more on every held-out
    question against the base model; ``says`` puts it plainly either way."""
    honest = [r for r in out["rounds"] if not r["shuffled_verdicts"]]
    shuffled = [r for r in out["rounds"] if r["shuffled_verdicts"]]
    promoted = sum(r["decision"] == "promoted" for r in honest)
    whole = out.get("held_out_all") or {}
    gain = whole.get("gain_points")
    learned = bool(promoted) and gain is not None and gain >= LEARNED_POINTS
    if learned:
        says = (
            f"learned: {_pct(whole['base'])} -> {_pct(whole['served_after'])} right on all "
            f"{whole['questions']} held-out questions (+{gain:.1f} points), {promoted} of "
            f"{len(honest)} rounds promoted"
        )
    elif not whole.get("questions"):
        says = "did not learn: no held-out question with a right answer to judge by"
    else:
        says = (
            f"did not learn: {_pct(whole['base'])} -> {_pct(whole['served_after'])} right on all "
            f"{whole['questions']} held-out questions ({gain:+.1f} points; {promoted} of "
            f"{len(honest)} rounds promoted); not a result"
        )
    refused = bool(shuffled) and shuffled[-1]["decision"] == "refused"
    if shuffled:
        gate_says = (
            f"shuffled round refused: {shuffled[-1]['why']}"
            if refused
            else f"shuffled round PROMOTED (the gate failed): {shuffled[-1]['why']}"
        )
    else:
        gate_says = "no shuffled round ran"
    return {"learned": learned, "says": says, "shuffled_refused": refused, "gate_says": gate_says}


def _pct(summary: dict) -> str:
    return f"{round(summary['mean'] * summary['n'])}/{summary['n']}"


# ---- the demo: a server, a run folder, the receipt and the plot -----------------------------


def run_loop_demo(
    config,
    home: Path,
    report: Callable[[str], None],
    on_round: Callable[[dict], None] | None = None,
) -> dict:
    """``rlcli demo --loop``: a capturing server of the demo's model, ``run_loop`` on it, the
    run folder (``runs list`` shows it: one row per round), ``receipt.json`` and ``scores.png``
    in it. The server is stopped on the way out whatever happens; Ctrl-C before the first
    round ends leaves no run folder (nor the alias's learn folder). ``on_round``: each round's
    row as it ends (the benchmark writes its receipt as it goes)."""
    import dataclasses
    import logging

    from rlcli.demo.record import DemoFolder
    from rlcli.demo.run import _run_dir, demo_model, demo_server, free_port
    from rlcli.launch import torch_server as torch_backend
    from rlcli.learn.folder import learn_dir

    logging.getLogger("tinker").setLevel(logging.ERROR)
    started = time.monotonic()
    settings = LoopSettings(
        rounds=config.rounds, questions=config.questions, epochs=config.epochs,
        lr=config.sft_lr, seed=config.seed,
    )  # fmt: skip
    model = demo_model(config.base_model, home, report)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    default = dataclasses.replace(config, log_path=str(home / "runs" / f"demo-loop-{stamp}"))
    run_dir = _run_dir(config if config.log_path else default, home)
    alias = f"demo-loop-{stamp}"  # its own learn folder: rounds of earlier demos are not mixed in
    runs = DemoFolder(run_dir, model, settings.rounds + 1, options={"loop": True, "alias": alias})
    demo_home = home / "demo"
    demo_home.mkdir(parents=True, exist_ok=True)
    capture = demo_home / f"traces-{stamp}"
    port = free_port()
    options = torch_backend.TorchServerOptions(
        base_model=model, port=port, device="cpu", dtype=config.dtype, capture=str(capture),
        checkpoints_dir=str(demo_home / "checkpoints"),
    )  # fmt: skip
    report(f"starting a server for {model} on 127.0.0.1:{port}, capturing into {capture}")

    def record_round(row: dict) -> None:
        runs.row({
            "step": row["round"] - 1, "phase": "shuffled" if row["shuffled_verdicts"] else "learn",
            "held_out": row["held_out_served_after"], "decision": row["decision"],
            "seconds": sum(row["seconds"].values()),
        })  # fmt: skip
        if on_round is not None:
            on_round(row)

    try:
        with demo_server(demo_home, options, report, lambda: time.monotonic() - started) as record:
            runs.open()
            out = run_loop(record.base_url, model, capture, alias, settings, report, record_round)
    except BaseException as e:
        interrupted = isinstance(e, KeyboardInterrupt)
        if runs.rows == 0:
            shutil.rmtree(learn_dir(alias), ignore_errors=True)
        if interrupted:
            runs.close("interrupted", 130, "interrupted (Ctrl-C or SIGTERM)")
        else:
            runs.close("failed", 1, f"{type(e).__name__}: {str(e)[:300]}")
        raise
    out["seconds"] = round(time.monotonic() - started, 1)
    out["settings"] = {**vars(settings), "dtype": config.dtype}
    out["run_dir"] = str(run_dir)
    out["receipt"] = str(run_dir / "receipt.json")
    out["plot"] = str(plot_scores(run_dir / "scores.png", out))
    out["learn_dir"] = str(learn_dir(alias))
    (run_dir / "receipt.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    runs.close("finished", 0, None)
    return out


def plot_scores(path: Path, out: dict) -> Path:
    """The served alias's held-out score before the first round and after each (the shuffled
    round marked), each round's candidate beside it; titled with the verdict."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = [r for r in out["rounds"] if r["held_out_current"] is not None]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    if rows:
        x = [0] + [r["round"] for r in rows]
        served = [100 * rows[0]["held_out_current"]] + [
            100 * r["held_out_served_after"] for r in rows
        ]
        ax.plot(x, served, "o-", label="served alias (held-out, after the round)")
        ax.plot([r["round"] for r in rows], [100 * r["held_out_candidate"] for r in rows], "s--",
                alpha=0.6, label="the round's candidate")  # fmt: skip
        for r in rows:
            label = r["decision"] + (" (shuffled)" if r["shuffled_verdicts"] else "")
            point = (r["round"], 100 * r["held_out_candidate"])
            ax.annotate(label, point, textcoords="offset points", xytext=(0, 8), ha="center",
                        fontsize=8)  # fmt: skip
    ax.set_title("\n".join(textwrap.wrap(out["verdict"]["says"], 90)), fontsize=9)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round (0: the base model)")
    ax.set_ylabel("held-out right (%)")
    ax.set_ylim(-5, 105)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return path


def summary_lines(out: dict) -> list[str]:
    """The one screen the demo ends on: a row per round, the verdict, where things are."""
    lines = [f"{'round':<6}{'asked':>6}{'right':>7}  {'held-out served -> candidate':<30}decision"]
    for r in out["rounds"]:
        held = "(none held out)"
        if r["held_out_current"] is not None:
            held = (
                f"{100 * r['held_out_current']:5.1f} -> {100 * r['held_out_candidate']:5.1f}"
                f"  (n={r['held_out_n']})"
            )
        name = f"{r['round']}{'*' if r['shuffled_verdicts'] else ''}"
        lines.append(
            f"{name:<6}{r['asked']:>6}{r['right_while_asked']:>7}  {held:<30}{r['decision']}"
            f"  ({r['capture_to_decision_s']:.0f}s)"
        )
    lines += [
        "* trained on shuffled verdicts (wrong corrections): the gate must refuse it",
        "",
        out["verdict"]["says"],
        out["verdict"]["gate_says"],
        f"plot:    {out['plot']}",
        f"took:    {out['seconds']:.0f}s",
        f"receipt: {out['receipt']}",
    ]
    return lines
