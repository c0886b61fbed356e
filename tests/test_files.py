"""The shared leaves: whole-or-nothing writes, the one JSONL rule, last lines, and the
tinker:// rules the client shares with the server."""

from __future__ import annotations

import contextlib
import json
import os

import pytest

from rlcli.checkpoint_format import TinkerPathError, parse_tinker_path
from rlcli.client.sample_chat import split_tinker_path
from rlcli.errors import RlcliError
from rlcli.files import atomic
from rlcli.files.jsonl import read_jsonl
from rlcli.files.lastline import last_error_line, last_line
from rlcli.server.store.checkpoints import CheckpointError
from rlcli.server.store.checkpoints import parse_tinker_path as server_parse


def test_atomic_write_replaces_whole_and_leaves_nothing_behind(tmp_path):
    target = tmp_path / "record.json"
    target.write_text("old\n")
    atomic.write_text(target, "new\n", fsync=True)
    assert target.read_text() == "new\n"
    assert os.stat(target).st_mode & 0o777 == 0o666 & ~_umask()  # like any file
    with pytest.raises(ZeroDivisionError), atomic.replacing(target) as tmp:
        tmp.write_text("half")
        raise ZeroDivisionError  # the writer dies mid-way: the old file stands, no temp file
    assert target.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def rows(*steps) -> str:
    return "".join(json.dumps({"step": s}) + "\n" for s in steps)


def test_jsonl_reads_whole_lines_and_leaves_the_one_being_written(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_jsonl(path) == ([], 0)  # not there yet
    path.write_text(rows(0, 1) + '{"step": 2, "lo')  # the last line is still being written
    assert read_jsonl(path) == ([{"step": 0}, {"step": 1}], 2)
    with path.open("a") as f:
        f.write('ss": 1}\n')
    assert read_jsonl(path, 2) == ([{"step": 2, "loss": 1}], 3)  # read once it is whole


def test_jsonl_skips_a_torn_line_a_resumed_writer_completed(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text(rows(0, 1) + '{"step": 2, "lo' + rows(2, 3))
    found, seen = read_jsonl(path)
    assert [r["step"] for r in found] == [0, 1, 3] and seen == 4
    read_jsonl(path)
    assert capsys.readouterr().err.count("line 3 is torn") == 1  # said once


@pytest.mark.parametrize("bad", ["not json at all", "[1, 2]", '{"step": 2,, }'])
def test_jsonl_any_other_bad_line_is_an_error_naming_file_and_line(tmp_path, bad):
    path = tmp_path / "checkpoints.jsonl"
    path.write_text(rows(0) + bad + "\n" + rows(1))
    with pytest.raises(RlcliError, match=rf"{path} line 2: not "):
        read_jsonl(path)


def test_last_lines():
    assert last_line(b"first\nlast  \n\n") == "last"
    assert last_line("") is None
    log = "starting\nValueError: bad config\nshutting down\n"
    assert last_error_line(log) == "ValueError: bad config"
    assert last_error_line("all fine\n") is None
    assert last_error_line("x\nrlcli-error: no server\ny\n", "rlcli-error: ") == "no server"


@pytest.mark.parametrize(
    "path",
    [
        "tinker://run-1/sampler_weights/000004",
        "tinker://sess:train:0/weights/final",
        "tinker://run/weights/..",
        "tinker://run/weights/.hidden",
        "tinker://../weights/x",
        "tinker://run/weights/a:b",
        "tinker://run/sampler_weights/",
        "tinker://run/other/x",
        "tinker://run/weights/x/y",
        "run/weights/x",
    ],
)
def test_the_client_refuses_exactly_the_paths_the_server_refuses(path):
    try:
        parse_tinker_path(path)
        server_ok = True
    except TinkerPathError:
        server_ok = False
    with pytest.raises(CheckpointError) if not server_ok else contextlib.nullcontext():
        server_parse(path)  # the server's 400s are the same rules
    if server_ok:
        assert split_tinker_path(path) == tuple(path.removeprefix("tinker://").split("/"))
    else:
        with pytest.raises(RlcliError, match="not a checkpoint path"):
            split_tinker_path(path)
