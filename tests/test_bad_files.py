"""Files and numbers a user passes that are not what they claim: each is one ``error:`` line
naming the file or flag, never a traceback, and nothing is written.

GGUF files are checked in one place (``models/gguf.check_gguf``), which ``serve start
--base-model X.gguf`` and ``models import-gguf`` both go through; ports in one place
(``launch/process.check_port``). All in-process: every refusal comes before a server starts."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from conftest import cli


def _valid_gguf(path: Path) -> bytes:
    """A well-formed GGUF of two float32 tensors (not a model transformers can load)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((4, 8), np.float32))
    writer.add_tensor("output_norm.weight", np.ones((8,), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def _tensor_past_the_end(data: bytes) -> bytes:
    """The last tensor's offset (after its name, dimension count, dimensions and type) moved
    a megabyte past the end of the file."""
    name = b"output_norm.weight"
    at = data.index(name) + len(name)
    (dims,) = struct.unpack_from("<I", data, at)
    out = bytearray(data)
    struct.pack_into("<Q", out, at + 4 + 8 * dims + 4, 1 << 20)
    return bytes(out)


# name -> (bytes from the valid file, what the one line says)
CORRUPT = {
    "empty": (lambda d: b"", "the file is empty"),
    "wrong magic": (lambda d: b"PK\x03\x04" + d[4:], "not a GGUF file"),
    "three bytes": (lambda d: d[:3], "not a GGUF file"),
    "header only": (lambda d: d[:24], "truncated or corrupt GGUF"),
    "no fields": (lambda d: b"GGUF" + struct.pack("<IQQ", 3, 0, 0), "without general.arch"),
    "truncated": (lambda d: d[: len(d) // 2], "truncated or corrupt GGUF"),
    "last bytes cut": (lambda d: d[:-10], "truncated or corrupt GGUF"),
    "tensor past the end": (_tensor_past_the_end, "corrupt GGUF"),
    "not a loadable model": (lambda d: d, "cannot convert"),
}


@pytest.fixture(scope="module")
def valid_gguf(tmp_path_factory) -> bytes:
    return _valid_gguf(tmp_path_factory.mktemp("gguf") / "valid.gguf")


@pytest.mark.parametrize("command", ["serve start", "models import-gguf"])
@pytest.mark.parametrize("case", list(CORRUPT))
def test_a_corrupt_gguf_is_one_line_naming_the_file(case, command, valid_gguf, tmp_path):
    make, says = CORRUPT[case]
    bad = tmp_path / "model.gguf"
    bad.write_bytes(make(valid_gguf))
    home, out = tmp_path / "home", tmp_path / "out"
    if command == "serve start":
        args = ["serve", "start", "--base-model", str(bad), "--dry-run"]
    else:
        args = ["models", "import-gguf", str(bad), str(out)]
    result = cli(*args, env={"RLCLI_HOME": str(home)})
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model.gguf: " in errors[0] and says in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    # nothing converted, nothing half-written
    assert not out.exists()
    assert not list((home / "models").glob("*")) if (home / "models").exists() else True


@pytest.mark.parametrize("port", ["70000", "0", "-1", "65536"])
def test_a_port_out_of_range_is_one_line_naming_the_flag(port, tmp_path):
    result = cli(
        "serve", "start", "--base-model", "org/name", "--port", port, "--dry-run",
        env={"RLCLI_HOME": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"error: --port {port}: not a TCP port; choose one from 1 to 65535"
    )


def test_a_port_that_is_not_a_number_is_a_usage_error_naming_the_flag(tmp_path):
    result = cli("serve", "start", "--base-model", "org/name", "--port", "http", "--dry-run")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "'--port'" in result.stderr
