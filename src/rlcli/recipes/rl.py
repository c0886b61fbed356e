"""RL on GSM8K with any loss: rlcli's layer over the cookbook's ``rl.train``.

``prepare`` checks flags and plans without a server; the loss guard (``loss_guard.py``) runs
before any rollout; ``cookbook_config`` builds the recipe config from the saved spec;
``run_in_child`` runs it. The pedagogical version of the loop is the cookbook's
``recipes/rl_loop.py``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from rlcli.errors import RlcliError
from rlcli.recipes.runner import check_minimums, default_run_dir, metric_values, resume_command

GSM8K_TRAIN_ROWS = 7473
# What the guard and `--loss gspo` users should know about SkyRL's multi-GPU backends.
GSPO_NOTE = (
    "note: gspo runs fused here (one forward_backward per step, results in input order). On "
    "SkyRL's Tinker server with token-based micro-batching (trainer.max_tokens_per_microbatch "
    "> 0), per-example results came back in packed order, pairing one example's logprobs with "
    "another's: fixed for the megatron worker by NovaSky-AI/SkyRL#2043, first released in "
    "skyrl 0.4.0 (0.3.x is affected); the fsdp worker's fix is tracked in #1865 / #2209."
)


@dataclass
class RLOptions:
    model: str
    base_url: str = "http://localhost:8000"
    loss: str = "importance_sampling"
    loss_config: str | None = None  # raw JSON
    backend: str | None = None
    dataset: str = "gsm8k"
    gsm8k_dir: str | None = None
    renderer: str | None = None
    batch_size: int = 64
    group_size: int = 8
    lr: float = 4e-5
    max_tokens: int = 256
    lora_rank: int = 32
    save_every: int = 20
    eval_every: int = 0
    eval_size: int = 200
    max_steps: int | None = None
    log_path: str | None = None


@dataclass
class RLPlan:
    run_dir: str
    loss: str
    loss_config: dict | None
    data_source: str
    problems_per_step: int
    rollouts_per_step: int
    steps: int
    renderer: str
    renderer_source: str
    resuming: bool


def parse_loss_config(raw: str | None) -> dict | None:
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise RlcliError(f"--loss-config: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(value, dict) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in value.values()
    ):
        raise RlcliError('--loss-config: expected a JSON object of numbers, e.g. {"beta": 0.1}')
    return value


def prepare(opts: RLOptions) -> RLPlan:
    from rlcli.compat import resolve_renderer
    from rlcli.data import gsm8k
    from rlcli.recipes import loss_guard

    if opts.loss not in loss_guard.CHOICES:
        raise RlcliError(f"--loss {opts.loss}: choose from {', '.join(loss_guard.CHOICES)}")
    if opts.dataset != "gsm8k":
        raise RlcliError(f"--dataset {opts.dataset}: only gsm8k is available")
    check_minimums(
        (
            ("--batch-size", opts.batch_size, 1),
            ("--group-size", opts.group_size, 2),  # advantages are relative to the group
            ("--max-tokens", opts.max_tokens, 1),
            ("--lora-rank", opts.lora_rank, 1),
            ("--save-every", opts.save_every, 0),
            ("--eval-every", opts.eval_every, 0),
        )
    )
    config = parse_loss_config(opts.loss_config)
    loss_guard.check_backend_hint(opts.backend, opts.loss)
    folder = gsm8k.resolve_dir(opts.gsm8k_dir)
    renderer, source, _ = resolve_renderer(opts.model, opts.renderer)
    run_dir = Path(opts.log_path).expanduser() if opts.log_path else default_run_dir("rl")
    steps = math.ceil(GSM8K_TRAIN_ROWS / opts.batch_size)
    if opts.max_steps is not None:
        steps = min(steps, opts.max_steps)
    return RLPlan(
        run_dir=str(run_dir),
        loss=opts.loss,
        loss_config=config,
        data_source=str(folder) if folder else f"hub:{gsm8k.HUB_ID}",
        problems_per_step=opts.batch_size,
        rollouts_per_step=opts.batch_size * opts.group_size,
        steps=steps,
        renderer=renderer,
        renderer_source=source,
        resuming=(run_dir / "checkpoints.jsonl").exists(),
    )


def spec(opts: RLOptions, plan: RLPlan) -> dict:
    return {"recipe": "rl", "options": asdict(opts), "plan": asdict(plan)}


def cookbook_config(spec: dict):
    from tinker_cookbook.rl import train

    from rlcli.recipes.gsm8k_builder import Gsm8kRowsBuilder

    opts, plan = spec["options"], spec["plan"]
    builder = Gsm8kRowsBuilder(
        batch_size=opts["batch_size"],
        group_size=opts["group_size"],
        model_name_for_tokenizer=opts["model"],
        renderer_name=plan["renderer"],
        data_dir=plan["data_source"] if not plan["data_source"].startswith("hub:") else None,
        eval_size=opts["eval_size"] if opts["eval_every"] else 0,
    )
    return train.Config(
        learning_rate=opts["lr"],
        dataset_builder=builder,
        model_name=opts["model"],
        recipe_name="rlcli_rl",
        max_tokens=opts["max_tokens"],
        log_path=plan["run_dir"],
        renderer_name=plan["renderer"],
        loss_fn=plan["loss"],
        loss_fn_config=plan["loss_config"],
        lora_rank=opts["lora_rank"],
        save_every=opts["save_every"],
        eval_every=opts["eval_every"],
        base_url=opts["base_url"],
        max_steps=plan["steps"],
        num_groups_to_log=0,
    )


REWARD, ACCURACY = "env/all/reward/total", "env/all/correct"
SAMPLED_TOKENS = "env/all/total_ac_tokens"  # per step: behind the tokens/s shown


def run_in_child(spec: dict) -> dict:
    import asyncio

    from tinker_cookbook import checkpoint_utils
    from tinker_cookbook.rl import train

    config = cookbook_config(spec)
    asyncio.run(train.main(config))
    run_dir = Path(config.log_path)
    last = checkpoint_utils.get_last_checkpoint(config.log_path)
    test_accuracy = "test/env/all/correct"
    series = metric_values(run_dir, REWARD, ACCURACY, test_accuracy)
    return {
        "run_dir": config.log_path,
        "loss": config.loss_fn,
        "state_path": last.state_path if last else None,
        "sampler_path": last.get("sampler_path") if last else None,
        "first_reward": (series[REWARD] or [None])[0],
        "final_reward": (series[REWARD] or [None])[-1],
        "final_accuracy": (series[ACCURACY] or [None])[-1],
        "test_accuracy": (series[test_accuracy] or [None])[-1],
    }


def resume_hint(opts: RLOptions, plan: RLPlan) -> str:
    return resume_command("rlcli train rl", opts, plan.run_dir)
