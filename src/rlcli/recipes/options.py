"""``rlcli train``'s options: the flags every train command shares (``TrainOptions``), those of
the RL-style commands (``PolicyOptions``), and what a run folder keeps of them.

Declared as ``rlcli.flags`` declares any command's options. A new train command subclasses
``TrainOptions`` (or ``PolicyOptions``), adds its own fields, and ``retune``s a shared field's
default where it differs. The resolved options are what a dry run prints and the run folder
keeps as ``config.yaml`` (``write_config``); ``check_same_run`` and ``resume_command`` read them
back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcli.errors import RlcliError
from rlcli.flags import BASE_URL_HELP, flag, option, saved
from rlcli.runs.folder import SPEC

CONFIG_FILE = "config.yaml"  # the cookbook writes its own config.json beside it

# The losses each server backend computes (rlcli's torch server: every one; SkyRL 0.4.0: jax
# serves four, fsdp/megatron add gspo, dppo and ppo_critic, none serves dro). The loss guard
# checks against it; ``--loss``'s help is written from it.
BACKEND_LOSSES = {
    "torch": (
        "cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "dppo",
        "ppo_critic",
    ),
    "jax": ("cross_entropy", "importance_sampling", "ppo", "cispo"),
    "fsdp": ("cross_entropy", "importance_sampling", "ppo", "cispo", "gspo", "dppo", "ppo_critic"),
    "megatron": (
        "cross_entropy", "importance_sampling", "ppo", "cispo", "gspo", "dppo", "ppo_critic",
    ),
}  # fmt: skip
# The policy losses a train command may name. Not ppo_critic: it trains a critic (a value
# head), and the cookbook's RL loops have none.
POLICY_LOSSES = ("importance_sampling", "ppo", "cispo", "dro", "gspo", "dppo")


def _loss_help() -> str:
    """``--loss``'s help: what each backend serves of the policy losses."""
    served = []
    for backend, names in BACKEND_LOSSES.items():
        missing = [n for n in POLICY_LOSSES if n not in names]
        if not missing:
            served.append(f"{backend}: all")
        elif len(missing) <= 2:
            served.append(f"{backend}: all but {', '.join(missing)}")
        else:
            served.append(f"{backend}: {', '.join(n for n in POLICY_LOSSES if n in names)}")
    return "Loss computed on the server; " + "; ".join(served) + "."


@dataclass(kw_only=True)
class TrainOptions:
    """Flags every ``rlcli train`` command has."""

    model: str = option(help="Base model: hub id or local folder.")
    base_url: str | None = option(None, BASE_URL_HELP)
    renderer: str | None = option(None, "Chat renderer (default: recommended for the model).")
    lora_rank: int = option(32, "LoRA rank.", min=1)
    lora_alpha: float | None = option(
        None,
        "LoRA alpha: updates scale by alpha/rank (default: the server's, 32 on Tinker and on "
        "rlcli's server). rlcli's torch server only: the Tinker API carries no alpha.",
        gt=0,
    )
    lora_targets: str | None = option(
        None,
        "Layers LoRA trains: a comma list of attn, mlp, unembed (the Tinker API's train_attn, "
        "train_mlp, train_unembed; default: all three).",
    )
    lr: float = option(1e-4, "Learning rate.", flags=("--learning-rate",), gt=0)
    save_every: int = option(20, "Checkpoint every N steps (0: only at the end).", min=0)
    max_steps: int | None = option(None, "Stop after this many steps.", min=1)
    max_minutes: float | None = option(
        None,
        "Stop cleanly after M minutes (fractions too): at the first step boundary past the "
        "limit, with a checkpoint; exit 0. The resume command it prints continues the run "
        "(with no limit unless given again).",
        gt=0,
        saved=False,
    )
    seed: int = option(
        0, "Seed for data order, LoRA initialisation and rollouts (same seed, same run).", min=0
    )
    log_path: str | None = option(
        None, "Run folder (default: $RLCLI_HOME/runs/<command>-<time>); reuse it to resume."
    )
    wandb_project: str | None = option(
        None, "Weights & Biases project to log to (needs: pip install 'rlcli\\[wandb]')."
    )
    wandb_name: str | None = option(None, "Weights & Biases run name.")
    config: str | None = option(
        None, "YAML or TOML file of options (flags override it).", saved=False
    )
    dry_run: bool = option(
        False,
        "Print the plan and an estimate of the wall time: from an earlier run of the same "
        "settings on the same server, else a calibration of a few steps on the server if one "
        "answers (no run folder is written).",
        saved=False,
    )
    no_estimate: bool = option(False, "With --dry-run: the plan only, no estimate.", saved=False)
    detach: bool = option(
        False,
        "Check everything, then run in the background: print the run id and log, return at "
        "once (follow: rlcli runs show ID -f; stop: rlcli runs cancel ID).",
        saved=False,
    )
    json: bool = option(False, "Print results as JSON.", saved=False)


@dataclass(kw_only=True)
class PolicyOptions(TrainOptions):
    """Flags of the RL-style commands: rollouts, the loss the server computes, the reference."""

    loss: str = option(
        "importance_sampling",
        _loss_help(),
        choices=POLICY_LOSSES,
    )
    loss_config: str | None = option(
        None,
        'Loss settings as JSON, e.g. {"clip_low_threshold": 0.9} for ppo (keys per loss: '
        "README, Losses).",
        json_value=True,
    )
    backend: str | None = option(
        None,
        "Server backend, for the loss guard.",
        choices=("torch", "jax", "fsdp", "megatron"),
    )
    group_size: int = option(8, "Rollouts per problem.", min=2)
    max_tokens: int = option(256, "Longest sampled answer.", min=1)
    temperature: float = option(1.0, "Sampling temperature for rollouts.", gt=0)
    init_checkpoint: str | None = option(
        None, "Start from this checkpoint's weights (tinker://..., e.g. from train sl)."
    )
    kl_penalty_coef: float = option(0.0, "KL penalty against the reference policy (0: off).", min=0)
    kl_reference: str | None = option(
        None, "KL reference: a tinker://.../sampler_weights/... checkpoint (default: base model)."
    )
    eval_every: int = option(0, "Evaluate every N steps (0: never).", min=0)


LORA_TARGETS = ("attn", "mlp", "unembed")


def lora_switches(targets: str | None) -> dict[str, bool] | None:
    """``--lora-targets`` as the Tinker API's switches (``train_attn``, ...); None: the
    server's default. One line naming the flag for an unknown or empty list."""
    if targets is None:
        return None
    names = [t.strip() for t in targets.split(",") if t.strip()]
    unknown = [n for n in names if n not in LORA_TARGETS]
    if unknown or not names:
        raise RlcliError(
            f"--lora-targets {targets!r}: a comma list of {', '.join(LORA_TARGETS)}"
            + (f" ({unknown[0]!r} is none of them)" if unknown else "")
        )
    return {f"train_{t}": t in names for t in LORA_TARGETS}


def write_config(run_dir: Path, opts, command: str) -> Path:
    """``config.yaml`` in the run folder: every resolved setting but the folder itself, so
    ``command --config it`` trains the same run again (add ``--log-path`` to choose where)."""
    import yaml

    settings = {k: v for k, v in saved(opts).items() if k != "log_path"}
    path = run_dir / CONFIG_FILE
    header = (
        f"# {command}: the resolved options of the run in {run_dir}.\n"
        f"# Same run again: {command} --config {path} [--log-path NEW_FOLDER]\n"
    )
    path.write_text(header + yaml.safe_dump(settings, sort_keys=False))
    return path


# Settings a resume may change: where the server is, how far to go (steps or epochs: a
# finished DPO run continues by epochs, since the cookbook records a max_steps stop as the
# last epoch done), how often to save, where to log. Any other difference would train a
# different run into the same folder.
RESUMABLE = ("base_url", "max_steps", "epochs", "save_every", "wandb_project", "wandb_name")


def folder_command(run_dir: Path) -> tuple[str, dict[str, Any]] | None:
    """The command a run folder was started with and its settings (``config.yaml``, else an
    older folder's ``rlcli_spec.json``); None for a folder no train command has used."""
    import yaml

    path = Path(run_dir) / CONFIG_FILE
    try:
        text = path.read_text()
    except OSError:
        text = None
    if text is not None:
        first = text.split("\n", 1)[0]
        command = first.removeprefix("# ").split(":", 1)[0].strip()
        try:
            settings = yaml.safe_load(text)
        except yaml.YAMLError:
            settings = None
        if command.startswith(("rlcli train ", "rlcli internalize")) and isinstance(settings, dict):
            return command, settings
    try:
        spec = json.loads((Path(run_dir) / SPEC).read_text())
        from rlcli import recipes

        return recipes.get(spec["recipe"]).command, dict(spec["options"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_same_run(run_dir: Path, opts, command: str) -> None:
    """A run folder belongs to the command that started it, with its settings (but those in
    ``RESUMABLE``): anything else is one line naming both, before the folder is touched."""
    found = folder_command(run_dir)
    if found is None:
        return
    theirs, settings = found
    if theirs != command:
        raise RlcliError(
            f"--log-path {run_dir}: a `{theirs}` run; `{command}` cannot train into it "
            "(choose another --log-path)"
        )
    ours = {k: v for k, v in saved(opts).items() if k != "log_path"}
    for key, value in settings.items():
        if key in RESUMABLE or key == "log_path":
            continue
        if key not in ours:
            mine = "not an option of this command"
        elif _same_value(ours[key], value):
            continue
        else:
            mine = json.dumps(ours[key])
        raise RlcliError(
            f"--log-path {run_dir}: that run has {flag(key)} {json.dumps(value)}, this command "
            f"{mine}; resume with {resume_command(command, str(run_dir))}, or choose another "
            "--log-path"
        )


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def resume_command(command: str, run_dir: str) -> str:
    """Continue the run in ``run_dir`` with exactly its settings (its ``config.yaml``)."""
    import shlex

    config = str(Path(run_dir) / CONFIG_FILE)
    return shlex.join([*command.split(), "--config", config, "--log-path", str(run_dir)])
