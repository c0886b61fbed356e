"""Command options declared once, as the fields of a ``kw_only`` dataclass.

Each field carries its default and, in ``metadata`` (``option``), its help, extra flag
spellings, choices and bounds. From that one declaration come: the command's CLI flags
(``typer_command``: ``--help`` shows every default), the ``--config FILE`` loader (``load``:
same names, flags win over the file) for commands with a ``config`` field, the checks
(``check``: choices and bounds, one line naming the flag), and the settings a run keeps
(``saved``). ``rlcli train``'s options (``recipes/options.py``), ``rlcli eval``'s, the demo's and
``rlcli export``'s are declared this way. Nothing here imports torch or tinker, so ``--help``
stays fast.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from dataclasses import field
from pathlib import Path
from typing import Any

from rlcli.errors import RlcliError

# --base-url's help, wherever a command has it (client/endpoint.resolve_base_url's order).
BASE_URL_HELP = (
    "Tinker server (default: $TINKER_BASE_URL, else the server `rlcli serve` runs here, "
    "else http://localhost:8000)."
)


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
    argument: bool = False,
) -> Any:
    """A field of an options dataclass. No default: required (on the command line or in
    ``--config``). ``flags``: extra spellings (``--learning-rate``); ``choices``, ``min``
    (inclusive), ``gt`` / ``lt`` (exclusive): checked by ``check``; ``json_value``: a JSON
    object given as a string on the command line and as a mapping in a config file;
    ``saved=False``: a switch of this invocation (``--dry-run``), not a setting of the run;
    ``argument``: given by position (``rlcli export RUN``), not as a flag."""
    meta = {
        "help": help,
        "flags": flags,
        "choices": choices,
        "min": min,
        "gt": gt,
        "lt": lt,
        "json_value": json_value,
        "saved": saved,
        "argument": argument,
    }
    return field(default=default, metadata=meta)


def retune(cls: type, name: str, default: Any) -> Any:
    """The shared field ``name`` of ``cls`` with another default (help and checks kept)."""
    base = next(f for f in dataclasses.fields(cls) if f.name == name)
    return field(default=default, metadata=base.metadata)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _fields(cls: type) -> list[dataclasses.Field]:
    return list(dataclasses.fields(cls))


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _base_type(hint: Any) -> type:
    """``int | None`` -> ``int`` (``list[str]`` stays itself)."""
    if typing.get_origin(hint) is list:
        return hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _help_order(cls: type) -> list[dataclasses.Field]:
    """Required flags, then the command's own, then those it inherits, then the switches."""
    base = next((b for b in cls.__mro__[1:] if dataclasses.is_dataclass(b)), None)
    shared = {f.name for f in _fields(base)} if base is not None else set()
    return sorted(
        _fields(cls),
        key=lambda f: (not _required(f), not f.metadata["saved"], f.name in shared),
    )


def _source(ctx, name: str) -> str:
    """Where click took a parameter's value from (typer may bundle its own click, so by name)."""
    return getattr(ctx.get_parameter_source(name), "name", "")


def typer_command(app, name: str, cls: type, run, help: str) -> None:
    """Register ``name`` on the Typer ``app``: one flag per field of ``cls`` (a positional
    argument where the field says ``argument=True``); ``run(options)`` gets the instance built
    from the flags given and the ``--config`` file (``load``)."""
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
        if meta["argument"]:
            opt = typer.Argument(
                default, metavar=f.name.upper(), help=text, show_default=default is not None
            )
        else:
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
    if typing.get_origin(kind) is list:  # a list of strings (one string is a list of one)
        items = [value] if isinstance(value, str) else value
        if isinstance(items, list) and items and all(isinstance(v, str) for v in items):
            return items
        raise RlcliError(f"{where}: expected a string or a list of strings, got {value!r}")
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
    missing = [f for f in _fields(cls) if _required(f) and merged.get(f.name) is None]
    if missing:
        name = missing[0].name
        if missing[0].metadata["argument"]:
            raise RlcliError(f"missing {name.upper()}")
        where = f" (a flag, or `{name}:` in a --config file)" if "config" in merged else ""
        raise RlcliError(f"missing {flag(name)}{where}")
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
