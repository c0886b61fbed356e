"""The option machinery (``rlcli/flags.py``) and ``rlcli train``'s options
(``recipes/options.py``): one declaration per option gives the flags, ``--help`` defaults, the
``--config`` file loader and its one-line errors, the checks and the saved ``config.yaml``; plus
the seams on the pinned cookbook it relies on. Fast: no server."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from rlcli import flags
from rlcli.errors import RlcliError
from rlcli.flags import option, retune
from rlcli.recipes import options
from rlcli.recipes.options import PolicyOptions, TrainOptions
from rlcli.recipes.rl import RLOptions
from rlcli.recipes.sl import SLOptions


@dataclasses.dataclass(kw_only=True)
class DemoOptions(TrainOptions):
    """A command as issues 10/11 would declare one: a few fields on the shared base."""

    prompts: str = option(help="Prompts JSONL.")
    batch_size: int = option(32, "Prompts per step.", min=1)
    lr: float = retune(TrainOptions, "lr", 1e-5)


def demo_app() -> tuple[typer.Typer, list]:
    app, got = typer.Typer(), []
    flags.typer_command(app, "demo", DemoOptions, got.append, help="A demo command.")
    app.command("other")(lambda: None)  # two commands, so "demo" stays a subcommand
    return app, got


def invoke(*args: str):
    app, got = demo_app()
    result = CliRunner().invoke(app, ["demo", *args])
    return result, (got[0] if got else None)


def test_flags_come_from_the_dataclass_with_defaults_aliases_and_overrides():
    result, opts = invoke("--prompts", "p.jsonl", "--model", "m", "--learning-rate", "3e-4")
    assert result.exit_code == 0, result.output
    assert opts == DemoOptions(prompts="p.jsonl", model="m", lr=3e-4)
    assert opts.batch_size == 32 and opts.lora_rank == 32 and opts.save_every == 20
    _, opts = invoke("--prompts", "p", "--model", "m")
    assert opts.lr == 1e-5  # the retuned default, help and checks shared with TrainOptions
    help_text = CliRunner().invoke(demo_app()[0], ["demo", "--help"]).output
    for shown in ("--batch-size", "[default: 32]", "--learning-rate", "[default: 1e-05]"):
        assert shown in help_text
    assert "--wandb-project" in help_text and "--config" in help_text


def test_every_shared_flag_is_declared_once_and_reused():
    shared = {f.name for f in dataclasses.fields(TrainOptions)}
    for cls in (SLOptions, RLOptions, DemoOptions):
        assert shared <= {f.name for f in dataclasses.fields(cls)}
    assert {f.name for f in dataclasses.fields(PolicyOptions)} <= {
        f.name for f in dataclasses.fields(RLOptions)
    }
    assert SLOptions.__dataclass_fields__["lr"].default == 1e-4
    assert RLOptions.__dataclass_fields__["lr"].default == 4e-5
    # README's defaults
    rl = RLOptions(model="m")
    assert (rl.batch_size, rl.group_size, rl.max_tokens, rl.eval_size) == (64, 8, 256, 200)
    assert (rl.loss, rl.temperature, rl.seed, rl.kl_penalty_coef) == (
        "importance_sampling",
        1.0,
        0,
        0.0,
    )
    sl = SLOptions(model="m", dataset="d")
    assert (sl.batch_size, sl.max_length, sl.epochs, sl.test_size) == (8, 2048, 1, 0.0)


def test_config_file_yaml_and_toml_flags_win(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("model: m\nprompts: p.jsonl\nbatch-size: 4\nlr: 1e-3\nlora_rank: 8\n")
    result, opts = invoke("--config", str(yaml_file), "--lora-rank", "16")
    assert result.exit_code == 0, result.output
    assert (opts.model, opts.batch_size, opts.lr, opts.lora_rank) == ("m", 4, 1e-3, 16)
    toml_file = tmp_path / "run.toml"
    toml_file.write_text('model = "m"\nprompts = "p"\nlearning_rate = 2e-3\n')
    _, opts = invoke("--config", str(toml_file))
    assert opts.lr == 2e-3 and opts.batch_size == 32


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("model: m\nprompts: p\nbatch_sise: 4\n", "unknown key 'batch_sise' (did you mean"),
        ("model: m\nprompts: p\nbatch_size: four\n", "batch_size: expected an integer, got"),
        ("model: m\nprompts: p\nlr: fast\n", "lr: expected a number, got 'fast'"),
        ("model: m\nprompts: p\ndry_run: true\n", "'dry_run' is a command-line switch"),
        ("model: m\nprompts: p\nbatch_size: 0\n", "--batch-size 0: must be at least 1"),
        ("- a\n- b\n", "expected a mapping of option names to values"),
        ("model: [unclosed\n", "not valid YAML"),
        ("prompts: p\n", "missing --model (a flag, or `model:` in a --config file)"),
    ],
)
def test_config_file_errors_are_one_line_naming_the_key(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result, opts = invoke("--config", str(path))
    assert opts is None and isinstance(result.exception, RlcliError)
    assert message in str(result.exception) and "\n" not in str(result.exception)


def test_unknown_key_names_the_nearest_valid_one(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: m\nprompts: p\nlearning_rat: 0.1\n")
    result, _ = invoke("--config", str(path))
    assert "unknown key 'learning_rat' (did you mean 'learning_rate'?)" in str(result.exception)


def test_saved_config_round_trips_through_the_loader(tmp_path):
    opts = RLOptions(
        model="m", loss="ppo", loss_config='{"clip_low_threshold": 0.9}', seed=7, lr=1e-3
    )
    path = options.write_config(tmp_path, opts, "rlcli train rl")
    text = path.read_text()
    assert path.name == "config.yaml" and "clip_low_threshold: 0.9" in text  # a mapping
    assert "dry_run" not in text and "log_path" not in text
    again = flags.load(RLOptions, {"config": str(path)}, set())
    assert flags.saved(again) == {**flags.saved(opts), "log_path": None}


def test_resume_command_points_at_the_saved_config(tmp_path):
    line = options.resume_command("rlcli train rl", str(tmp_path))
    assert line == f"rlcli train rl --config {tmp_path}/config.yaml --log-path {tmp_path}"


def test_help_does_not_import_torch():
    code = (
        "import sys; from rlcli.cli import main; sys.argv=['rlcli','train','sl','--help'];\n"
        "try: main.main()\nexcept SystemExit: pass\n"
        "assert 'torch' not in sys.modules and 'tinker' not in sys.modules, 'heavy import'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "--max-length" in result.stdout and "[default: 2048]" in result.stdout


# ---- seams on the pinned cookbook -----------------------------------------------------------


def test_renderer_names_are_read_from_the_cookbook():
    from rlcli.recipes.preflight import check_renderer, renderer_names

    names = renderer_names()
    assert {"role_colon", "llama3", "qwen3", "qwen3_instruct"} <= set(names) and len(names) > 20
    check_renderer("qwen3_instruct")
    with pytest.raises(RlcliError, match=r"qwen3_instrct: .* did you mean qwen3_instruct"):
        check_renderer("qwen3_instrct")


def test_rollouts_sample_through_sample():
    """rl.seed_sampling seeds SamplingClient.sample: the cookbook's completer must still sample
    through the SDK's sample_async, and that through sample (or call sample itself)."""
    import inspect

    import tinker
    from tinker_cookbook import completers

    completer = inspect.getsource(completers.TinkerTokenCompleter)
    assert "sampling_client.sample_async(" in completer or "sampling_client.sample(" in completer
    assert "self.sample(" in inspect.getsource(tinker.SamplingClient.sample_async)


def test_seeded_sampling_fills_distinct_reproducible_seeds(monkeypatch):
    import asyncio

    import tinker

    from rlcli.recipes import rl

    sent = []

    def fake(self, prompt, num_samples, sampling_params, *args, **kwargs):
        sent.append(sampling_params.seed)
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    monkeypatch.setattr(tinker.SamplingClient, "sample", fake)

    def draw(seed):
        sent.clear()
        rl.seed_sampling(seed)
        prompt = tinker.ModelInput.from_ints([1, 2, 3])
        params = tinker.SamplingParams(max_tokens=4)
        client = object.__new__(tinker.SamplingClient)  # no server: `sample` is the fake
        for _ in range(3):  # the cookbook's call: the deprecated sample_async, through sample
            with pytest.warns(FutureWarning, match="sample_async"):
                asyncio.run(client.sample_async(prompt, 1, params))
        tinker.SamplingClient.sample = fake
        return list(sent)

    first = draw(5)
    assert len(set(first)) == 3  # a group's rollouts get different seeds
    assert draw(5) == first and draw(6) != first


def test_model_argument_checks(tmp_path):
    from rlcli.recipes.preflight import check_model_arg

    check_model_arg("Qwen/Qwen3-4B-Instruct-2507")  # a hub id: the server decides
    with pytest.raises(RlcliError, match=r"--model \./nope: no such folder"):
        check_model_arg("./nope")
    with pytest.raises(RlcliError, match="no config.json in that folder"):
        check_model_arg(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    check_model_arg(str(tmp_path))


def test_help_texts_have_no_invalid_examples():
    """The --loss-config example must be valid for the loss it names (ppo takes clip_*)."""
    help_text = RLOptions.__dataclass_fields__["loss_config"].metadata["help"]
    assert '"clip_low_threshold"' in help_text and "ppo" in help_text
    assert "beta" not in help_text


def test_cli_check_messages():
    with pytest.raises(RlcliError, match=r"--loss grpo: choose from importance_sampling"):
        flags.check(RLOptions(model="m", loss="grpo"))
    with pytest.raises(RlcliError, match=r"--test-size 1.0: must be in \[0, 1\)"):
        flags.check(SLOptions(model="m", dataset="d", test_size=1.0))
    with pytest.raises(RlcliError, match=r"--lr 0.0: must be greater than 0"):
        flags.check(SLOptions(model="m", dataset="d", lr=0.0))
    flags.check(RLOptions(model="m"))  # the defaults pass their own checks


def test_config_path_errors(tmp_path):
    result, _ = invoke("--config", str(tmp_path / "missing.yaml"))
    assert "cannot read it" in str(result.exception)
    bad = Path(tmp_path / "bad.toml")
    bad.write_text("model = \n")
    result, _ = invoke("--config", str(bad))
    assert "not valid TOML" in str(result.exception)


def test_gspo_note_only_where_it_applies():
    from rlcli.recipes import rl

    gspo, notes = RLOptions(model="m", loss="gspo"), rl.RL().notes
    assert notes(gspo, "torch") == []  # our server: results in input order
    assert notes(gspo, "unknown") == notes(gspo, "megatron") == [rl.GSPO_NOTE]
    assert notes(RLOptions(model="m", loss="gspo", backend="fsdp"), None) == [rl.GSPO_NOTE]
    assert notes(RLOptions(model="m"), "unknown") == []  # not gspo
    assert len(rl.GSPO_NOTE.splitlines()) == 1 and "SkyRL#2043" in rl.GSPO_NOTE


def test_log_path_must_be_a_folder_or_creatable(tmp_path):
    from rlcli.recipes.preflight import check_run_dir

    check_run_dir(tmp_path / "new" / "run")  # created later, under a writable folder
    file = tmp_path / "file"
    file.write_text("")
    with pytest.raises(RlcliError, match="exists and is not a folder"):
        check_run_dir(file)
    with pytest.raises(RlcliError, match="cannot create it"):
        check_run_dir(file / "run")


def test_server_checks_skip_what_a_server_does_not_publish():
    """SkyRL's capabilities list models only: no rank, sample or checkpoint check is made."""
    from rlcli.recipes.preflight import Server

    skyrl = object.__new__(Server)
    skyrl.base_url, skyrl.caps = "http://x", {"supported_models": [{"model_name": "Qwen/Q"}]}
    skyrl.check_model("Qwen/Q")
    skyrl.check_lora_rank(4096)
    skyrl.check_max_tokens(10**6)
    skyrl.check_checkpoint("tinker://run/weights/final", "--init-checkpoint", "training")
    with pytest.raises(RlcliError, match=r"--model other/model: the server at http://x serves"):
        skyrl.check_model("other/model")
