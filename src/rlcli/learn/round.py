"""One round of ``rlcli learn``: judged traces -> train from the alias's state -> evaluate the
candidate beside the served adapter -> promote through the gate -> a receipt.

Every step is a command a user can run by hand (``train sl``, ``alias set``); a round strings
them together with a gate, and leaves its files in ``$RLCLI_HOME/learn/<alias>/<round>/``:

    plan.json       which traces (by id) train and which are held out, the alias's version at
                    the start, data hashes and counts          (written first: the round exists)
    train.jsonl     the rows trained on (SFT rows, DPO pairs, or RL prompts); run/ the
                    ``train sl|dpo|rl`` run folder (it resumes after a crash)
    trained.json    the candidate's checkpoints and the training metrics
    evaluated.json  both sides' answers and scores on the held-out and regression sets
    receipt.json    the decision and everything above    (written last: the round is done)

A rerun finds the unfinished round and continues it from the last file written, so a crash
never trains twice on the same traces (the run folder resumes), never loses a trace (a trace
is used only once a plan names it), and the alias moves only in the promote step, one atomic
switch on the server, recognised on a rerun by the candidate it named. One round per alias
at a time: a lock file, held for the round (a second ``learn`` on it is refused).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlcli.errors import RlcliError, RunFailed
from rlcli.files import atomic
from rlcli.learn import gate, judge
from rlcli.learn.folder import (
    EVALUATED,
    LOCK,
    PLAN,
    RECEIPT,
    REGRESSION,
    TRAIN,
    TRAINED,
    learn_dir,
    rounds,
)
from rlcli.learn.report import plot
from rlcli.learn.traces import Trace, read_traces, split

SAVE_EVERY = 2  # steps between a round's training checkpoints: a crash loses at most these


class NotEnoughTraces(RlcliError):
    """Too few new judged traces for a round (``--watch`` waits for more)."""


@dataclass
class LearnOptions:
    alias: str
    traces: list[str] = field(default_factory=list)
    base_url: str | None = None
    method: str = "auto"
    held_out: float = 0.25
    min_traces: int = 8
    margin: float = 1.0  # points (0-100) the candidate must gain on the held-out set
    max_regression: float = 2.0  # points the regression set may drop
    regression: str | None = None
    reward: str | None = None
    epochs: int = 3
    lr: float = 1e-4
    batch_size: int = 8
    group_size: int = 4  # rl: answers sampled per prompt
    lora_rank: int = 16
    max_tokens: int = 64
    seed: int = 0
    dry_run: bool = False
    judge: str | None = None  # a model that scores the gate pairwise (learn/judge.py)
    judge_base_url: str | None = None  # its OpenAI-compatible server (default: base_url's)
    judge_api_key: str | None = None  # default: our server's key there, else $OPENAI_API_KEY


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def _write(path: Path, data) -> None:
    atomic.write_text(path, json.dumps(data, indent=2, default=str) + "\n", fsync=True)


@contextlib.contextmanager
def locked(alias: str) -> Iterator[None]:
    """One round per alias at a time; a second is refused in one line, naming the holder."""
    folder = learn_dir(alias)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise RlcliError(
                f"learn --alias {alias}: a round is already running on this alias (pid "
                f"{holder}); wait for it or stop it"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        yield


# ---- the round ---------------------------------------------------------------------------


def run_round(opts: LearnOptions, say: Callable[[str], None]) -> dict:
    """One round, or the rest of an unfinished one; the receipt (or the plan with dry_run)."""
    from rlcli.client import aliases, endpoint

    url, source = endpoint.resolve_base_url(opts.base_url)
    endpoint.check_server(url, source=source)
    served = aliases.resolve(url, opts.alias)
    with contextlib.ExitStack() as stack:
        if not opts.dry_run:
            stack.enter_context(locked(opts.alias))
        folder = _unfinished(opts.alias)
        if folder is None:
            plan = _plan(opts, served, say, url)
            if opts.dry_run:
                return plan
            folder = learn_dir(opts.alias) / f"{plan['round']:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            _write_regression(opts, plan)
            with atomic.replacing(folder / TRAIN) as tmp:
                tmp.write_text("".join(json.dumps(r) + "\n" for r in plan.pop("_rows")))
            _write(folder / PLAN, plan)
        elif opts.dry_run:
            return {**_read(folder / PLAN), "resuming": True}
        else:
            say(f"round {folder.name}: resuming where it stopped")
            if opts.judge and not (folder / EVALUATED).exists():
                judge.check(_judge(opts, url))
        return _finish(opts, url, folder, say)


def _judge(opts: LearnOptions, url: str) -> judge.Judge:
    return judge.make(opts.judge, opts.judge_base_url, opts.judge_api_key, url)


def _unfinished(alias: str) -> Path | None:
    done = rounds(alias)
    return done[-1] if done and not (done[-1] / RECEIPT).exists() else None


def _plan(opts: LearnOptions, served: dict, say, url: str) -> dict:
    started = time.time()
    found = read_traces(opts.traces) if opts.traces else None
    if found is None:
        raise RlcliError("learn: pass --traces FILE (imported or captured traces with feedback)")
    used = _used_ids(opts.alias)
    new = [t for t in found.traces if t.id not in used]
    train, held = split(new, opts.held_out)
    usable = [t for t in train if t.target]
    method = _method(opts, usable)
    if len(new) < opts.min_traces or not (usable or method == "rl"):
        raise NotEnoughTraces(
            f"learn --alias {opts.alias}: {len(new)} judged traces not used before "
            f"({len(usable)} with a right answer to train on); a round needs at least "
            f"{opts.min_traces} (--min-traces) and one with a correction or a good verdict"
        )
    # a --reward grades any question; otherwise only traces with a right answer can be trained
    rows = _rows(method, train if method == "rl" and opts.reward else usable, opts)
    if not rows:
        why = "no trace with a question to ask"
        if method == "dpo":
            why = "no trace with a correction that differs from the served answer to make a pair of"
        raise NotEnoughTraces(f"learn --alias {opts.alias} --method {method}: {why}")
    number = len(rounds(opts.alias)) + 1
    plan = {
        "round": number,
        "alias": opts.alias,
        "current": served,
        "method": method,
        "traces": {
            "new": len(new),
            "train": len(train),
            "held_out": len(held),
            "trained_on": len(rows),
            "skipped": dict(found.skipped),
            "already_used": len(found.traces) - len(new),
        },
        "train_ids": [t.id for t in train],
        "held_out": [_keep(t) for t in held],
        "data_sha256": _digest(rows),
        "options": {k: v for k, v in asdict(opts).items() if k != "judge_api_key"},
        "judge": _judge(opts, url).describe() if opts.judge else None,
        "seconds": {"data": round(time.time() - started, 2)},
        "_rows": rows,
    }
    if opts.judge:  # once a round is due (not at each --watch look), before anything is written
        judge.check(_judge(opts, url))
    say(
        f"round {number}: {len(new)} new judged traces: {len(rows)} to train on ({method}), "
        f"{len(held)} held out; alias {opts.alias} serves {served['checkpoint']}"
    )
    return plan


def _method(opts: LearnOptions, usable: list[Trace]) -> str:
    """``auto``: RL on the logged prompts when the verdicts are scores with no right answer
    and a ``--reward`` grades; else SFT on the right answers."""
    if opts.method == "auto":
        return "rl" if opts.reward and not usable else "sl"
    if opts.method in ("sl", "dpo"):
        return opts.method
    if opts.method == "rl":
        if not usable and not opts.reward:
            raise RlcliError(
                f"learn --alias {opts.alias} --method rl: no trace with a right answer (a "
                "correction or a good verdict) to grade by exact match, and no --reward "
                "FILE.py:FN to grade with"
            )
        return "rl"
    raise RlcliError(
        f"--method {opts.method}: learn trains with sl (corrections and answers judged good), "
        "dpo (corrections against the answers they corrected) or rl (the logged prompts, "
        "graded by --reward or by exact match to the right answer)"
    )


def _rows(method: str, traces: list[Trace], opts: LearnOptions) -> list[dict]:
    """The training rows. ``rl``: ``train rl --dataset`` rows, the question (the last user
    turn) with ``answer`` (the right answer, matched exactly) or, with ``--reward``, the
    right answer as ``reference`` (None where the verdict gave none); ``--epochs`` passes
    written out, as ``train rl`` makes one pass over its file."""
    if method == "sl":
        return [{"messages": [*t.prompt, {"role": "assistant", "content": t.target}]}
                for t in traces]  # fmt: skip
    if method == "rl":
        key = "reference" if opts.reward else "answer"
        once = [{"question": _question(t.prompt), key: t.target} for t in traces]
        once = [r for r in once if r["question"].strip()]
        return once * opts.epochs
    return [{"prompt": t.prompt, "chosen": [{"role": "assistant", "content": t.target}],
             "rejected": [{"role": "assistant", "content": t.answer}]}
            for t in traces if gate.normalize(t.target) != gate.normalize(t.answer)]  # fmt: skip


def _keep(t: Trace) -> dict:
    return {"id": t.id, "prompt": t.prompt, "target": t.target, "answer": t.answer}


def _digest(rows) -> str:
    return hashlib.sha256("".join(json.dumps(r, sort_keys=True) for r in rows).encode()).hexdigest()


def _used_ids(alias: str) -> set[str]:
    used: set[str] = set()
    for folder in rounds(alias):
        plan = _read(folder / PLAN)
        used.update(plan["train_ids"])
        used.update(t["id"] for t in plan["held_out"])
    return used


def _write_regression(opts: LearnOptions, plan: dict) -> None:
    """The regression set, frozen: ``--regression FILE``'s judged traces, else the first
    round's held-out traces."""
    path = learn_dir(opts.alias) / REGRESSION
    if path.exists():
        return
    if opts.regression:  # all of them: a judge or a reward needs no right answer
        kept = [_keep(t) for t in read_traces([opts.regression]).traces]
    else:
        kept = plan["held_out"]
    with atomic.replacing(path, fsync=True) as tmp:
        tmp.write_text("".join(json.dumps(t) + "\n" for t in kept))


def _held_out_pool(alias: str, graded: bool = False) -> list[dict]:
    """Every held-out trace with a right answer, of every round so far (never trained on);
    ``graded`` (a ``--judge``, or an rl round with ``--reward``): every held-out trace, the
    judge or the reward scores it."""
    pool = []
    for folder in rounds(alias):
        pool += [t for t in _read(folder / PLAN)["held_out"] if t["target"] or graded]
    return pool


def _finish(opts: LearnOptions, url: str, folder: Path, say) -> dict:
    plan = _read(folder / PLAN)
    if not (folder / TRAINED).exists():
        _write(folder / TRAINED, _train(opts, url, folder, plan, say))
    trained = _read(folder / TRAINED)
    if not (folder / EVALUATED).exists():
        _write(folder / EVALUATED, _evaluate(opts, url, plan, trained, say))
    evaluated = _read(folder / EVALUATED)
    receipt = _promote(opts, url, folder, plan, trained, evaluated, say)
    _write(folder / RECEIPT, receipt)
    with contextlib.suppress(Exception):  # a plot is a convenience; the receipt stands
        plot(opts.alias)
    return receipt


def _train(opts: LearnOptions, url: str, folder: Path, plan: dict, say) -> dict:
    """``train sl`` (or ``train dpo``, ``train rl``) in the round's run folder, from the
    alias's state; a rerun after a crash resumes that folder, so no step is trained twice."""
    from rlcli import recipes
    from rlcli.recipes import flow
    from rlcli.recipes.dpo import DPOOptions
    from rlcli.recipes.rl import RLOptions
    from rlcli.recipes.sl import SLOptions

    started = time.time()
    rows = plan["traces"]["trained_on"]
    common = dict(
        model=plan["current"]["base_model"], dataset=str(folder / TRAIN), base_url=url,
        batch_size=min(opts.batch_size, rows), epochs=opts.epochs, lr=opts.lr,
        lora_rank=opts.lora_rank, seed=opts.seed, save_every=SAVE_EVERY,
        log_path=str(folder / "run"), init_checkpoint=plan["current"].get("state"),
    )  # fmt: skip
    if plan["method"] == "dpo":
        options = DPOOptions(**common)
    elif plan["method"] == "rl":
        options = RLOptions(
            **{k: v for k, v in common.items() if k != "epochs"}, group_size=opts.group_size,
            max_tokens=opts.max_tokens, reward=opts.reward,
        )  # fmt: skip
    else:
        options = SLOptions(**common, train_on="last")
    say(
        f"round {plan['round']}: training ({plan['method']}) from "
        f"{plan['current'].get('state') or 'the base model'} ({rows} rows)"
    )
    try:
        outcome = flow.train(recipes.get(plan["method"]), options, say=say)
    except RunFailed as e:
        if e.exit_code == 1:
            raise
        # a signal (Ctrl-C): the recipe's "Resume with: rlcli train ..." would finish the run
        # but not the round; learn continues both
        raise RlcliError(
            f"learn --alias {opts.alias}: round {plan['round']} stopped in training "
            f"({e.error}); the alias is unchanged. Run the same `rlcli learn` again to "
            "continue the round from its last checkpoint",
            exit_code=e.exit_code,
        ) from None
    summary = outcome.summary or {}
    if not summary.get("sampler_path"):
        raise RlcliError(f"round {plan['round']}: training saved no sampler checkpoint")
    return {"summary": summary, "seconds": round(time.time() - started, 2)}


def _evaluate(opts: LearnOptions, url: str, plan: dict, trained: dict, say) -> dict:
    started = time.time()
    reward = _reward(opts.reward)
    sides = {
        "current": plan["current"]["checkpoint"],
        "candidate": trained["summary"]["sampler_path"],
    }
    judged_by = _judge(opts, url) if opts.judge else None
    graded = judged_by is not None or (plan["method"] == "rl" and reward is not None)
    sets = {"held_out": _held_out_pool(opts.alias, graded)}
    regression = [
        t for t in _read_lines(learn_dir(opts.alias) / REGRESSION) if t["target"] or graded
    ]
    if regression:
        sets["regression"] = regression
    out: dict = {"seconds": 0.0}
    for name, items in sets.items():
        if not items:
            continue
        prompts = [t["prompt"] for t in items]
        targets = [t["target"] for t in items]
        questions = [_question(p) for p in prompts]
        result = {"ids": [t["id"] for t in items]}
        given = {}
        for side, model in sides.items():
            say(f"round {plan['round']}: {name}: {len(items)} answers from the {side} adapter")
            given[side] = gate.answers(url, model, prompts, opts.max_tokens)
        if judged_by is not None:
            say(f"round {plan['round']}: {name}: {judged_by.model} judges {len(items)} pairs")
            shown = [judge.conversation(p) for p in prompts]
            verdicts = judge.compare(judged_by, shown, given["current"], given["candidate"])
            result["judge"] = verdicts | {
                "examples": judge.examples(verdicts, shown, given["current"], given["candidate"])
            }
            won = verdicts["scores"]
            scored = {"current": gate.Scores([1 - s for s in won]), "candidate": gate.Scores(won)}
        else:
            scored = {
                side: gate.score_all(given[side], targets, reward, questions) for side in sides
            }
        for side in sides:
            result[side] = {
                **scored[side].summary(),
                "answers": given[side],
                "scores": scored[side].values,
            }
        result["difference"] = gate.paired(scored["current"], scored["candidate"])
        out[name] = result
    out["seconds"] = round(time.time() - started, 2)
    return out


def _reward(spec: str | None):
    """``--reward FILE.py:FN`` as ``train rl`` runs it: ``FN(question, answer, reference=...)``
    in its own process; an error or a timeout scores 0."""
    if not spec:
        return None
    from rlcli.envs import reward_fn

    path, name = reward_fn.check_spec(spec)
    scorer = reward_fn.scorer(str(path), name, 30.0, None)

    def reward(question: str, answer: str, target: str) -> float:
        return scorer("learn", question, answer, {"reference": target})[0]

    return reward


def _question(prompt: list[dict]) -> str:
    users = [m for m in prompt if m.get("role") == "user"]
    return str(users[-1].get("content") or "") if users else ""


def _read_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _promote(opts, url, folder: Path, plan, trained, evaluated, say) -> dict:
    from rlcli.client import aliases

    started = time.time()
    held = evaluated.get("held_out")
    if held is None:
        what = "trace" if opts.judge else "trace with a right answer"
        promote, why = False, f"no held-out {what} yet: nothing to judge by"
    else:
        promote, why = gate.decide(
            held, evaluated.get("regression"), opts.margin, opts.max_regression
        )
    candidate = trained["summary"]["sampler_path"]
    tag = f"learn round {plan['round']}"
    now = aliases.resolve(url, opts.alias)
    if promote and now["checkpoint"] != candidate:
        if now["checkpoint"] != plan["current"]["checkpoint"]:
            promote = False
            why = f"the alias moved to {now['checkpoint']} during the round; not promoted"
        else:
            aliases.set_alias(
                url,
                opts.alias,
                candidate,
                state=trained["summary"]["state_path"],
                why=f"{tag}: {why}",
                by=aliases.who(f"rlcli {tag}"),
            )
    say(f"round {plan['round']}: {'promoted' if promote else 'kept the alias'}: {why}")
    seconds = {
        **plan["seconds"],
        "train": trained["seconds"],
        "eval": evaluated["seconds"],
        "promote": round(time.time() - started, 2),
    }
    return {
        "round": plan["round"],
        "alias": opts.alias,
        "decision": "promoted" if promote else "refused",
        "why": why,
        "current": plan["current"],
        "candidate": {
            "checkpoint": candidate,
            "state": trained["summary"]["state_path"],
            "run_dir": trained["summary"].get("run_dir"),
        },
        "method": plan["method"],
        "traces": plan["traces"],
        "data_sha256": plan["data_sha256"],
        "train": {k: v for k, v in trained["summary"].items() if k not in ("run_dir",)},
        "scores": {
            name: {
                side: {
                    k: v for k, v in evaluated[name][side].items() if k not in ("answers", "scores")
                }
                for side in ("current", "candidate")
            }
            | {"difference": evaluated[name]["difference"]}
            for name in ("held_out", "regression")
            if name in evaluated
        },
        "gate": {"margin": opts.margin, "max_regression": opts.max_regression},
        "judge": _verdicts(plan, evaluated),
        "seconds": seconds,
        "finished": time.time(),
    }


def _verdicts(plan: dict, evaluated: dict) -> dict | None:
    """The judge's verdicts for the receipt: counts and a few examples per set (all of them
    are in ``evaluated.json``)."""
    sets = {
        n: evaluated[n]["judge"]
        for n in ("held_out", "regression")
        if "judge" in evaluated.get(n, {})
    }
    if not sets:
        return None
    keep = ("wins", "ties", "losses", "unreadable", "split", "examples")
    return {**(plan.get("judge") or {}), **{n: {k: v[k] for k in keep} for n, v in sets.items()}}
