"""``rlcli demo``: a real model learns a visible style and a reward, start to finish, offline."""

from __future__ import annotations

from rlcli.cli._output import emit, info


def demo(config) -> None:
    """See a model learn: SmolLM2-135M answers a few questions, learns a pirate voice (SFT) and
    short answers (RL), then answers again; before/after side by side, curves.png in the run
    folder. Starts its own server and stops it when done (also on Ctrl-C). --loop: the
    continual-learning loop instead: SmolLM2 behind an alias answers additions
    through /v1 with capture on, a scripted judge posts verdicts to /v1/feedback, --rounds
    learn rounds go through the gate, then a round on shuffled verdicts the gate must refuse;
    a summary, scores.png and receipt.json in the run folder. On 2 shared CPU cores the defaults
    (3 rounds of 24 questions, then the shuffled round) took 2.5 minutes, the model converted
    already; the first run converts the GGUF too (about 30 s more)."""
    import shutil

    from rlcli.demo.run import run_demo, side_by_side
    from rlcli.home import rlcli_home

    as_json = config.json
    if config.loop:
        _loop(config, rlcli_home())
        return
    result = run_demo(config, rlcli_home(), report=info)
    summary = result.summary()
    if as_json:
        emit(summary, as_json=True)
        return
    print(side_by_side(result, shutil.get_terminal_size((100, 20)).columns))
    emit(
        {
            "model": result.model,
            "style ('Arr!' openings)": f"{summary['style_before']:.0%} -> "
            f"{summary['style_after']:.0%}",
            "SFT loss": _arrow(result.sft_losses, "{:.2f}"),
            "RL reward (short answers)": summary["rl_verdict"]["says"],
            "RL phase": result.rl_plan,
            "reward of the answers above": f"{summary['reward_before']:.2f} -> "
            f"{summary['reward_after']:.2f}",
            "curves": result.plot,
            "run folder": result.run_dir,
            "took": f"{result.seconds:.0f}s",
        },
        as_json=False,
    )


def _loop(config, home) -> None:
    from rlcli.demo.loop import run_loop_demo, summary_lines
    from rlcli.errors import RlcliError

    sizes = (("--steps", config.sft_steps), ("--rl-steps", config.rl_steps))
    given = [flag for flag, value in sizes if value is not None]
    if given:
        raise RlcliError(
            f"demo --loop: {' and '.join(given)} size the SFT/RL demo; the loop's work is "
            "--rounds, --questions and --epochs"
        )
    out = run_loop_demo(config, home, report=info)
    if config.json:
        emit(out, as_json=True)
        return
    print("\n".join(summary_lines(out)))


def _arrow(values: list[float], fmt: str) -> str:
    if not values:
        return "(no steps)"
    return f"{fmt.format(values[0])} -> {fmt.format(values[-1])} over {len(values)} steps"


def register(app) -> None:
    """``rlcli demo`` on ``app``: one flag per field of ``DemoConfig``."""
    from rlcli.demo.run import DemoConfig
    from rlcli.flags import typer_command

    typer_command(app, "demo", DemoConfig, demo, help=demo.__doc__)
