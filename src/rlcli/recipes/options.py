"""Every ``rlcli train`` option declared once, as a dataclass field.

Each command has one ``kw_only`` dataclass (``SLOptions``, ``RLOptions``, ...) whose fields
carry their default and, in ``metadata``, their help, extra flag spellings, choices and bounds.
From that one declaration come: the command's CLI flags (``typer_command``: ``--help`` shows
every default), the ``--config FILE`` loader (``load``: same names, flags win over the file),
the checks (``check``: choices and bounds, one line naming the flag), the resolved options a
dry run prints and the run folder keeps as ``config.yaml`` (``saved`` / ``write_config``), and
the resume command. Flags every train command shares live once in ``TrainOptions``; a new
command subclasses it (or ``PolicyOptions`` for RL-style commands), adds its own fields, and
``retune``s a shared field's default where it differs. Nothing here imports torch or tinker,
so ``rlcli train sl --help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlcli.errors import RlcliError
from rlcli.runs.folder import SPEC

CONFIG_FILE = "config.yaml"  # the cookbook writes its own config.json beside it


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    flags: tuple[str, ...] = (),
    choices: tuple[str, ...] | None = None,
    min: float | None = None,
    gt: float | None = None,
    lt: float | None = None,
    json_value: bool = False,
    saved: bool = True,
) -> Any:
    """A field of an options dataclass. No default: required (on the command line or in
    ``--config``). ``flags``: extra spellings (``--learning-rate``); ``choices``, ``min``
    (inclusive), ``gt`` / ``lt`` (exclusive): checked by ``check``; ``json_value``: a JSON
    object given as a string on the command line and as a mapping in a config file;
    ``saved=False``: a switch of this invocation (``--dry-run``), not a setting of the run."""
    meta = {
        "help": help,
        "flags": flags,
        "choices": choices,
        "min": min,
        "gt": gt,
        "lt": lt,
        "json_value": json_value,
        "saved": saved,
    }
    return field(default=default, metadata=meta)


def retune(cls: type, name: str, default: Any) -> Any:
    """The shared field ``name`` of ``cls`` with another default (help and checks kept)."""
    base = next(f for f in dataclasses.fields(cls) if f.name == name)
    return field(default=default, metadata=base.metadata)


@dataclass(kw_only=True)
class TrainOptions:
    """Flags every ``rlcli train`` command has."""

    model: str = option(help="Base model: hub id or local folder.")
    base_url: str | None = option(
        None,
        "Tinker server (default: $TINKER_BASE_URL, else the server `rlcli serve` runs here, "
        "else http://localhost:8000).",
    )
    renderer: str | None = option(None, "Chat renderer (default: recommended for the model).")
    lora_rank: int = option(32, "LoRA rank.", min=1)
    lora_alpha: float | None = option(
        None,
        "LoRA alpha: updates scale by alpha/rank (default: the server's, 32 on Tinker and on "
        "rlcli's server). rlcli's torch server only: the Tinker API carries no alpha.",
        gt=0,
    )
    lr: float = option(1e-4, "Learning rate.", flags=("--learning-rate",), gt=0)
    save_every: int = option(20, "Checkpoint every N steps (0: only at the end).", min=0)
    max_steps: int | None = option(None, "Stop after this many steps.", min=1)
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
    dry_run: bool = option(False, "Print the plan; contact no server.", saved=False)
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
        "Loss computed on the server.",
        choices=("importance_sampling", "ppo", "cispo", "dro", "gspo", "dppo", "ppo_critic"),
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


# ---- the options as the command line sees them ----------------------------------------------


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _fields(cls: type) -> list[dataclasses.Field]:
    return list(dataclasses.fields(cls))


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _base_type(hint: Any) -> type:
    """``int | None`` -> ``int``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _help_order(cls: type) -> list[dataclasses.Field]:
    """Required flags, then the command's own, then the shared ones, then the switches."""
    shared = {f.name for f in _fields(TrainOptions)}
    return sorted(
        _fields(cls),
        key=lambda f: (not _required(f), not f.metadata["saved"], f.name in shared),
    )


def _source(ctx, name: str) -> str:
    """Where click took a parameter's value from (typer may bundle its own click, so by name)."""
    return getattr(ctx.get_parameter_source(name), "name", "")


def typer_command(app, name: str, cls: type, run, help: str) -> None:
    """Register ``name`` on the Typer ``app``: one flag per field of ``cls``; ``run(options)``
    gets the instance built from the flags given and the ``--config`` file (``load``)."""
    import inspect

    import typer

    hints = _hints(cls)
    params = [inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)]
    for f in _help_order(cls):
        meta, kind = f.metadata, _base_type(hints[f.name])
        default = None if _required(f) else f.default
        text = meta["help"]
        if meta["choices"]:
            text += f" One of: {', '.join(meta['choices'])}."
        if _required(f):
            text += " (required)"
        opt = typer.Option(
            default,
            flag(f.name),
            *meta["flags"],
            help=text,
            show_default=default is not None and default is not False,
        )
        annotation = kind if kind is bool else typing.Optional[kind]  # noqa: UP045
        params.append(
            inspect.Parameter(
                f.name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=annotation
            )
        )

    def command(ctx: typer.Context, **values: Any) -> None:
        given = {k for k in values if _source(ctx, k) == "COMMANDLINE"}
        run(load(cls, values, given))

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__ = help
    app.command(name, help=help)(command)


# ---- config files ---------------------------------------------------------------------------


def read_config_file(path: str) -> dict[str, Any]:
    """A YAML or TOML (by extension) mapping of option names to values."""
    file = Path(path).expanduser()
    try:
        text = file.read_text()
    except OSError as e:
        raise RlcliError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    try:
        if file.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise RlcliError(f"--config {path}: not valid {_kind(file)} ({first})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RlcliError(f"--config {path}: expected a mapping of option names to values")
    return data


def _kind(file: Path) -> str:
    return "TOML" if file.suffix == ".toml" else "YAML"


def _names(cls: type) -> dict[str, str]:
    """Every spelling a config file may use (``lr``, ``learning_rate``, ``learning-rate``) ->
    the field name."""
    names = {}
    for f in _fields(cls):
        if not f.metadata["saved"]:
            continue
        for spelling in (f.name, *(s.lstrip("-") for s in f.metadata["flags"])):
            names[spelling.replace("-", "_")] = f.name
    return names


def _from_file(cls: type, data: dict[str, Any], path: str) -> dict[str, Any]:
    names, switches = _names(cls), {f.name for f in _fields(cls) if not f.metadata["saved"]}
    hints = _hints(cls)
    out = {}
    for key, value in data.items():
        norm = str(key).replace("-", "_")
        if norm in switches:
            raise RlcliError(
                f"--config {path}: {key!r} is a command-line switch ({flag(norm)}), not a setting"
            )
        if norm not in names:
            near = difflib.get_close_matches(norm, list(names), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise RlcliError(f"--config {path}: unknown key {key!r}{hint}")
        name = names[norm]
        f = next(f for f in _fields(cls) if f.name == name)
        out[name] = _coerce(f, hints[name], value, f"--config {path}: {key}")
    return out


def _coerce(f: dataclasses.Field, hint: Any, value: Any, where: str) -> Any:
    """A file value as the field's type (YAML reads ``1e-4`` as a string: numbers in strings
    are accepted); anything else is one line naming the key."""
    kind = _base_type(hint)
    optional = type(None) in typing.get_args(hint)
    if value is None:
        if optional or f.default is None:
            return None
        raise RlcliError(f"{where}: needs a value")
    if f.metadata["json_value"] and isinstance(value, dict):
        return json.dumps(value)
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif kind is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif kind is str and isinstance(value, str):
        return value
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    raise RlcliError(f"{where}: expected {expected.get(kind, kind)}, got {value!r}")


# ---- one instance from the flags and the file -----------------------------------------------


def load(cls: type, values: dict[str, Any], given: set[str]):
    """``cls`` from the command line (``values``; ``given``: the flags actually typed) over
    the ``--config`` file over the defaults, then checked."""
    merged: dict[str, Any] = {f.name: f.default for f in _fields(cls) if not _required(f)}
    if values.get("config"):
        merged.update(_from_file(cls, read_config_file(values["config"]), values["config"]))
    merged.update({k: v for k, v in values.items() if k in given})
    for k in ("config", "dry_run", "json"):
        if k in values:
            merged[k] = values[k]
    missing = [f.name for f in _fields(cls) if _required(f) and merged.get(f.name) is None]
    if missing:
        name = missing[0]
        raise RlcliError(f"missing {flag(name)} (a flag, or `{name}:` in a --config file)")
    opts = cls(**merged)
    check(opts)
    return opts


def check(opts) -> None:
    """Choices and bounds from the fields' metadata: the first bad one is one line."""
    for f in _fields(type(opts)):
        value, meta = getattr(opts, f.name), f.metadata
        if value is None:
            continue
        if meta["choices"] and value not in meta["choices"]:
            raise RlcliError(f"{flag(f.name)} {value}: choose from {', '.join(meta['choices'])}")
        low, gt, lt = meta["min"], meta["gt"], meta["lt"]
        if (
            (low is not None and value < low)
            or (gt is not None and not value > gt)
            or (lt is not None and not value < lt)
        ):
            raise RlcliError(f"{flag(f.name)} {value}: must be {_bounds(low, gt, lt)}")


def _bounds(low, gt, lt) -> str:
    if low is not None and lt is not None:
        return f"in [{low:g}, {lt:g})"
    if low is not None:
        return f"at least {low:g}"
    if gt is not None and lt is not None:
        return f"in ({gt:g}, {lt:g})"
    if gt is not None:
        return f"greater than {gt:g}"
    return f"less than {lt:g}"


# ---- what a run keeps -----------------------------------------------------------------------


def saved(opts) -> dict[str, Any]:
    """The run's settings (switches such as ``--dry-run`` left out), JSON objects as mappings:
    what a dry run prints, ``config.yaml`` holds and the recipe is built from."""
    out = {}
    for f in _fields(type(opts)):
        if not f.metadata["saved"]:
            continue
        value = getattr(opts, f.name)
        if f.metadata["json_value"] and isinstance(value, str):
            value = json.loads(value)
        out[f.name] = value
    return out


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
        if command.startswith("rlcli train ") and isinstance(settings, dict):
            return command, settings
    try:
        spec = json.loads((Path(run_dir) / SPEC).read_text())
        return f"rlcli train {spec['recipe']}", dict(spec["options"])
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
