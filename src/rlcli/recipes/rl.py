"""RL on an environment of the registry (``rlcli.envs``: GSM8K, arithmetic, niah, a user's
JSONL) with any loss: rlcli's layer over the cookbook's ``rl.train``.

``prepare`` checks flags, the environment (a JSONL's bad lines by number) and plans without a
server; the loss guard (``loss_guard.py``) runs
before any rollout; ``cookbook_config`` builds the recipe config from the saved spec;
``run_in_child`` runs it. The pedagogical version of the loop is the cookbook's
``recipes/rl_loop.py``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from rlcli import envs
from rlcli.compat.renderer_choice import resolve_renderer
from rlcli.compat.skyrl_client import bounded_seed
from rlcli.data import gsm8k
from rlcli.envs.reward_fn import ERRORS_FILE, check_spec
from rlcli.errors import RlcliError
from rlcli.flags import option, retune
from rlcli.recipes import base, loss_guard
from rlcli.recipes.base import Plan, Recipe
from rlcli.recipes.options import PolicyOptions, TrainOptions
from rlcli.recipes.preflight import check_model_arg, check_renderer
from rlcli.runs.runner import metric_values

GSM8K_TRAIN_ROWS = 7473  # the hub's openai/gsm8k "main" train split
GSM8K_TEST_ROWS = 1319
# Said only where it can apply (gspo on a SkyRL fsdp/megatron backend, or a server that does not
# say what it is). Checked against NovaSky-AI/SkyRL: #2043 (merged 2026-08-14, after the
# skyrl 0.3.0 release) restored input order for megatron; the fsdp fix (#2209, issue #1865)
# was still open when checked.
GSPO_NOTE = (
    "note: SkyRL fsdp/megatron with max_tokens_per_microbatch > 0 returned per-example results "
    "in packed order (megatron fixed by NovaSky-AI/SkyRL#2043; fsdp open: #1865)"
)


@dataclass(kw_only=True)
class RLOptions(PolicyOptions):
    dataset: str = option(
        "gsm8k",
        "Environment to train on: gsm8k, arithmetic (the cookbook's), niah[:words=N,depth=D] "
        '(needle in a haystack), or a JSONL file of {"question", "answer"} pairs.',
    )
    gsm8k_dir: str | None = option(
        None, "Folder with GSM8K train.jsonl/test.jsonl (env: RLCLI_GSM8K_DIR; else the hub)."
    )
    batch_size: int = option(64, "Problems per step.", min=1)
    lr: float = retune(TrainOptions, "lr", 4e-5)
    eval_size: int = option(200, "Test problems per evaluation.", min=1)
    reward: str | None = option(
        None,
        "Your reward for a JSONL --dataset: FILE.py:FUNCTION, called FUNCTION(question, answer, "
        "**row) -> float on each sampled answer (row: the row's other fields, its answer as "
        "reference=); replaces the built-in grading.",
    )
    reward_timeout: float = option(
        10.0, "Seconds one --reward call may take; a slower one scores 0 and is reported.", gt=0
    )


@dataclass
class PolicyPlan(Plan):
    """What an RL-style run's plan says beyond every plan's fields (rl, harbor)."""

    loss: str
    loss_config: dict | None
    dataset: str
    data_source: str


@dataclass
class RLPlan(PolicyPlan):
    train_problems: int
    test_problems: int
    problems_per_step: int
    rollouts_per_step: int
    reward: str | None = None  # FILE.py:FUNCTION, the file's absolute path


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
        raise RlcliError(
            '--loss-config: expected a JSON object of numbers, e.g. {"clip_low_threshold": 0.9}'
        )
    return value


def check_policy_flags(opts: PolicyOptions) -> dict | None:
    """The checks every RL-style command (rl, harbor) makes before it plans: the loss and its
    config, the backend hint, the checkpoint paths, the model folder and the renderer name.
    Returns the parsed loss config."""
    config = parse_loss_config(opts.loss_config)
    loss_guard.check_backend_hint(opts.backend, opts.loss)
    for flag, path in (
        ("--init-checkpoint", opts.init_checkpoint),
        ("--kl-reference", opts.kl_reference),
    ):
        if path and not path.startswith("tinker://"):
            raise RlcliError(f"{flag} {path}: expected a tinker:// path")
    if opts.kl_reference and not opts.kl_penalty_coef:
        raise RlcliError("--kl-reference: set --kl-penalty-coef too (the penalty is off at 0)")
    check_model_arg(opts.model)
    check_renderer(opts.renderer)
    return config


REWARD, ACCURACY = "env/all/reward/total", "env/all/correct"
SAMPLED_TOKENS = "env/all/total_ac_tokens"  # per step: behind the tokens/s shown
# rlcli's torch server: mean |logp_train - logp_sampler| over the step's sampled tokens
LOGP_DIFF = "rlcli/logp_diff_mean:mean"


def seed_sampling(seed: int) -> None:
    """Give every rollout a seed derived from ``seed``, its prompt and how many times that
    prompt was sampled before, so a run samples the same tokens run to run.

    The cookbook's ``TinkerTokenCompleter`` sends no seed; this fills one into each
    ``SamplingClient.sample`` call of this (child) process: the cookbook calls the deprecated
    ``sample_async``, which tinker 0.38 runs through ``sample``, the method it keeps. Counting
    per prompt (not a global counter) keeps the seeds independent of the order concurrent
    rollouts reach the server, and of a resume (each prompt is seen once per pass).
    tests/test_options.py fails if either path stops going through ``sample``.
    """
    import hashlib
    from collections import Counter

    import tinker

    original = tinker.SamplingClient.sample
    seen: Counter = Counter()

    def sample(self, prompt, num_samples, sampling_params, *args, **kwargs):
        if sampling_params.seed is None:
            tokens = tuple(prompt.to_ints())
            n, seen[tokens] = seen[tokens], seen[tokens] + 1
            digest = hashlib.sha256(repr((seed, tokens, n)).encode()).digest()
            derived = bounded_seed(int.from_bytes(digest[:4], "big"))  # SkyRL: int32
            sampling_params = sampling_params.model_copy(update={"seed": derived})
        return original(self, prompt, num_samples, sampling_params, *args, **kwargs)

    tinker.SamplingClient.sample = sample  # type: ignore[method-assign]


def policy_summary(config, last_values: dict[str, str]) -> dict:
    """The end summary of an ``rl.train`` run: the last checkpoint's paths, the first and last
    reward, and the last value of each metric in ``last_values`` ({summary key: metric})."""
    series = metric_values(Path(config.log_path), REWARD, *last_values.values())
    return base.summary_of(
        config.log_path,
        {"loss": config.loss_fn},
        **base.first_last(series, {"reward": REWARD}),
        **{key: (series[metric] or [None])[-1] for key, metric in last_values.items()},
    )


def check_policy_server(server, opts: PolicyOptions, loss_config, report, note=True) -> str:
    """The server checks of an RL-style command before any rollout: sampling length, the
    checkpoints named, the loss guard, then the loss config's keys and values. Returns the
    backend; says the SkyRL note where it applies (``note``)."""
    server.check_max_tokens(opts.max_tokens)
    server.check_checkpoint(opts.init_checkpoint, "--init-checkpoint", "training")
    server.check_checkpoint(opts.kl_reference, "--kl-reference", "sampler")
    served_by = loss_guard.check_server(
        server.base_url, opts.loss, opts.backend, opts.model, loss_config
    )
    server.check_loss_config_values(opts.model, opts.loss, loss_config)
    said = loss_guard.skyrl_note(served_by, opts.loss, loss_config) if note else None
    if said:
        report(said)
    return served_by


def policy_config(recipe, spec: dict, builder):
    """The cookbook's ``rl.train.Config`` from an RL-style command's saved options (``train rl``,
    ``train harbor``): the loss, the KL reference, checkpoints, evaluation, logging."""
    from tinker_cookbook.rl import train

    opts, plan = spec["options"], spec["plan"]
    kl_reference = None
    if opts["kl_penalty_coef"] > 0:  # the base model's weights, or a sampler checkpoint's
        kl_reference = train.KLReferenceConfig(
            base_model=opts["model"], load_checkpoint_path=opts["kl_reference"]
        )
    return train.Config(
        **recipe.cookbook_kwargs(spec),
        **base.picked(opts, "max_tokens", "temperature", "kl_penalty_coef", "eval_every"),
        dataset_builder=builder,
        loss_fn=plan["loss"],
        loss_fn_config=plan["loss_config"],
        load_checkpoint_path=opts["init_checkpoint"],
        kl_reference_config=kl_reference,
        max_steps=plan["steps"],
        num_groups_to_log=0,
    )


REWARD_ERRORS = "env/all/reward_error"  # --reward: the share of calls that failed, per step


class RL(Recipe):
    name = "rl"
    options = RLOptions
    help = (
        "RL on an environment (gsm8k, arithmetic, niah, your own JSONL) with the cookbook's "
        "RL recipe; every loss, fused on the server."
    )
    show = {REWARD: "reward", ACCURACY: "acc", LOGP_DIFF: "dlogp", REWARD_ERRORS: "reward errors"}
    tokens_key = SAMPLED_TOKENS

    def prepare(self, opts: RLOptions, stdin=None, dry_run=False) -> tuple[RLPlan, None]:
        """Check flags, model, renderer and data, and count the steps; no server, no writes."""
        config = check_policy_flags(opts)
        reward = None
        if opts.reward:
            path, name = check_spec(opts.reward)
            reward = {"path": str(path), "name": name, "timeout": opts.reward_timeout}
        env = envs.get(
            opts.dataset, flag="--dataset", gsm8k_dir=opts.gsm8k_dir,
            reward=reward and {**reward, "errors_path": None},
        )  # fmt: skip
        if env.generated:  # one pass is the environment's own number of batches
            train_rows, test_rows = env.train_batches * opts.batch_size, opts.eval_size
        elif env.name == "gsm8k" and env.folder is None:  # the hub: counted, not downloaded
            train_rows, test_rows = GSM8K_TRAIN_ROWS, GSM8K_TEST_ROWS
        else:
            train_rows, test_rows = env.count("train") or 0, env.count("test") or 0
        if train_rows == 0:
            raise RlcliError(f"--gsm8k-dir {env.source}: train.jsonl has no rows")
        if opts.eval_every and not env.has_test_split:
            raise RlcliError(
                f"--eval-every {opts.eval_every}: {opts.dataset} is one split, no test problems; "
                "score a held-out file with `rlcli eval rl --env HELD_OUT.jsonl`"
            )
        if opts.eval_every and test_rows == 0:
            raise RlcliError(f"--eval-every {opts.eval_every}: {env.source}/test.jsonl has no rows")
        renderer, source, _ = resolve_renderer(opts.model, opts.renderer)
        run_dir = self.run_dir_of(opts)
        plan = RLPlan(
            run_dir=str(run_dir),
            loss=opts.loss,
            loss_config=config,
            dataset=str(env.path) if env.name == "jsonl" else opts.dataset,
            data_source=env.source,
            train_problems=train_rows,
            test_problems=min(test_rows, opts.eval_size) if opts.eval_every else 0,
            problems_per_step=min(opts.batch_size, train_rows),
            rollouts_per_step=min(opts.batch_size, train_rows) * opts.group_size,
            steps=base.capped(math.ceil(train_rows / opts.batch_size), opts),  # the last: partial
            renderer=renderer,
            renderer_source=source,
            resuming=base.resuming(run_dir),
            reward=f"{reward['path']}:{reward['name']}" if reward else None,
        )
        return plan, None

    def check_server(self, server, opts: RLOptions, plan: RLPlan, report) -> str:
        """Before any rollout: the hub's GSM8K answers, then the RL-style checks."""
        if plan.data_source.startswith("hub:"):  # fail now, not inside the recipe, if offline
            gsm8k.load_rows(None, "test")
        return check_policy_server(server, opts, plan.loss_config, report)

    def notes(self, opts: RLOptions, served_by: str) -> list[str]:
        """The SkyRL result-order note matters for gspo on SkyRL, or a server that says
        nothing."""
        if opts.loss != "gspo":
            return []
        named = served_by or opts.backend
        return [GSPO_NOTE] if named in (None, "fsdp", "megatron", "unknown") else []

    def resolved_fields(self, opts: RLOptions, plan: RLPlan, base_url: str) -> dict:
        """A JSONL dataset as an absolute path and GSM8K's folder (so ``--config`` of the run
        trains on the same data), and the reward file found."""
        gsm8k = plan.dataset == "gsm8k" and not plan.data_source.startswith("hub:")
        return {
            "dataset": plan.dataset,
            "gsm8k_dir": plan.data_source if gsm8k else None,
            "reward": plan.reward,
        }

    def describe(self, plan: RLPlan, served_by: str = "") -> str:
        backend = f" ({served_by} backend)" if served_by else ""
        return f"loss {plan.loss}{backend}, {plan.steps} steps of {plan.rollouts_per_step} rollouts"

    def cookbook_config(self, spec: dict):
        from rlcli.recipes.env_builder import EnvDatasetBuilder

        opts, plan = spec["options"], spec["plan"]
        builder = EnvDatasetBuilder(
            **base.dataset_kwargs(spec, "dataset", "batch_size", "group_size", "seed"),
            data_dir=opts["gsm8k_dir"],
            eval_size=opts["eval_size"] if opts["eval_every"] else 0,
            reward=opts.get("reward"),
            reward_timeout=opts.get("reward_timeout", 10.0),
            reward_errors_path=str(Path(plan["run_dir"]) / ERRORS_FILE),
        )
        return policy_config(self, spec, builder)

    def run_in_child(self, spec: dict) -> dict:
        import asyncio

        from tinker_cookbook.rl import train

        config = self.cookbook_config(spec)
        seed_sampling(spec["options"]["seed"])
        asyncio.run(train.main(config))
        if spec["options"].get("reward"):  # the user's function grades: no accuracy
            summary = policy_summary(config, {})
            errors = Path(config.log_path) / ERRORS_FILE
            if errors.exists():
                summary["reward_errors"] = len(errors.read_text().splitlines())
                summary["reward_errors_file"] = str(errors)
            return summary
        return policy_summary(
            config, {"final_accuracy": ACCURACY, "test_accuracy": "test/env/all/correct"}
        )
