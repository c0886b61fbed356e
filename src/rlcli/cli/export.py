"""``rlcli export`` (a checkpoint as a PEFT adapter folder or a merged transformers model) and
``rlcli restore`` (an exported training state onto another server). Their flags are the fields
of ``client/export.ExportOptions`` and ``client/restore.RestoreOptions``; this module only
prints.
"""

from __future__ import annotations

from pathlib import Path

from rlcli import flags
from rlcli.cli._output import emit, info
from rlcli.client.export import ExportOptions
from rlcli.client.restore import RestoreOptions
from rlcli.errors import RlcliError


def export(opts: ExportOptions) -> None:
    """Export a checkpoint: a LoRA adapter folder in PEFT format, or with --merge a full model.

    Built beside -o DIR and renamed into place at the end: a failure leaves DIR as it was.

    DIR/rlcli_export.json records the source; `rlcli restore DIR` moves a --with-optimizer one.
    """
    from rlcli.client import export as exporting
    from rlcli.client.checkpoint_fetch import human
    from rlcli.runs import catalog

    if bool(opts.run) == bool(opts.checkpoint):
        raise RlcliError("pass a RUN folder or --checkpoint tinker://... (one of them)")
    exporting.check_flags(opts.gguf, opts.with_optimizer)
    path = opts.checkpoint or catalog.checkpoint_path(opts.run, opts.with_optimizer)
    result = exporting.export_checkpoint(path, Path(opts.output), opts, say=info)
    if opts.json:
        emit(result, as_json=True)
        return
    if opts.gguf:
        emit({k: v for k, v in result.items() if k != "server"}, as_json=False, title="GGUF")
        return
    files = result.pop("files")
    what = "merged model" if opts.merge else "PEFT adapter"
    emit({k: v for k, v in result.items() if k != "server"}, as_json=False, title=what)
    emit([{"file": f["file"], "size": human(f["bytes"])} for f in files], as_json=False)


def restore(opts: RestoreOptions) -> None:
    """Put an exported training state on a server (rlcli's) under its original tinker:// path.

    The run continues there: `rlcli train sl --log-path RUN --base-url URL` resumes it.
    """
    from rlcli.client import endpoint
    from rlcli.client.restore import restore as restore_state

    url, source = endpoint.resolve_base_url(opts.base_url)
    endpoint.check_server(url, source=source)
    info(endpoint.describe(url, source))
    result = restore_state(
        url, Path(opts.folder), overwrite=opts.overwrite, force=opts.force, say=info
    )
    emit(result, as_json=opts.json, title="restored")


def register(app) -> None:
    """``rlcli export`` and ``rlcli restore`` on ``app``."""
    flags.typer_command(app, "export", ExportOptions, export, help=export.__doc__)
    flags.typer_command(app, "restore", RestoreOptions, restore, help=restore.__doc__)
