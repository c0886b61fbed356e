"""`rlcli train rl` on a real server with the tiny model: every loss runs through the
cookbook's RL recipe on GSM8K-format rows of ours (tests/data/gsm8k), and arithmetic and a
user's JSONL train too; the loss guard and bad datasets fail fast; and the server's fused
losses make a policy learn inside the cookbook's own RL loop."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import numpy as np
import pytest
from tinker_cookbook.rl import train as rl_train

from conftest import GSM8K, LowTokensBuilder, cli, run_rlcli

DEAD_URL = "http://127.0.0.1:9"


run = run_rlcli  # a process of its own: the smoke test, an env read at import
quick = cli  # in this process (conftest.cli): refusals, plans, `runs`, runs that end by themselves


def small(server, tiny_model, log_path, *extra) -> tuple[str, ...]:
    return (
        "train", "rl", "--model", str(tiny_model), "--base-url", server.base_url,
        "--gsm8k-dir", str(GSM8K), "--batch-size", "2", "--group-size", "2",
        "--max-tokens", "12", "--log-path", str(log_path), "--json", *extra,
    )  # fmt: skip


def test_two_steps_with_a_named_loss_write_metrics_and_checkpoints(tmp_path, server, tiny_model):
    """One loss end to end through `train rl`: every loss takes the same path to the cookbook
    (``loss_fn``/``loss_fn_config``), so the others are tested where their math is, through the
    SDK on the session server: test_training.py (each lowers itself; fused == the SDK's
    two-pass custom loss) and test_losses.py; importance_sampling, the default, runs end to end
    in the other tests here. gspo is the one with a path of its own (the SkyRL note)."""
    loss = "gspo"
    result = run(*small(server, tiny_model, tmp_path / "run", "--loss", loss, "--max-steps", "2"))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["loss"] == loss and summary["state_path"].startswith("tinker://")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all("env/all/reward/total" in r for r in rows)
    assert "step 2/2" in result.stderr
    assert "SkyRL" not in result.stderr  # the gspo note is for SkyRL servers, not ours


def test_a_finished_run_resumes_and_continues(tmp_path, server, tiny_model):
    log = tmp_path / "run"
    first = quick(*small(server, tiny_model, log, "--max-steps", "2", "--save-every", "1"))
    assert first.returncode == 0, first.stderr[-3000:]
    second = quick(*small(server, tiny_model, log, "--max-steps", "3", "--save-every", "1"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming in" in second.stderr
    steps = [json.loads(line)["step"] for line in (log / "metrics.jsonl").open()]
    assert steps == [0, 1, 2]  # step 2 only: the first two were not redone


def test_guard_refuses_gspo_on_jax_before_anything_runs(tmp_path, tiny_model):
    # No server at all: the backend hint alone decides, and --dry-run needs none either.
    for extra in ((), ("--dry-run",)):
        result = quick(
            "train", "rl", "--model", str(tiny_model), "--base-url", DEAD_URL,
            "--loss", "gspo", "--backend", "jax", "--gsm8k-dir", str(GSM8K),
            "--log-path", str(tmp_path / "run"), *extra,
        )  # fmt: skip
        assert result.returncode == 1
        assert "the jax backend cannot compute loss 'gspo'; it serves: cross_entropy, " in (
            result.stderr
        )
        assert not (tmp_path / "run").exists()


def test_guard_refuses_a_loss_the_live_server_lacks(tmp_path, server, tiny_model):
    """Our server serves every --loss choice (dppo included); a name it lists nowhere is
    refused by the guard in one line, naming what it serves, before any rollout."""
    from rlcli.errors import RlcliError
    from rlcli.recipes import loss_guard
    from rlcli.recipes.options import POLICY_LOSSES

    for loss in POLICY_LOSSES:
        assert loss_guard.check_server(server.base_url, loss, None, str(tiny_model)) == "torch"
    with pytest.raises(RlcliError, match=r"the torch backend cannot compute loss 'stable_re"):
        loss_guard.check_server(server.base_url, "stable_reinforce", None, str(tiny_model))
    result = quick(*small(server, tiny_model, tmp_path / "run", "--loss", "ppo_critic"))
    assert result.returncode != 0
    assert "ppo_critic" in result.stderr and "dppo" in result.stderr  # the choices, listed
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_dry_run_needs_no_server_and_bad_flags_are_clear(tmp_path, tiny_model):
    base = ("train", "rl", "--model", str(tiny_model), "--base-url", DEAD_URL, "--dry-run")
    result = quick(*base, "--gsm8k-dir", str(GSM8K), "--batch-size", "16", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["train_problems"] == 36 and plan["steps"] == 3  # 16 + 16 + 4
    assert plan["rollouts_per_step"] == 128
    assert plan["data_source"] == str(GSM8K.resolve())
    result = quick(*base, "--loss-config", "{clip: 1}")
    assert result.returncode == 1 and "--loss-config: not valid JSON" in result.stderr
    result = quick(*base, "--loss", "grpo")
    assert result.returncode == 1 and "--loss grpo: choose from importance_sampling" in (
        result.stderr
    )
    result = quick(*base, "--gsm8k-dir", str(tmp_path))
    assert result.returncode == 1 and "no train.jsonl or test.jsonl there" in result.stderr


def test_offline_without_a_gsm8k_folder_names_the_flag(tmp_path, server, tiny_model):
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "RLCLI_GSM8K_DIR": ""}
    result = run(
        "train", "rl", "--model", str(tiny_model), "--base-url", server.base_url,
        "--log-path", str(tmp_path / "run"), env=offline,
    )  # fmt: skip
    assert result.returncode == 1
    assert "pass --gsm8k-dir FOLDER (or set $RLCLI_GSM8K_DIR)" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.fixture
def gsm8k20(tmp_path) -> Path:
    """A 20-problem GSM8K folder (5 test problems)."""
    folder = tmp_path / "gsm8k20"
    folder.mkdir()
    for split, rows in (("train", 20), ("test", 5)):
        lines = (GSM8K / f"{split}.jsonl").read_text().splitlines()[:rows]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_dry_run_counts_the_rows_that_are_there(tiny_model, gsm8k20):
    result = quick(
        "train", "rl", "--model", str(tiny_model), "--base-url", DEAD_URL, "--dry-run", "--json",
        "--gsm8k-dir", str(gsm8k20), "--batch-size", "8", "--eval-every", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["train_problems"] == 20 and plan["steps"] == 3  # 8 + 8 + 4
    assert plan["test_problems"] == 5 and plan["rollouts_per_step"] == 64
    assert plan["options"]["gsm8k_dir"] == str(gsm8k20.resolve())


def test_renderer_and_loss_config_json_are_checked_in_a_dry_run(tiny_model):
    base = ("train", "rl", "--model", str(tiny_model), "--gsm8k-dir", str(GSM8K), "--dry-run")
    result = quick(*base, "--renderer", "nope")
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1
    assert "--renderer nope: not a renderer the cookbook knows" in result.stderr
    result = quick(*base, "--loss-config", '{"clip_low_threshold": "low"}')
    assert result.returncode == 1 and "expected a JSON object of numbers" in result.stderr


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ('{"beta": 1}', "'beta'"),  # a key ppo does not take (the --help example of old)
        ('{"clip_low_threshold": 5}', "refused by the server (422)"),  # above clip_high 1.2
    ],
)
def test_loss_config_is_refused_before_any_rollout(tmp_path, server, tiny_model, config, expected):
    run_dir = tmp_path / "run"
    result = quick(*small(server, tiny_model, run_dir, "--loss", "ppo", "--loss-config", config))
    assert result.returncode == 1
    assert expected in result.stderr and "Traceback" not in result.stderr
    assert not run_dir.exists()  # no run folder, no rollout


def rollout_fingerprint(run_dir: Path) -> tuple[list[float], list[int]]:
    """(the sampled tokens' entropy per step, the prompts' lengths in data order)."""
    entropy = [json.loads(line)["optim/entropy"] for line in (run_dir / "metrics.jsonl").open()]
    summaries = run_dir / "iteration_000000" / "train_rollout_summaries.jsonl"
    lengths = [json.loads(line)["steps"][0]["ob_len"] for line in summaries.open()]
    return entropy, lengths


def test_seed_makes_data_order_and_sampling_reproducible(tmp_path, server, tiny_model):
    seen = {}
    for name, seed in (("a", "3"), ("b", "3"), ("c", "4")):
        result = quick(
            *small(server, tiny_model, tmp_path / name, "--max-steps", "1", "--seed", seed)
        )
        assert result.returncode == 0, result.stderr[-3000:]
        seen[name] = rollout_fingerprint(tmp_path / name)
    assert seen["a"] == seen["b"]
    assert seen["a"][0] != seen["c"][0] and seen["a"][1] != seen["c"][1]


def test_sft_checkpoint_kl_penalty_and_temperature_reach_the_recipe(tmp_path, server, tiny_model):
    examples = Path(__import__("tinker_cookbook").__file__).parent / "example_data"
    sft = quick(
        "train", "sl", "--dataset", str(examples / "conversations.jsonl"),
        "--model", str(tiny_model), "--base-url", server.base_url, "--batch-size", "8",
        "--max-steps", "1", "--log-path", str(tmp_path / "sft"), "--json",
    )  # fmt: skip
    assert sft.returncode == 0, sft.stderr[-3000:]
    state, sampler = (json.loads(sft.stdout)[k] for k in ("state_path", "sampler_path"))
    run_dir = tmp_path / "rl"
    base = small(server, tiny_model, run_dir, "--max-steps", "1", "--kl-penalty-coef", "0.1")
    result = quick(*base, "--init-checkpoint", sampler)  # a sampler checkpoint holds no state
    assert result.returncode == 1 and "a sampler checkpoint; pass a weights/..." in result.stderr
    result = quick(*base, "--kl-reference", state)
    assert result.returncode == 1 and "a training checkpoint; pass a sampler_weights/" in (
        result.stderr
    )
    assert not run_dir.exists()
    result = quick(
        *base, "--init-checkpoint", state, "--kl-reference", sampler, "--temperature", "0.7"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    cookbook = json.loads((run_dir / "config.json").read_text())  # the recipe's own record
    assert cookbook["load_checkpoint_path"] == state
    assert cookbook["kl_penalty_coef"] == 0.1 and cookbook["temperature"] == 0.7
    assert cookbook["kl_reference_config"] == {
        "base_model": str(tiny_model),
        "load_checkpoint_path": sampler,
    }
    assert f"Loaded weights from {state}" in (run_dir / "console.log").read_text()
    assert "kl_policy_base" in json.loads((run_dir / "metrics.jsonl").read_text())
    result = quick(*small(server, tiny_model, tmp_path / "x", "--init-checkpoint", "weights/final"))
    assert result.returncode == 1 and "expected a tinker:// path" in result.stderr


def test_checkpoint_and_max_tokens_are_checked_before_the_run_folder(tmp_path, server, tiny_model):
    run_dir = tmp_path / "run"
    missing = "tinker://no-such-run/weights/final"
    result = quick(*small(server, tiny_model, run_dir, "--init-checkpoint", missing))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"--init-checkpoint {missing}: the server at {server.base_url} has no training run" in (
        result.stderr
    )
    result = quick(*small(server, tiny_model, run_dir, "--max-tokens", "100000"))
    assert result.returncode == 1 and "--max-tokens 100000: the server at" in result.stderr
    assert not run_dir.exists()


# ---- other environments of the registry (rlcli.envs) ----------------------------------------


def tiny_rl(server, tiny_model, log_path, dataset, *extra) -> tuple[str, ...]:
    return (
        "train", "rl", "--model", str(tiny_model), "--base-url", server.base_url,
        "--dataset", dataset, "--batch-size", "2", "--group-size", "2", "--max-tokens", "6",
        "--log-path", str(log_path), "--json", *extra,
    )  # fmt: skip


def test_arithmetic_and_a_users_jsonl_train_end_to_end(tmp_path, server, tiny_model):
    result = quick(
        *tiny_rl(server, tiny_model, tmp_path / "arith", "arithmetic", "--max-steps", "2")
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["state_path"].startswith("tinker://") and summary["first_reward"] is not None
    rollouts = tmp_path / "arith" / "iteration_000000" / "train_rollout_summaries.jsonl"
    assert "arithmetic" in json.loads(rollouts.read_text().splitlines()[0])["tags"]
    # every step reports the sampler/trainer agreement: metrics.jsonl, progress, show, plot
    rows = [json.loads(line) for line in (tmp_path / "arith" / "metrics.jsonl").open()]
    assert all(0 <= r["rlcli/logp_diff_mean:mean"] < 1e-4 for r in rows), rows  # float32
    assert all(r["rlcli/ratio_outside_frac:mean"] == 0 for r in rows)
    assert "dlogp" in result.stderr
    shown = quick("runs", "show", str(tmp_path / "arith"))
    assert "rlcli/logp_diff_max:max" in shown.stdout, shown.stdout
    plotted = quick("runs", "plot", str(tmp_path / "arith"), "--json")
    labels = [p["label"] for p in json.loads(plotted.stdout)["panels"]]
    assert "sampler/trainer |dlogp|" in labels, plotted.stdout
    data = tmp_path / "qa.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"{i} + 1?", "answer": i + 1}) + "\n" for i in range(4))
    )
    result = quick(*tiny_rl(server, tiny_model, tmp_path / "own", str(data), "--max-steps", "1"))
    assert result.returncode == 0, result.stderr[-3000:]
    saved = (tmp_path / "own" / "config.yaml").read_text()
    assert f"dataset: {data.resolve()}" in saved  # the run's --config trains on the same file
    assert [json.loads(line)["step"] for line in (tmp_path / "own" / "metrics.jsonl").open()] == [0]


def test_bad_datasets_are_one_line_before_any_server_work(tmp_path, tiny_model):
    base = ("train", "rl", "--model", str(tiny_model), "--base-url", DEAD_URL)
    result = quick(*base, "--dataset", "gsm9k", "--log-path", str(tmp_path / "run"))
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1
    assert "--dataset gsm9k: unknown environment; use gsm8k, arithmetic, niah" in result.stderr
    result = quick(*base, "--dataset", str(tmp_path / "none.jsonl"))
    assert result.returncode == 1 and "none.jsonl: no such file" in result.stderr
    data = tmp_path / "qa.jsonl"
    data.write_text('{"question": "1 + 1?", "answer": 2}\n{"question": "2 + 2?"}\n')
    result = quick(*base, "--dataset", str(data), "--log-path", str(tmp_path / "run"))
    assert result.returncode == 1 and "no Tinker server" not in result.stderr  # never got there
    assert "1 of 2 lines are not usable" in result.stderr and "line 2: " in result.stderr
    data.write_text('{"question": "1 + 1?", "answer": 2}\n')
    result = quick(*base, "--dataset", str(data), "--eval-every", "1", "--dry-run")
    assert result.returncode == 1 and "is one split, no test problems" in result.stderr
    result = quick(*base, "--dataset", "niah:words=50", "--batch-size", "4", "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["steps"] == 100 and plan["train_problems"] == 400  # one pass: 100 batches
    assert not (tmp_path / "run").exists()


# ---- learning -------------------------------------------------------------------------------
# LowTokensBuilder (conftest): reward is the share of sampled tokens from the lower half of the
# vocabulary. Rising reward means the server's fused loss pushed the policy the right way,
# through the cookbook's unmodified RL loop.


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["importance_sampling", "gspo"])
def test_policy_learns_through_the_cookbook_rl_loop(tmp_path, server, tiny_model, loss):
    config = rl_train.Config(
        learning_rate=2e-2,
        dataset_builder=LowTokensBuilder(batches=16, groups=4, size=8, vocab=1024),
        model_name=str(tiny_model),
        recipe_name="rlcli_test_learning",
        max_tokens=8,
        log_path=str(tmp_path / loss),
        loss_fn=loss,
        lora_rank=8,
        save_every=0,
        eval_every=0,
        base_url=server.base_url,
        num_groups_to_log=0,
    )
    os.environ.setdefault("TINKER_API_KEY", "tml-dummy")
    asyncio.run(rl_train.main(config))
    rewards = [
        json.loads(line)["env/all/reward/total"]
        for line in (tmp_path / loss / "metrics.jsonl").open()
    ]
    assert len(rewards) == 16
    first, last = np.mean(rewards[:4]), np.mean(rewards[-4:])
    assert last > first + 0.15, rewards


def test_probe_detects_a_loss_the_server_refuses(server, tiny_model):
    """The path used against SkyRL servers (whose capabilities list no losses)."""
    from rlcli.errors import RlcliError
    from rlcli.recipes import loss_guard

    loss_guard._probe(server.base_url, "ppo", "torch", str(tiny_model))  # served: no error
    with pytest.raises(
        RlcliError, match=r"refused loss 'stable_reinforce' \(422\); losses it serves: cross"
    ):
        loss_guard._probe(server.base_url, "stable_reinforce", "jax", str(tiny_model))


# ---- a reward function of the user's (--reward FILE.py:FUNCTION) ----------------------------

REWARD_PY = '''
def score(question, answer, limit, **row):
    """Shorter answers score higher: the tiny policy learns to stop early."""
    if row.get("explode"):
        raise ValueError("no reward for " + question)
    return max(0.0, 1.0 - len(answer) / limit)
'''


@pytest.mark.slow
def test_a_reward_function_of_the_users_is_learned(tmp_path, server, tiny_model):
    (tmp_path / "rewards.py").write_text(REWARD_PY)
    data = tmp_path / "rows.jsonl"
    rows = [{"question": f"Say something about {i}.", "limit": 40} for i in range(64)]
    rows[3]["explode"] = True
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    result = quick(
        "train", "rl", "--model", str(tiny_model), "--base-url", server.base_url,
        "--dataset", str(data), "--reward", str(tmp_path / "rewards.py") + ":score",
        "--batch-size", "4", "--group-size", "16", "--max-tokens", "8", "--lr", "2e-2",
        "--lora-rank", "8", "--save-every", "0", "--log-path", str(run_dir), "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rewards = [
        json.loads(line)["env/all/reward/total"] for line in (run_dir / "metrics.jsonl").open()
    ]
    assert len(rewards) == 16
    assert np.mean(rewards[-4:]) > np.mean(rewards[:4]) + 0.15, rewards
    errors = [json.loads(line) for line in (run_dir / "reward_errors.jsonl").open()]
    assert errors and all(
        e == {"row": "row-4", "error": "ValueError: no reward for Say something about 3."}
        for e in errors
    )
    summary = json.loads(result.stdout)
    assert summary["reward_errors"] == len(errors)


def test_reward_calls_time_out_fail_by_row_and_bad_specs_are_one_line(tmp_path, tiny_model):
    from rlcli.envs.reward_fn import Scorer, row_kwargs
    from rlcli.errors import RlcliError

    (tmp_path / "r.py").write_text(
        "import time\n"
        "def score(question, answer, **row):\n"
        "    print('chatty')  # must not reach the replies\n"
        "    time.sleep(row.get('sleep', 0))\n"
        "    return 'high' if row.get('text') else len(answer) + row['reference']\n"
    )
    errors = tmp_path / "errors.jsonl"
    scorer = Scorer(str(tmp_path / "r.py"), "score", 1.0, str(errors))
    assert row_kwargs({"question": "q", "answer": 2, "x": 1}) == {"reference": 2, "x": 1}
    assert scorer("row-1", "q", "abc", {"reference": 2}) == (5.0, None)
    assert scorer("row-2", "q", "a", {"sleep": 30}) == (
        0.0, "took longer than 1s (--reward-timeout)"
    )  # fmt: skip
    assert scorer("row-3", "q", "a", {"text": 1}) == (0.0, "returned str 'high', not a number")
    assert scorer("row-4", "q", "a", {})[1] == "KeyError: 'reference'"
    assert scorer("row-5", "q", "ab", {"reference": 1}) == (3.0, None)  # a fresh worker
    assert [json.loads(line)["row"] for line in errors.open()] == ["row-2", "row-3", "row-4"]
    scorer.close()
    (tmp_path / "broken.py").write_text("import no_such_module\ndef score(q, a): return 1\n")
    with pytest.raises(RlcliError, match="cannot load it .ModuleNotFoundError: No module named"):
        Scorer(str(tmp_path / "broken.py"), "score", 1.0, None)("row-1", "q", "a", {})

    data = tmp_path / "rows.jsonl"
    data.write_text('{"question": "1 + 1?"}\n')
    base = ("train", "rl", "--model", str(tiny_model), "--base-url", DEAD_URL, "--dry-run")
    refusals = {
        "r.py": "--reward r.py: expected FILE.py:FUNCTION, e.g. rewards.py:score",
        "nope.py:score": "--reward nope.py:score: no such file nope.py",
        "r.py:grade": "r.py defines no 'grade' (top-level names: score, time)",
    }
    for spec, expected in refusals.items():
        result = run(*base, "--dataset", str(data), "--reward", spec, cwd=tmp_path)
        assert result.returncode == 1 and expected in result.stderr, result.stderr
    (tmp_path / "bad.py").write_text("def score(:\n")
    result = run(*base, "--dataset", str(data), "--reward", "bad.py:score", cwd=tmp_path)
    assert "--reward bad.py:score: bad.py line 1: " in result.stderr
    result = run(*base, "--dataset", "arithmetic", "--reward", "r.py:score", cwd=tmp_path)
    assert 'needs a JSONL --dataset of {"question", ...} rows; arithmetic grades' in (result.stderr)
    result = run(*base, "--dataset", str(data), "--reward", "r.py:score", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["reward"] == f"{tmp_path / 'r.py'}:score" == plan["options"]["reward"]
    assert plan["train_problems"] == 1  # a row needs no "answer" with a reward function
