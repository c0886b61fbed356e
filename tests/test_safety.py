"""Issue #23, "nothing lost, nobody let in": faults injected through the public surfaces (the
CLI, HTTP, the SDK) against real servers on 127.0.0.1, and after each the invariants checked:
the server answers and a training client's forward pass is finite (`assert_server_sound`);
no process of ours is left and nothing is left in the temp dir the servers and CLI runs use
(`nothing_left_behind`, after every test); the folders a fault touched hold what they held
(`tree`, in the tests). Sections follow the issue's items."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from conftest import cli, run_rlcli, start_server

KEY = {"X-API-Key": "tml-dummy"}


# ---- the invariants checked after each fault ----------------------------------------------


def tree(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` (relative path -> size, mtime): to see what changed."""
    out = {}
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file() and not path.is_symlink():
            st = path.stat()
            out[str(path.relative_to(folder))] = (st.st_size, st.st_mtime_ns)
    return out


def descendants(pid: int) -> list[int]:
    """Live processes below ``pid`` (zombies excluded)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            table[int(entry)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, ppid in table.items() if ppid == parent]
        found += kids
        frontier += kids
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def datum(n: int = 12) -> types.Datum:
    ids = [(7 * i + 3) % 200 + 5 for i in range(n + 1)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * n},
    )


def assert_server_sound(base_url: str, trainer=None) -> None:
    """The server answers health and a forward pass, with finite numbers."""
    assert httpx.get(f"{base_url}/api/v1/healthz", timeout=10).status_code == 200
    if trainer is not None:
        out = trainer.forward([datum()], "cross_entropy").result()
        assert math.isfinite(out.metrics["loss:sum"])


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """After each fault: no process of ours left (servers started by fixtures excepted) and
    nothing left in the temp dir servers and CLI runs use (conftest gives them their own)."""
    scratch = Path(os.environ["TMPDIR"])
    files, processes = set(scratch.iterdir()), set(descendants(os.getpid()))
    yield
    deadline = time.monotonic() + 10
    while set(descendants(os.getpid())) - processes and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {p: cmdline(p) for p in set(descendants(os.getpid())) - processes}
    left = {p: c for p, c in left.items() if "multiprocessing.resource_tracker" not in c}
    assert not left, left  # (torch's resource tracker lives as long as this process)
    assert set(scratch.iterdir()) <= files, sorted(set(scratch.iterdir()) - files)


@pytest.fixture(scope="module")
def saved(server, tiny_model):
    """One training client with a step taken, saved as a state and as sampler weights."""
    service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-dummy")
    trainer = service.create_lora_training_client(
        base_model=str(tiny_model), rank=4, seed=0
    ).result()
    trainer.forward_backward([datum()], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    return {
        "trainer": trainer,
        "sampler": trainer.save_weights_for_sampler("safety").result().path,
        "state": trainer.save_state("safety").result().path,
    }


# ---- 1. export --force replaces only what export owns ------------------------------------


def test_export_force_replaces_only_an_earlier_export(server, saved, tmp_path):
    url = ["--base-url", server.base_url]
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("precious")
    (project / "src").mkdir()
    (project / "src" / "main.py").write_text("print('mine')\n")
    before = tree(tmp_path)

    # `-o ~/project --force` and `-o . --force` used to move the folder aside and delete it.
    for target, cwd in ((str(project), None), (".", project)):
        out = run_rlcli("export", "-c", saved["sampler"], "-o", target, "--force", *url, cwd=cwd)
        assert out.returncode == 1, out.stdout
        assert str(project) in out.stderr and "not an earlier export" in out.stderr
        assert len([ln for ln in out.stderr.splitlines() if ln.startswith("error")]) == 1
    assert tree(tmp_path) == before  # nothing changed, nothing left beside it

    # An earlier export is replaced...
    adapter = tmp_path / "adapter"
    first = cli("export", "-c", saved["sampler"], "-o", str(adapter), *url)
    assert first.returncode == 0, first.stderr
    manifest = json.loads((adapter / "rlcli_export.json").read_text())
    assert "adapter_model.safetensors" in manifest["files"]
    again = cli("export", "-c", saved["sampler"], "-o", str(adapter), "--force", *url)
    assert again.returncode == 0, again.stderr
    # ... but not once someone keeps their own files in it.
    (adapter / "README.md").write_text("my notes on this adapter")
    kept = cli("export", "-c", saved["sampler"], "-o", str(adapter), "--force", *url)
    assert kept.returncode == 1 and "README.md" in kept.stderr
    assert (adapter / "README.md").read_text() == "my notes on this adapter"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "project"]
    assert_server_sound(server.base_url, saved["trainer"])


# ---- 2. restore uploads cannot exceed their limits ---------------------------------------


def state_files(base_url: str, path: str) -> dict[str, bytes]:
    """A training state's files as `rlcli export --with-optimizer` gets them."""
    run_id, kind, name = path.removeprefix("tinker://").split("/")
    route = f"{base_url}/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/archive"
    link = httpx.get(route, params={"include_optimizer": "true"}, headers=KEY).json()["url"]
    with tarfile.open(fileobj=io.BytesIO(httpx.get(link).content)) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.size}


def tar_of(files: dict[str, bytes], raw: dict[str, bytes] | None = None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for block in (raw or {}).values():  # members written by hand
            tar.fileobj.write(block)
            tar.offset += len(block)
    return buffer.getvalue()


def gnu_sparse_member(name: str, stored: bytes, realsize: int) -> bytes:
    """A GNU sparse member (type 'S'): ``stored`` at the end of a file of ``realsize`` bytes,
    the rest a hole that tarfile's extractfile reads out as zeros."""
    info = tarfile.TarInfo(name)
    info.size = len(stored)
    info.type = tarfile.GNUTYPE_SPARSE
    header = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))

    def octal(n: int) -> bytes:
        return b"%011o\0" % n

    header[386:398] = octal(realsize - len(stored))  # the one sparse map entry: offset,
    header[398:410] = octal(len(stored))  # bytes stored
    header[483:495] = octal(realsize)  # the file's real size
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header[:512])
    return bytes(header[:512]) + stored + b"\0" * (-len(stored) % 512)


def test_restore_refuses_sparse_members_and_stages_beside_the_checkpoints(server, saved, tmp_path):
    good = state_files(server.base_url, saved["state"])
    checkpoints_root = Path(server.command[server.command.index("--checkpoints-dir") + 1])
    route = f"{server.base_url}/api/v1/rlcli/restore/sparse-run/weights/w"
    files = {k: v for k, v in good.items() if k != "optimizer.pt"}
    bomb = tar_of(files, {"optimizer.pt": gnu_sparse_member("optimizer.pt", b"x" * 64, 64 << 20)})
    assert len(bomb) < 1 << 20  # 64 MiB once unpacked

    def stored() -> dict:  # (archive tars come and go with downloads)
        return {k: v for k, v in tree(checkpoints_root).items() if "archives/" not in k}

    before = stored()
    response = httpx.put(route, content=bomb, headers=KEY, timeout=60)
    assert response.status_code == 400, response.text
    assert "not a plain file" in response.json()["detail"]
    assert stored() == before  # nothing written, nothing left staged
    listed = httpx.get(f"{server.base_url}/api/v1/training_runs/sparse-run", headers=KEY)
    assert listed.status_code == 404

    ok = httpx.put(route, content=tar_of(good), headers=KEY, timeout=60)
    assert ok.status_code == 200, ok.text
    left = [p for p in (checkpoints_root / ".staging").rglob("*") if not p.is_dir()]
    assert left == []  # moved in, nothing left over
    version = Path(os.path.realpath(checkpoints_root / "sparse-run" / "weights" / "w"))
    assert (version / "optimizer.pt").read_bytes() == good["optimizer.pt"]
    assert_server_sound(server.base_url, saved["trainer"])


# ---- 3. every request body has a cap before it is read -----------------------------------

SECRET = "tml-safety-secret"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, tiny_model):
    """A server with an API key and small body caps (64 KiB; uploads 1 MiB)."""
    from rlcli.launch import process

    home = tmp_path_factory.mktemp("guarded-home")
    record = start_server(
        home, tiny_model, api_key=SECRET, max_body_mb=1 / 16, max_upload_gb=1 / 1024
    )
    yield record
    process.stop(home)


def test_every_body_is_capped_before_it_is_read(guarded, tiny_model):
    url, key = guarded.base_url, {"X-API-Key": SECRET}
    big = b"\0" * (80 << 10)

    def chunks(data: bytes):
        for i in range(0, len(data), 8 << 10):
            yield data[i : i + (8 << 10)]

    proto = {**key, "Content-Type": "application/x-protobuf"}
    cases = {
        "forward_backward, declared": ("/api/v1/forward_backward", big, proto),
        "forward_backward, streamed": ("/api/v1/forward_backward", chunks(big), proto),
        "JSON, streamed": ("/api/v1/create_session", chunks(b" " * len(big) + b"{}"), key),
        "JSON, declared": ("/api/v1/asample", b" " * len(big) + b"{}", key),
        "upload over its own cap": ("/api/v1/rlcli/restore/r/weights/w", b"\0" * (2 << 20), key),
        "upload, streamed": ("/api/v1/rlcli/restore/r/weights/w", chunks(b"\0" * (2 << 20)), key),
    }
    for what, (route, body, headers) in cases.items():
        method = "PUT" if "restore" in route else "POST"
        response = httpx.request(method, url + route, content=body, headers=headers, timeout=30)
        assert response.status_code == 413, (what, response.status_code, response.text)
        assert "--max-" in response.json()["detail"], what
    assert httpx.get(f"{url}/api/v1/training_runs/r", headers=key).status_code == 404
    # Bodies under the caps still work: a whole training step through the SDK.
    service = tinker.ServiceClient(base_url=url, api_key=SECRET)
    trainer = service.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    trainer.forward_backward([datum()], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert_server_sound(url, trainer)


# ---- 4. a server reachable from other machines needs a key -------------------------------


def serve_start(home: Path, *args: str):
    from typer.testing import CliRunner

    from rlcli.cli.main import app

    return CliRunner().invoke(
        app, ["serve", "start", "--base-model", "org/model", *args], env={"RLCLI_HOME": str(home)}
    )


def test_exposed_servers_need_a_key(tmp_path, guarded):
    from rlcli.errors import RlcliError

    for args, needle in (
        (["--host", "0.0.0.0", "--dry-run"], "--api-key"),
        (["--host", "192.168.1.20", "--dry-run"], "--api-key"),
        (["--host", "::", "--dry-run"], "--api-key"),
        (["--backend", "jax", "--host", "0.0.0.0", "--dry-run"], "reverse proxy"),
    ):
        result = serve_start(tmp_path, *args)
        assert isinstance(result.exception, RlcliError), (args, result.output)
        message = str(result.exception)
        assert needle in message and "--insecure" in message and "\n" not in message
    assert not (tmp_path / "server.json").exists()
    for args in (
        ["--host", "0.0.0.0", "--api-key", "tml-k", "--dry-run"],
        ["--host", "0.0.0.0", "--insecure", "--dry-run"],
        ["--host", "127.0.0.2", "--dry-run"],
        ["--host", "localhost", "--dry-run"],
        ["--backend", "jax", "--host", "0.0.0.0", "--insecure", "--dry-run"],
    ):
        result = serve_start(tmp_path, *args)
        assert result.exit_code == 0, (args, result.output, result.exception)

    # /rlcli/status: model paths and versions only for the key.
    status = f"{guarded.base_url}/rlcli/status"
    for headers in ({}, {"X-API-Key": "tml-wrong"}):
        brief = httpx.get(status, headers=headers).json()
        assert brief["healthy"] is True
        assert not {"base_model", "engine", "versions", "error"} & set(brief)
        assert guarded.base_model not in json.dumps(brief)
    full = httpx.get(status, headers={"X-API-Key": SECRET}).json()
    assert full["base_model"] == guarded.base_model and full["versions"]
    assert httpx.post(f"{guarded.base_url}/api/v1/create_session", json={}).status_code == 401
    wrong = {"X-API-Key": SECRET[:-1] + "x"}
    assert httpx.post(f"{guarded.base_url}/api/v1/create_session", headers=wrong).status_code == 403
    assert_server_sound(guarded.base_url)


# ---- 5. serve stop never signals a process it did not start -------------------------------


def orphaned_session() -> tuple[int, int, int, int]:
    """A nohup-style job: a session whose leader exited, its member still running.
    (the dead leader's pid, its start ticks, the member's pid, its start ticks)"""
    from rlcli.launch import pids

    leader = subprocess.Popen(
        ["sh", "-c", "sleep 600 >/dev/null 2>&1 & sleep 0.5"], start_new_session=True
    )
    leader_ticks = pids.start_ticks(leader.pid)
    leader.wait()
    (member,) = pids.family(leader.pid)  # found by its session id: the old leader's pid
    return leader.pid, leader_ticks, member, pids.start_ticks(member)


def test_stop_signals_only_what_the_server_record_names(tmp_path):
    from typer.testing import CliRunner

    from rlcli.cli.main import app
    from rlcli.launch import pids

    leader, leader_ticks, member, member_ticks = orphaned_session()
    this_boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    other_boot = "00000000-0000-0000-0000-000000000000"
    try:

        def stop_with(**record) -> str:
            base = {"host": "127.0.0.1", "port": 1, "base_model": "m", "backend": "torch"}
            record = {**base, "log_path": str(tmp_path / "log"), **record}
            (tmp_path / "server.json").write_text(json.dumps(record))
            result = CliRunner().invoke(app, ["serve", "stop", "--grace", "1"],
                                        env={"RLCLI_HOME": str(tmp_path)})  # fmt: skip
            assert result.exit_code == 0, result.output
            assert not (tmp_path / "server.json").exists()
            return result.output

        # A stale record (its pid dead, e.g. after a reboot) whose old pid is now the session
        # id of someone's job: the job is not ours, whatever boot the record is from.
        for boot in (this_boot, other_boot, None):
            stop_with(pid=leader, start_ticks=leader_ticks, boot_id=boot)
            assert pids.pid_alive(member)
        # After a reboot the same pid with the same start time is another process.
        out = stop_with(pid=member, start_ticks=member_ticks, boot_id=other_boot)
        assert "stale record" in out and pids.pid_alive(member)
        # Members recorded in another boot are not ours either; in this boot they are.
        members = {str(member): member_ticks}
        stop_with(pid=leader, start_ticks=leader_ticks, boot_id=other_boot, members=members)
        assert pids.pid_alive(member)
        stop_with(pid=leader, start_ticks=leader_ticks, boot_id=this_boot, members=members)
        deadline = time.monotonic() + 10
        while pids.pid_alive(member) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pids.pid_alive(member)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


# ---- 8. export --merge keeps the base model's dtype ---------------------------------------


def test_merged_export_keeps_a_bf16_base_models_dtype(server, saved, tiny_model, tmp_path):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bf16 = tmp_path / "tiny-bf16"
    AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.bfloat16).save_pretrained(
        bf16
    )
    AutoTokenizer.from_pretrained(str(tiny_model)).save_pretrained(bf16)
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    merged = tmp_path / "merged"
    out = cli(
        "export", "-c", saved["sampler"], "-o", str(merged), "--merge",
        "--base-model", str(bf16), "--base-url", server.base_url,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads((merged / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(merged / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (not iterable)
    assert dtypes == {"BF16"}
    size = (merged / "model.safetensors").stat().st_size
    assert size < 1.1 * (bf16 / "model.safetensors").stat().st_size  # not twice the size
    model = AutoModelForCausalLM.from_pretrained(str(merged))
    assert model.dtype == torch.bfloat16
    assert all(torch.isfinite(p.float()).all() for p in model.parameters())


# ---- 7. the housekeeping task cannot die -------------------------------------------------


def checkpoints_root_of(record) -> Path:
    return Path(record.command[record.command.index("--checkpoints-dir") + 1])


def test_housekeeping_goes_on_past_a_broken_checkpoints_folder(tmp_path, caplog):
    import asyncio

    from rlcli.server.state.sessions import ServerState, SessionRecord, Settings, housekeeping

    root = tmp_path / "checkpoints"
    (root / "stray-run").mkdir(parents=True)
    (root / "stray-run" / "weights").write_text("a stray file where a folder belongs")
    state = ServerState(Settings(base_model="m", checkpoints_dir=str(root), session_timeout=1))

    async def scenario() -> bool:
        task = asyncio.create_task(housekeeping(state, every_s=0.05, sweep_every_s=0))
        await asyncio.sleep(0.5)  # several sweeps over the stray file
        silent = SessionRecord("silent", [], "test")
        silent.last_heartbeat -= 60
        state.sessions["silent"] = silent
        await asyncio.sleep(0.5)
        alive = not task.done()
        task.cancel()
        return alive

    with caplog.at_level("WARNING", logger="rlcli.server"):
        assert asyncio.run(scenario())
    assert "silent" not in state.sessions  # sessions still expire
    assert len([r for r in caplog.records if "stray-run" in r.getMessage()]) == 1  # said once


def test_a_failing_sweep_after_a_save_does_not_fail_the_save(server, saved):
    run_id = saved["sampler"].removeprefix("tinker://").split("/")[0]
    kind_dir = checkpoints_root_of(server) / run_id / "sampler_weights"
    stray = kind_dir / ".link-stray"  # the sweep unlinks old .link-* entries: a folder fails
    stray.mkdir()
    os.utime(stray, (time.time() - 3600, time.time() - 3600))
    try:
        path = saved["trainer"].save_weights_for_sampler("after-fault").result().path
        service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-dummy")
        sampler = service.create_sampling_client(model_path=path).result()
        out = sampler.sample(
            types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=2)
        ).result()
        assert len(out.sequences[0].tokens) <= 2
    finally:
        stray.rmdir()
    assert_server_sound(server.base_url, saved["trainer"])


# ---- 9. a torn metrics.jsonl line freezes nothing ----------------------------------------


def test_a_torn_metrics_line_freezes_neither_progress_nor_step_counts(tmp_path):
    from rlcli.runs.progress import Follower
    from rlcli.runs.runner import metric_values

    def rows(steps) -> str:
        return "".join(
            json.dumps({"step": s, "train_mean_nll": 3.0 - s / 10, "num_tokens": 100}) + "\n"
            for s in steps
        )

    run = tmp_path / "sl-torn"
    run.mkdir()
    # Steps 0-2, then kill -9 mid-write of step 3; the resumed run writes steps 3-7, its
    # first row completing the torn line.
    (run / "metrics.jsonl").write_text(rows(range(3)) + '{"step": 3, "train_me' + rows(range(3, 8)))
    record = {"status": "finished", "kind": "sl", "model": "m", "total_steps": 8, "exit_code": 0}
    (run / "rlcli_run.json").write_text(json.dumps(record))

    shown = cli("runs", "show", str(run), "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["steps_done"] == 8
    assert shown.stderr.count("line 4 is torn") == 1  # said once

    lines: list[str] = []
    follower = Follower(run, 8, {"train_mean_nll": "loss"}, lines.append, tty=False)
    follower.seen = 0
    assert follower.poll() == 7  # every whole row after the torn one
    assert "step 8/8" in lines[-1]
    # The final summary reads the same rows (it used to raise, failing a finished run).
    assert metric_values(run, "train_mean_nll")["train_mean_nll"][-1] == pytest.approx(2.3)
    # A row still being written is left for the next poll, not skipped as torn.
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 8, "train_mean_nll": 2.2')
    assert follower.poll() == 0
    with (run / "metrics.jsonl").open("a") as f:
        f.write("}\n")
    assert follower.poll() == 1


# ---- 6. deleting a checkpoint gives readers their grace period; archives built once ------


def write_version(folder: Path, tmp: Path, value: bytes) -> Path:
    from rlcli.server.store import checkpoints

    sources = {}
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        sources[name] = tmp / f"{name}.{time.time_ns()}"
        sources[name].write_bytes(b'{"r": 2}' if name.endswith(".json") else value)
    return checkpoints.write_files(folder, sources, {"checkpoint_type": "sampler"})


def age(path: Path, seconds: float = 3600) -> None:
    os.utime(path, (time.time() - seconds, time.time() - seconds))


def test_superseded_and_deleted_versions_outlive_their_name_by_the_grace(tmp_path):
    from rlcli.server.store import checkpoints

    root = tmp_path / "checkpoints"
    folder = root / "run" / "sampler_weights" / "policy"
    old = write_version(folder, tmp_path, b"one")
    age(old)  # saved an hour ago; a reader resolved it just now
    new = write_version(folder, tmp_path, b"two")  # the save sweeps its folder afterwards
    assert (old / "adapter_model.safetensors").read_bytes() == b"one"  # still readable
    age(new)
    assert checkpoints.delete(folder)
    assert checkpoints.resolve(folder) is None  # nothing new finds it...
    checkpoints.sweep(root)  # ...but a sweep within the grace leaves both versions whole
    assert (new / "adapter_model.safetensors").read_bytes() == b"two" and old.exists()
    checkpoints.sweep(root, grace=0)  # after the grace they go
    assert not new.exists() and not old.exists()


def test_concurrent_downloads_share_one_tar_and_leave_nothing(tmp_path):
    import asyncio

    from rlcli.server.store.archives import Archives

    version = write_version(tmp_path / "run" / "sampler_weights" / "p", tmp_path, b"w" * 4096)
    archives = Archives(tmp_path / "tars")

    async def downloads(n: int):
        got = await asyncio.gather(*(archives.acquire(version, {}) for _ in range(n)))
        built = sorted(p.name for p in archives.folder.iterdir())
        for key, _ in got:
            archives.release(key)
        await asyncio.sleep(0)
        return got, built

    got, built = asyncio.run(downloads(8))
    assert len({path for _, path in got}) == 1 and len(built) == 1  # built once, shared
    assert not got[0][1].exists()  # removed when the last download ended
    assert list(archives.folder.iterdir()) == [] and archives.count() == 0
    (version / "adapter_config.json").unlink()  # a build that fails leaves no partial tar
    with pytest.raises(FileNotFoundError):
        asyncio.run(downloads(3))
    assert list(archives.folder.iterdir()) == [] and archives.count() == 0


def test_downloads_racing_a_delete_get_a_whole_tar_or_a_404(server, saved):
    from concurrent.futures import ThreadPoolExecutor

    trainer = saved["trainer"]
    path = trainer.save_weights_for_sampler("doomed").result().path
    run_id, kind, name = path.removeprefix("tinker://").split("/")
    base = f"{server.base_url}/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}"
    link = httpx.get(f"{base}/archive", headers=KEY).json()["url"]

    def download(_):
        response = httpx.get(link, timeout=60)
        if response.status_code == 200:
            with tarfile.open(fileobj=io.BytesIO(response.content)) as tar:
                assert "adapter_model.safetensors" in tar.getnames()
        return response.status_code

    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(download, range(8)))  # 8 at once: one tar, shared
        racing = [pool.submit(download, i) for i in range(8)]
        assert httpx.delete(base, headers=KEY).status_code == 204
        codes += [f.result() for f in racing]
    assert set(codes) <= {200, 404} and codes[:8] == [200] * 8, codes
    assert httpx.get(link).status_code == 404  # the name is gone
    tars = checkpoints_root_of(server) / ".staging" / "archives"
    assert not tars.exists() or list(tars.iterdir()) == []  # every shared tar removed
    assert_server_sound(server.base_url, trainer)


# ---- 10. a sampler snapshot in use is not evicted -----------------------------------------


def test_twenty_rl_clients_sample_from_their_own_steps(server, tiny_model):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    n = 20  # more clients than the shared LRU's 16 snapshots
    service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-dummy")
    prompt = types.ModelInput.from_ints([5, 6, 7, 8])
    params = types.SamplingParams(max_tokens=3, temperature=1.0, seed=1)
    barrier = threading.Barrier(n)

    def rl_client(i: int) -> int:
        trainer = service.create_lora_training_client(
            base_model=str(tiny_model), rank=4, seed=i
        ).result()
        samplers = []
        for _ in range(2):
            trainer.forward_backward([datum()], "cross_entropy").result()
            trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            samplers.append(trainer.save_weights_and_get_sampling_client().result())
            barrier.wait(timeout=300)  # every client has saved before anyone samples
            samplers[-1].sample(prompt, 1, params).result()
        samplers[0].sample(prompt, 1, params).result()  # an older step (async RL)
        assert_server_sound(server.base_url, trainer)
        return i

    with ThreadPoolExecutor(n) as pool:
        assert sorted(pool.map(rl_client, range(n))) == list(range(n))


def test_snapshots_stay_bounded_per_client():
    from rlcli.server.engine.samplers import SamplerCache

    live: dict = {}
    cache = SamplerCache(
        lambda name, config, state: live.update({name: state}), live.pop, 16, 8, per_client=2
    )
    for step in range(30):  # one client saving every step: older steps are not kept forever
        cache.put(f"ephemeral:a{step}", None, {"step": step}, None, owner="a")
    assert len(cache.snapshots) == 16 and "ephemeral:a29" in cache.snapshots
    for c in range(20):  # twenty clients: each one's newest stays, whatever the others do
        cache.put(f"ephemeral:c{c}", None, {}, None, owner=f"c{c}")
    assert all(f"ephemeral:c{c}" in cache.snapshots for c in range(20))
    assert {"ephemeral:a29", "ephemeral:a28"} <= set(cache.snapshots)
    # A checkpoint read from disk to be sampled now stays, though every other snapshot is in
    # use (before: evicted as it was stored, a KeyError for the request that loaded it).
    cache.put("/ckpt/sampler_weights/final", None, {}, "/ckpt/.v-final-1")
    assert "/ckpt/sampler_weights/final" in cache.snapshots
    cache.drop_owner("a")  # its client is gone: its snapshots are spare again
    assert "ephemeral:a29" not in cache.snapshots


# ---- 11. check-then-act races: re-checked at commit ---------------------------------------


def test_a_restore_rechecks_the_name_when_it_commits(server, saved):
    import threading

    good = state_files(server.base_url, saved["state"])
    body = tar_of(good)
    route = f"{server.base_url}/api/v1/rlcli/restore/race-run/weights/w"
    halfway = threading.Event()

    def slow_body():  # a long upload: the name is free when it starts
        yield body[: len(body) // 2]
        halfway.set()
        time.sleep(2)
        yield body[len(body) // 2 :]

    slow = {}
    thread = threading.Thread(
        target=lambda: slow.update(r=httpx.put(route, content=slow_body(), headers=KEY, timeout=60))
    )
    thread.start()
    assert halfway.wait(30)
    fast = httpx.put(route, content=body, headers=KEY, timeout=60)  # takes the name meanwhile
    thread.join(60)
    assert fast.status_code == 200, fast.text
    assert slow["r"].status_code == 409, slow["r"].text  # not a silent overwrite
    assert "exists" in slow["r"].json()["detail"]
    kind_dir = checkpoints_root_of(server) / "race-run" / "weights"
    names = [p.name for p in kind_dir.iterdir() if not p.name.startswith(".")]
    assert names == ["w"]
    assert_server_sound(server.base_url, saved["trainer"])


def test_run_json_is_written_only_once_the_adapter_exists(tiny_model, tmp_path):
    from rlcli.server.engine import ops
    from rlcli.server.engine.core import Engine
    from rlcli.server.errors import UserError
    from rlcli.server.store import checkpoints

    engine = Engine(str(tiny_model), device="cpu", dtype="float32", max_lora_rank=8)
    root = tmp_path / "checkpoints"

    def create(name: str, rank: int):
        run = {"training_run_id": name, "base_model": str(tiny_model), "lora": {"rank": rank}}
        op = ops.CreateAdapter(name, rank, 0, run_record=run, checkpoints_root=str(root))
        return op.run(engine)

    with pytest.raises(UserError):
        create("too-big", 9)  # the engine refuses the adapter: no run is left listed
    assert checkpoints.read_run(root, "too-big") is None and checkpoints.list_runs(root) == []
    create("fine", 4)
    assert checkpoints.read_run(root, "fine")["lora"] == {"rank": 4}


def test_publish_and_ttl_racing_saves_of_the_same_name(server, saved):
    import threading

    trainer = saved["trainer"]
    path = trainer.save_weights_for_sampler("contested").result().path
    run_id, kind, name = path.removeprefix("tinker://").split("/")
    base = f"{server.base_url}/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}"
    codes = []
    done = threading.Event()

    def edits():
        while not done.is_set():
            codes.append(httpx.post(f"{base}/publish", headers=KEY).status_code)
            codes.append(
                httpx.put(f"{base}/ttl", json={"ttl_seconds": 3600}, headers=KEY).status_code
            )

    thread = threading.Thread(target=edits)
    thread.start()
    try:
        for _ in range(5):
            trainer.save_weights_for_sampler("contested").result()
    finally:
        done.set()
        thread.join(30)
    assert codes and set(codes) == {204}, codes
    assert httpx.post(f"{base}/publish", headers=KEY).status_code == 204
    listed = httpx.get(f"{server.base_url}/api/v1/training_runs/{run_id}/checkpoints", headers=KEY)
    (meta,) = [c for c in listed.json()["checkpoints"] if c["checkpoint_id"] == f"{kind}/{name}"]
    assert meta["public"] is True
    assert_server_sound(server.base_url, trainer)
