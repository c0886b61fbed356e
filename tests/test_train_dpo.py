"""`rlcli train dpo` on a real server with the tiny model, through the cookbook's DPO recipe:
the chosen-over-rejected margin rises; TRL's three pair shapes; dry run, resume, bad lines."""

from __future__ import annotations

import json

from conftest import cli

DEAD_URL = "http://127.0.0.1:9"


def pairs_file(path, n: int = 16):
    """Chosen answers in one voice, rejected in another, in TRL's three shapes."""
    rows = []
    for i in range(n):
        prompt, chosen, rejected = f"Tell me about {i}.", "Arr, a fine number!", f"It is {i}."
        if i % 3 == 0:
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        elif i % 3 == 1:
            user = [{"role": "user", "content": prompt}]
            rows.append({
                "prompt": user,
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}],
            })  # fmt: skip
        else:
            user = {"role": "user", "content": prompt}
            rows.append({
                "chosen": [user, {"role": "assistant", "content": chosen}],
                "rejected": [user, {"role": "assistant", "content": rejected}],
            })  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_margin_rises_and_a_finished_run_resumes(tmp_path, server, tiny_model):
    data = pairs_file(tmp_path / "pairs.jsonl")
    run_dir = tmp_path / "run"
    args = (
        "train", "dpo", "--dataset", str(data), "--model", str(tiny_model),
        "--base-url", server.base_url, "--log-path", str(run_dir), "--batch-size", "4",
        "--lr", "5e-3", "--lora-rank", "8", "--lr-schedule", "constant", "--json",
    )  # fmt: skip
    result = cli(*args, "--epochs", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    margins = [r["margin"] for r in rows]
    assert len(margins) == 12 and abs(margins[0]) < 1e-3  # the policy starts at the reference
    assert min(margins[-3:]) > 0.5, margins
    summary = json.loads(result.stdout)
    assert summary["final_margin"] == margins[-1] and summary["state_path"].startswith("tinker://")
    assert "step 12/12" in result.stderr and "margin" in result.stderr
    plotted = json.loads(cli("runs", "plot", str(run_dir), "--json").stdout)
    assert [p["label"] for p in plotted["panels"]] == ["loss", "margin", "accuracy"]
    config = ("--config", str(run_dir / "config.yaml"), "--log-path", str(run_dir))
    again = cli("train", "dpo", *config, "--epochs", "4")  # one more epoch, from the folder
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming in" in again.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == list(range(16))
    assert rows[12]["margin"] > 0.5  # the reference stayed the base model, not the checkpoint


def test_dry_run_plans_and_bad_pairs_are_reported_by_line(tmp_path, tiny_model):
    data = pairs_file(tmp_path / "pairs.jsonl", n=10)
    base = ("train", "dpo", "--model", str(tiny_model), "--base-url", DEAD_URL, "--dry-run")
    result = cli(*base, "--dataset", str(data), "--batch-size", "4", "--json",
                 "--log-path", str(tmp_path / "run"))  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["pairs"] == 10 and plan["steps"] == 2 and plan["dropped_per_epoch"] == 2
    assert plan["options"]["beta"] == 0.1 and plan["options"]["lr"] == 1e-5
    assert not (tmp_path / "run").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"prompt": "hi", "chosen": "a", "rejected": "a"}\n'
        '{"prompt": "hi", "chosen": "a"}\n'
        '{"chosen": [{"role": "user", "content": "x"}], "rejected": "b", "prompt": "p"}\n'
        '{"prompt": "hi", "chosen": "a", "rejected": "b"}\n'
    )
    result = cli(*base, "--dataset", str(bad))
    assert result.returncode == 1 and "3 of 4 lines are not usable preference pairs" in (
        result.stderr
    )
    assert 'line 1: "chosen" and "rejected" are the same' in result.stderr
    assert 'line 2: no "rejected" field (keys: chosen, prompt)' in result.stderr
    assert 'line 3: "chosen" and "rejected" are not both strings' in result.stderr
    result = cli(*base, "--dataset", str(data), "--batch-size", "11")
    assert result.returncode == 1 and "--batch-size 11: larger than the 10 pairs" in result.stderr
    result = cli(*base, "--dataset", str(data), "--beta", "0")
    assert result.returncode == 1 and "--beta 0.0: must be greater than 0" in result.stderr


def test_pairs_become_the_cookbooks_comparisons():
    from rlcli.data.pairs import to_comparison

    user = {"role": "user", "content": "Q"}
    system = {"role": "system", "content": "S"}
    row, problem = to_comparison({
        "chosen": [system, user, {"role": "assistant", "content": "good"}],
        "rejected": [system, user, {"role": "assistant", "content": "bad"}],
    })  # fmt: skip
    assert problem is None and row["label"] == "A"
    assert row["comparison"] == {
        "prompt_conversation": [system, user],
        "completion_A": [{"role": "assistant", "content": "good"}],
        "completion_B": [{"role": "assistant", "content": "bad"}],
    }


def test_runs_cancel_saves_where_the_next_step_starts(tmp_path, server, tiny_model):
    import subprocess

    from conftest import RLCLI, wait_for_steps

    data = pairs_file(tmp_path / "pairs.jsonl", n=8)
    run_dir = tmp_path / "run"
    args = (
        "train", "dpo", "--dataset", str(data), "--model", str(tiny_model),
        "--base-url", server.base_url, "--log-path", str(run_dir), "--batch-size", "4",
        "--lora-rank", "8", "--save-every", "0",
    )  # fmt: skip
    env = {"RLCLI_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen(
        [*RLCLI, *args, "--epochs", "50"], stderr=subprocess.PIPE, text=True,
        env={**__import__("os").environ, **env},
    )  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    wait_for_steps(run_dir, 3, proc)
    cancelled = cli("runs", "cancel", str(run_dir), "--json", env=env)
    assert cancelled.returncode == 0, cancelled.stderr
    assert json.loads(cancelled.stdout)["checkpoint"]["state_path"].startswith("tinker://")
    proc.communicate(timeout=60)
    done = len(metrics.read_text().splitlines())
    last = [json.loads(line) for line in (run_dir / "checkpoints.jsonl").open()][-1]
    assert last["cancelled"] and (last["epoch"], last["batch"]) == divmod(done, 2)
    again = cli(*args, "--epochs", "50", "--max-steps", str(done + 1), env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in metrics.open()]
    assert steps == list(range(done + 1))  # picked up exactly where it stopped
