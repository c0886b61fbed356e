"""``rlcli eval``: score a policy on an RL environment (the library: ``rlcli.client.evaluate``).

``eval rl``'s flags come from ``EvalOptions`` through the same options machinery as the train
commands, so ``--config FILE`` works the same way. Results go to stdout (a table, or JSON with
every task); progress to stderr (a Rich bar on a terminal, plain lines otherwise).
"""

from __future__ import annotations

import sys

import typer

from rlcli import flags
from rlcli.cli._output import emit, info
from rlcli.client.evaluate import EvalOptions, evaluate

app = typer.Typer(
    help="Evaluate a policy: reward statistics on an environment.", no_args_is_help=True
)

SHOWN = (
    ("model", "model"),
    ("checkpoint", "checkpoint"),
    ("tasks", "tasks"),
    ("mean_reward", "mean reward"),
    ("std_reward", "std"),
    ("pass_rate", "pass rate"),
    ("tokens_generated", "tokens generated"),
    ("seconds", "seconds"),
    ("tasks_per_s", "tasks/s"),
    ("tokens_per_s", "tokens/s"),
)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table(result: dict) -> None:
    """One column per policy (base, checkpoint, and their difference with --compare)."""
    context = _context(result)
    if "difference" not in result:
        rows = {"env": result["env"], "seed": result["seed"], "context": context}
        emit(rows | {name: _fmt(result[key]) for key, name in SHOWN}, as_json=False)
        return
    title = (
        f"eval rl: {result['env']} ({result['tasks']} tasks, seed {result['seed']}, "
        f"context: {context})"
    )
    base, trained, diff = result["base"], result["checkpoint"], result["difference"]
    other = trained["policy"]  # "checkpoint", or "hypernet"
    rows = [
        {
            "": name,
            "base": _fmt(base[key]),
            other: _fmt(trained[key]),
            "difference": _fmt(diff[key]) if key in diff else "",
        }
        for key, name in SHOWN
    ]
    emit(rows, as_json=False, title=title)


def _context(result: dict) -> str:
    """Where each task's context document was: in the prompt, removed, or internalized."""
    mode = result.get("context", "prompt")
    if mode == "hypernet":
        made = result["internalized"]
        counts = f"{made['made']} adapters made, {made['reused']} reused"
        return f"internalized by {result['hypernet']} ({counts})"
    return {"prompt": "in the prompt", "removed": "removed (--without-context)"}.get(mode, mode)


class Progress:
    """Tasks done per policy: a Rich bar on a terminal, else a line every tenth of the tasks
    or every ``EVERY_S`` seconds, whichever comes first (a long evaluation never goes quiet)."""

    EVERY_S = 5.0

    def __init__(self) -> None:
        self.bar = None
        self.tty = sys.stderr.isatty()
        self.ids: dict[str, int] = {}
        self.shown: dict[str, int] = {}
        self.shown_at: dict[str, float] = {}

    def _start(self) -> None:
        """The bar starts with the first task (after the lines about the server and renderer)."""
        if self.tty and self.bar is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

            self.bar = Progress(
                "[bold]{task.description}",
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=False,
            )
            self.bar.start()

    def __call__(self, label: str, done: int, total: int) -> None:
        self._start()
        if self.bar is not None:
            if label not in self.ids:
                self.ids[label] = self.bar.add_task(f"scoring {label}", total=total)
            self.bar.update(self.ids[label], completed=done)
            return
        import time

        step, now = max(1, total // 10), time.monotonic()
        before = self.shown.get(label, 0)
        due = now - self.shown_at.get(label, now) >= self.EVERY_S and done > before
        if done in (0, total) or done // step > before // step or due:
            self.shown[label], self.shown_at[label] = done, now
            info(f"scoring {label}: {done}/{total} tasks")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _exit_on_sigterm() -> None:
    """SIGTERM and Ctrl-C end the command where it is, through every ``finally`` (a Harbor
    evaluation removes its containers there): exit 143 and 130. Once stopping, what asyncio
    reports about the tasks cut short ("exception was never retrieved", "Event loop is
    closed" from a subprocess transport collected late) is noise, and is not shown."""
    import logging
    import signal

    def stopping(signum: int) -> None:
        signal.signal(signum, signal.SIG_IGN)  # a second Ctrl-C does not cut the cleanup short
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        sys.unraisablehook = lambda unraisable: None

    def on_term(signum, frame):
        stopping(signum)
        raise SystemExit(143)

    def on_int(signum, frame):
        stopping(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_int)


def run(opts: EvalOptions) -> None:
    import logging

    # The SDK warns "Retrying request ... because of try_again" each time a long batch outlasts
    # the server's 35 s poll window: normal waiting, which the progress display already shows.
    logging.getLogger("tinker.lib.api_future_impl").setLevel(logging.ERROR)
    _exit_on_sigterm()
    progress = Progress()
    try:
        result = evaluate(opts, report=progress, info=info)
    finally:
        progress.close()
    if opts.json:
        emit(result, as_json=True)
    else:
        table(result)


flags.typer_command(
    app,
    "rl",
    EvalOptions,
    run,
    help="Score a policy (a base model or a sampler checkpoint) on an RL environment: mean and "
    "std of the reward, pass rate, tokens, time; --compare puts base and checkpoint side by side.",
)
