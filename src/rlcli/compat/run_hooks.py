"""Everything that depends on the pinned ``tinker`` / ``tinker-cookbook`` versions.

rlcli itself runs on ``tinker`` 0.38 and drives ``tinker-cookbook==0.5.8`` (the server speaks to
every SDK generation from 0.25 on: ``server/generations.py``). Whatever on the client side would
break on a pin bump is named here, and ``tests/test_compat.py`` checks each
assumption against the installed packages, so a bump fails loudly in one place.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from tinker.proto import tinker_public_pb2 as public_pb  # noqa: F401  (generated schema)

TINKER_VERSION = "0.38.0"
TINKER_COOKBOOK_VERSION = "0.5.8"

# Losses the 0.38 client's ``LossFnType`` names (0.25's lacked gspo, stable_reinforce and
# custom). Other names (``dppo``) are sent as-is by the client; nothing checks them client-side.
CLIENT_LOSS_NAMES = (
    "cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce",
    "custom",
)  # fmt: skip

# The API key prefix the client insists on before it sends anything.
API_KEY_PREFIX = "tml-"
DEFAULT_API_KEY = "tml-dummy"


_BEFORE_HUB_LOOKUP: list = []  # checks to make before a hub id's tokenizer is looked up


@contextlib.contextmanager
def before_hub_lookup(check):
    """Within it, ``resolve_renderer`` calls ``check()`` before it looks a hub id's tokenizer
    up (``train`` asks the server whether it hosts the model: a few ms, where the lookup
    retries an unreachable hub for a minute). Local checks made before that stay first."""
    if check is not None:
        _BEFORE_HUB_LOOKUP.append(check)
    try:
        yield
    finally:
        if check is not None:
            _BEFORE_HUB_LOOKUP.remove(check)


def resolve_renderer(model: str, requested: str | None):
    """(renderer name, why it was chosen and whether it matches the model's chat template,
    tokenizer or None).

    The candidate: ``--renderer``, else the cookbook's ``model_info`` recommendation (hub
    names only), else by the tokenizer's chat template: ChatML (``<|im_start|>``) ->
    ``qwen3_instruct`` (no thinking tags), Llama 3 headers -> ``llama3``, else ``role_colon``.
    Unless it was asked for by name, a candidate that does not reproduce the tokenizer's own
    chat template token for token (``renderers.compare``) gives way to ``chat_template``, the
    template itself, so the model is trained on the prompts it will be served with.
    """
    from rlcli import renderers

    renderers.register()
    if not Path(model).expanduser().exists():  # a hub id: a lookup that may be slow
        for check in list(_BEFORE_HUB_LOOKUP):
            check()
    tokenizer = None
    try:
        from tinker_cookbook import tokenizer_utils

        tokenizer = tokenizer_utils.get_tokenizer(model)
    except Exception:  # hub id without network: the recipe will say so if it needs it
        tokenizer = None
    if requested:
        return requested, "--renderer" + _agreement(requested, tokenizer), tokenizer
    from tinker_cookbook import model_info

    try:
        name, why = model_info.get_recommended_renderer_name(model), "recommended for the model"
    except Exception:
        template = str(getattr(tokenizer, "chat_template", "") or "")
        if "<|im_start|>" in template:
            name, why = "qwen3_instruct", "ChatML chat template"
        elif "<|start_header_id|>" in template:
            name, why = "llama3", "Llama 3 chat template"
        else:
            name, why = "role_colon", "no known chat template"
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return name, why + _agreement(name, tokenizer), tokenizer
    difference = renderers.compare(name, tokenizer)
    if difference is None:
        return name, f"{why}; matches the model's chat template exactly", tokenizer
    if renderers.compare(renderers.NAME, tokenizer) is not None:  # the template cannot either
        return name, f"{why}; differs from the model's chat template: {difference}", tokenizer
    return (
        renderers.NAME,
        f"the model's own chat template, exactly; {name} differs from it: {difference}",
        tokenizer,
    )


def _agreement(name: str, tokenizer) -> str:
    """``; matches ...`` or ``; differs ...`` for a renderer against the tokenizer's template."""
    from rlcli import renderers

    if tokenizer is None:
        return "; not compared with the chat template (no tokenizer here)"
    if not getattr(tokenizer, "chat_template", None):
        return "; the tokenizer has no chat template to compare with"
    difference = renderers.compare(name, tokenizer)
    if difference is None:
        return "; matches the model's chat template exactly"
    return f"; differs from the model's chat template: {difference}"


# ---- Run hooks: exact SL resume, and progress from inside the recipes ------------------------
#
# tinker-cookbook 0.5.7 ``supervised/train.py`` pipelines: with ``submit_ahead`` k (default 1)
# it submits batch s+k's forward_backward + optim_step before it finishes batch s, and
# ``finish_batch(s)`` queues the periodic ``save_state`` first thing, recording
# ``{"epoch": e, "batch": s}`` as the batch to run next. The server runs requests in arrival
# order, so checkpoint ``s`` holds s + 1 + k optimizer steps while a resume starts at batch s:
# batches s .. s+k are applied twice (checkpoint 000004 held 6 steps). The fix, without forking
# the recipe: run it with ``submit_ahead=0`` (only batch s is queued when its save is), and
# record ``batch = s + 1``, the batch that really comes next. A resume from the last batch of
# an epoch then starts at ``batch == n_batches``, which the recipe's loop treats as the start
# of the next epoch. tests/test_resume.py checks the cookbook still behaves this way.
# The checkpoint is named ``s + 1`` too (and saved on that count's cadence): every checkpoint of
# every recipe is named by the optimizer steps it holds, the "step N" that progress, ``runs
# show`` and a cancel print, and a name saved already is not saved (or recorded) twice.
SL_SAVE_RECORDS_BATCH_BEFORE_ITS_STEP = True


# tinker-cookbook 0.5.8 ``supervised/train.py`` sets each step's learning rate to
# ``learning_rate * compute_schedule_lr_multiplier(lr_schedule, step, total_steps)``, a name it
# imports into its own module; it has no warmup. ``install_lr_warmup`` replaces that name there.
SL_LR_MULTIPLIER = "compute_schedule_lr_multiplier"


def warmup_multiplier(schedule, lr_schedule: str, step: int, total: int, warmup: int) -> float:
    """The learning-rate multiplier of ``step`` (0-based) of ``total``: ``(step + 1) / warmup``
    for the first ``warmup`` steps (the last of them at the full rate), then ``schedule`` (the
    cookbook's multiplier) over the steps left, as if the run started there."""
    if step < warmup:
        return (step + 1) / warmup
    return schedule(lr_schedule, step - warmup, total - warmup)


def install_lr_warmup(warmup_steps: int) -> None:
    """Give the cookbook's supervised loop (in this child process) ``warmup_steps`` of linear
    warmup before its schedule; nothing changes at 0."""
    if not warmup_steps:
        return
    from tinker_cookbook.supervised import train as sl_train

    schedule = getattr(sl_train, SL_LR_MULTIPLIER)

    def multiplier(lr_schedule, step, total_steps):
        return warmup_multiplier(schedule, lr_schedule, step, total_steps, warmup_steps)

    setattr(sl_train, SL_LR_MULTIPLIER, multiplier)


def install_run_hooks(report, seed: int = 0) -> None:
    """Patch the pinned cookbook, in the recipe's child process only, so that ``train sl``
    resumes exactly, a run's LoRA initialisation follows its ``seed`` (the recipes ask for a
    random one), and the recipes say what they are doing. ``report(phase, **fields)``
    receives: ``saving checkpoint`` (step), ``saving final checkpoint``, ``sampling rollouts``
    (step, done, total), ``recipe finished``."""
    import warnings

    import chz

    # The cookbook (0.5.8) still calls the 0.38 client's deprecated `*_async` spellings: the
    # warning is about its code, not the user's; one per call would flood the run's log.
    for message in (r"DEPRECATED: ", r"Using the future as the ", r"Deprecated: use "):
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    import tinker
    from tinker_cookbook import checkpoint_utils
    from tinker_cookbook.rl import train as rl_train
    from tinker_cookbook.supervised import train as sl_train

    manager = checkpoint_utils.CheckpointManager
    state = {"sl": False}

    original_create = tinker.ServiceClient.create_lora_training_client_async

    async def create_lora_training_client_async(self, *args, **kwargs):
        if kwargs.get("seed") is None and len(args) < 3:  # (base_model, rank, seed, ...)
            kwargs["seed"] = seed
        return await original_create(self, *args, **kwargs)

    tinker.ServiceClient.create_lora_training_client_async = create_lora_training_client_async

    original_sl_main = sl_train.main

    async def sl_main(config, *args, **kwargs):
        state["sl"] = True
        try:
            return await original_sl_main(chz.replace(config, submit_ahead=0), *args, **kwargs)
        finally:
            state["sl"] = False
            report("recipe finished")

    sl_train.main = sl_main

    original_maybe_save = manager.maybe_save_async

    async def maybe_save_async(self, step, loop_state, *args, **kwargs):
        if state["sl"]:  # SL's step s is saved once it is done: name it s + 1 (steps held)
            step += 1
            if "batch" in loop_state:
                loop_state = {**loop_state, "batch": loop_state["batch"] + 1}
        if self.should_save_periodic(step, elapsed_tokens=kwargs.get("elapsed_tokens", 0)):
            report("saving checkpoint", step=step - 1)
        return await original_maybe_save(self, step, loop_state, *args, **kwargs)

    manager.maybe_save_async = maybe_save_async

    original_save_periodic = manager.save_periodic_async

    async def save_periodic_async(self, step, loop_state):
        saved = _saved_as(self._log_path, f"{step:06d}")
        if saved is not None:  # a cancel at a step just saved: one row per checkpoint
            return saved
        if not state["sl"]:  # RL saves through this directly; its step i holds i steps
            report("saving checkpoint", step=step - 1)
        return await original_save_periodic(self, step, loop_state)

    manager.save_periodic_async = save_periodic_async

    original_save_final = manager.save_final_async

    async def save_final_async(self, loop_state):
        report("saving final checkpoint")
        return await original_save_final(self, loop_state)

    manager.save_final_async = save_final_async

    original_rl_main = rl_train.main

    async def rl_main(*args, **kwargs):
        try:
            return await original_rl_main(*args, **kwargs)
        finally:
            report("recipe finished")

    rl_train.main = rl_main

    # Rollouts: ``do_sync_training`` builds one coroutine per group through the module-level
    # ``do_group_rollout_and_filter_constant_reward`` and awaits them in
    # ``gather_with_progress(coroutines, desc="Sampling batch <i>")``.
    original_group = rl_train.do_group_rollout_and_filter_constant_reward
    rollouts = {"step": None, "done": 0, "total": 0}

    def group_rollout(sampling_client, env_group_builder, *args, **kwargs):
        size = int(getattr(env_group_builder, "num_envs", 1) or 1)
        rollouts["total"] += size

        async def run():
            result = await original_group(sampling_client, env_group_builder, *args, **kwargs)
            rollouts["done"] += size
            report("sampling rollouts", **rollouts)
            return result

        return run()

    rl_train.do_group_rollout_and_filter_constant_reward = group_rollout

    original_gather = rl_train.gather_with_progress

    async def gather_with_progress(coroutines, desc):
        step = desc.rsplit(" ", 1)[-1]
        rollouts.update(step=int(step) if step.isdigit() else None, done=0, total=0)
        coroutine_list = list(coroutines)  # builds every group: the total is known now
        report("sampling rollouts", **rollouts)
        return await original_gather(coroutine_list, desc)

    rl_train.gather_with_progress = gather_with_progress

    # Distillation (``train opsd``) samples through the same group rollouts but gathers them
    # with ``asyncio.gather``; each step starts at ``CompositeDataset.get_batch(i_batch)``.
    from tinker_cookbook.distillation import datasets as distillation_datasets
    from tinker_cookbook.distillation import train_on_policy

    original_get_batch = distillation_datasets.CompositeDataset.get_batch

    def get_batch(self, i_batch):
        rollouts.update(step=i_batch, done=0, total=0)
        return original_get_batch(self, i_batch)

    distillation_datasets.CompositeDataset.get_batch = get_batch
    train_on_policy.do_group_rollout_and_filter_constant_reward = group_rollout  # its own import

    original_distillation_main = train_on_policy.main

    async def distillation_main(*args, **kwargs):
        try:
            return await original_distillation_main(*args, **kwargs)
        finally:
            report("recipe finished")

    train_on_policy.main = distillation_main


def _saved_as(log_path, name: str) -> dict[str, str] | None:
    """The paths of the run's last checkpoint if it is already called ``name``, else None."""
    from tinker_cookbook import checkpoint_utils

    records = checkpoint_utils.load_checkpoints_file(str(log_path))
    if not records or records[-1].name != name:
        return None
    last = records[-1]
    return {k: last.get(k) for k in ("state_path", "sampler_path") if last.has(k)}


# ---- On-policy distillation (train opsd) -----------------------------------------------------
#
# tinker-cookbook 0.5.7 ``distillation/train_on_policy.py``: ``prepare_minibatch`` calls the
# module-level ``incorporate_kl_penalty(data_D, teacher_clients_D, dataset_indices_D,
# kl_penalty_coef, kl_discount_factor)``, which asks each datum's teacher client for
# ``compute_logprobs_async(model_input + last target)`` (the student's prompt and sampled
# tokens) and reads ``teacher_logprobs[1:]`` against the sampled logprobs, one value per
# token. That call is the seam: rlcli swaps each teacher client for a ``Teacher`` (the hint,
# a teacher on another server, SkyRL's short answers), and copies none of the recipe's setup.
# tests/test_compat.py checks the seam is still there.


def prompts_dataset(prompts: list[dict], batch_size: int, group_size: int, renderer, tokenizer):
    """The cookbook's ``PromptOnlyDataset`` (no reward; the teacher's KL is the signal), with
    each prompt's own context turns (``{"prompt", "context"}`` rows) instead of one prefix for
    all. Relies on ``PromptOnlyEnv(prompt, renderer, convo_prefix=...)`` and
    ``ProblemGroupBuilder(env_thunk, num_envs, dataset_name)``."""
    from functools import partial

    from tinker_cookbook.distillation.datasets import PromptOnlyDataset, PromptOnlyEnv
    from tinker_cookbook.rl.problem_env import ProblemGroupBuilder

    class _PromptsWithContext(PromptOnlyDataset):
        def get_batch(self, index: int):
            rows = prompts[index * self.batch_size : (index + 1) * self.batch_size]
            assert rows, "batch index past the end of the prompts"
            return [
                ProblemGroupBuilder(
                    env_thunk=partial(
                        PromptOnlyEnv, row["prompt"], self.renderer, convo_prefix=row["context"]
                    ),
                    num_envs=self.group_size,
                    dataset_name=self.dataset_name,
                )
                for row in rows
            ]

    return _PromptsWithContext(
        prompts=[p["prompt"] for p in prompts],
        batch_size=batch_size,
        group_size=group_size,
        renderer=renderer,
        tokenizer=tokenizer,
        max_prompt_tokens=None,
    )


def align_prompt_logprobs(values: list, tokens: int) -> list:
    """One logprob per token, the first None: SkyRL 0.4.0 answered ``compute_logprobs`` with one
    value fewer than tokens (none for the first), which the recipe's ``[1:]`` would misalign."""
    values = list(values)
    if len(values) == tokens - 1:
        values = [None, *values]
    if len(values) != tokens:
        raise RuntimeError(
            f"the teacher's server returned {len(values)} logprobs for {tokens} tokens"
        )
    return values


class Teacher:
    """A teacher sampling client as the distillation recipe uses it (``compute_logprobs_async``
    only). With ``hinted`` (the student's rendered prompt -> the teacher's rendered prompt with
    the hint), the teacher scores hint + prompt + the student's answer, and the answer's
    logprobs are returned at the student's positions (the prompt's, which the recipe masks out,
    as 0.0)."""

    def __init__(self, client, hinted: dict[tuple[int, ...], list[int]] | None = None) -> None:
        self.client, self.hinted = client, hinted
        self.lengths = sorted({len(k) for k in hinted or {}}, reverse=True)

    async def compute_logprobs_async(self, sequence):
        import tinker

        tokens = sequence.to_ints()
        if not self.hinted:
            return align_prompt_logprobs(
                await self.client.compute_logprobs_async(sequence), len(tokens)
            )
        prompt_len, teacher_prompt = self._match(tokens)
        teacher_tokens = [*teacher_prompt, *tokens[prompt_len:]]
        scored = align_prompt_logprobs(
            await self.client.compute_logprobs_async(tinker.ModelInput.from_ints(teacher_tokens)),
            len(teacher_tokens),
        )
        return [None, *[0.0] * (prompt_len - 1), *scored[len(teacher_prompt) :]]

    def _match(self, tokens: list[int]) -> tuple[int, list[int]]:
        """The longest known prompt the sequence starts with."""
        for length in self.lengths:
            found = self.hinted.get(tuple(tokens[:length]))  # type: ignore[union-attr]
            if found is not None:
                return length, found
        raise RuntimeError("--teacher-hint: a sampled sequence starts with none of the prompts")


def score_teachers_with(teacher_for) -> None:
    """Make the distillation recipe score with ``teacher_for(teacher_client)`` instead of the
    teacher client it built (see the comment above)."""
    from tinker_cookbook.distillation import train_on_policy

    original = train_on_policy.incorporate_kl_penalty

    async def incorporate_kl_penalty(data_D, teacher_clients_D, *args, **kwargs):
        teachers = [teacher_for(client) for client in teacher_clients_D]
        return await original(data_D, teachers, *args, **kwargs)

    train_on_policy.incorporate_kl_penalty = incorporate_kl_penalty


# ---- Cancel at a step boundary (rlcli runs cancel) -------------------------------------------
#
# tinker-cookbook 0.5.7 ends every step of its three loops with
# ``ml_logger.log_metrics(metrics, step=i)`` on the ``ml_log.MultiplexLogger`` that
# ``setup_logging`` returns (supervised/train.py ``finish_and_log``; rl/train.py and
# distillation/train_on_policy.py ``do_sync_training``). That call is the step boundary: step i's
# optimizer step has been applied and nothing of step i+1 is queued (SL runs with
# ``submit_ahead=0``, above; the RL loops await their train step). The hook checks there for a
# cancel request and raises ``RunCancelled`` out of the loop; the recipe's ``main`` (wrapped)
# catches it and saves a checkpoint, kind "both", through the recipe's own ``CheckpointManager``
# (``save_periodic_async``: the cookbook's naming, TTL and ``checkpoints.jsonl`` row) with the
# loop state a resume reads: SL the ``{"epoch", "batch", "elapsed_tokens"}`` its
# ``maybe_save_async`` was just given (the batch that comes next, as fixed above), RL and
# distillation ``{"batch": i + 1}``. A checkpoint name always holds the same number of steps
# (SL: ``i`` after i + 1 steps, like its periodic saves; RL: ``i + 1``), so a later save under
# the same name holds the same state. A request seen at the last step (the loops' progress
# fraction, ``progress`` / ``progress/done_frac``, is 1) is left to the recipe, which saves
# its final checkpoint and finishes. tests/test_compat.py checks the seam.


class RunCancelled(Exception):
    """``rlcli runs cancel`` stopped the recipe at a step boundary; ``paths`` is the
    checkpoint it saved (``state_path``, ``sampler_path``)."""

    def __init__(self, step: int) -> None:
        super().__init__(f"cancelled after step {step + 1}")
        self.step = step
        self.paths: dict[str, str] = {}


def install_cancel_hook(cancel_requested, report) -> None:
    """In the recipe's child: stop the recipe cleanly, with a checkpoint, at the first step
    boundary where ``cancel_requested()`` is true. Install it before ``install_run_hooks`` (so
    it sees SL's loop state as the exact-resume fix records it)."""
    from tinker_cookbook import checkpoint_utils
    from tinker_cookbook.distillation import train_on_policy
    from tinker_cookbook.rl import train as rl_train
    from tinker_cookbook.supervised import train as sl_train
    from tinker_cookbook.utils import ml_log

    manager_class = checkpoint_utils.CheckpointManager
    seen: dict = {"manager": None, "sl_state": None}

    original_init = manager_class.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        seen["manager"] = self

    manager_class.__init__ = init

    original_maybe_save = manager_class.maybe_save_async

    async def maybe_save_async(self, step, loop_state, *args, **kwargs):
        seen["sl_state"] = (step, dict(loop_state))
        return await original_maybe_save(self, step, loop_state, *args, **kwargs)

    manager_class.maybe_save_async = maybe_save_async

    original_log = ml_log.MultiplexLogger.log_metrics

    def log_metrics(self, metrics, step=None):
        original_log(self, metrics, step)
        done = metrics.get("progress", metrics.get("progress/done_frac"))
        if isinstance(done, int | float) and done >= 1.0:
            return  # the last step: the recipe saves its final checkpoint and ends anyway
        if step is not None and cancel_requested():
            raise RunCancelled(int(step))

    ml_log.MultiplexLogger.log_metrics = log_metrics

    def wrap(module, sl: bool) -> None:
        original_main = module.main

        async def main(*args, **kwargs):
            try:
                return await original_main(*args, **kwargs)
            except RunCancelled as cancelled:
                manager = seen["manager"]
                if manager is None:
                    raise
                step = cancelled.step
                # Named by the steps it holds, as every checkpoint (install_run_hooks).
                if sl and seen["sl_state"] and seen["sl_state"][0] == step + 1:
                    name, loop_state = step + 1, seen["sl_state"][1]
                else:
                    name, loop_state = step + 1, {"batch": step + 1}
                report("cancelling: saving a checkpoint", step=step)
                await manager.finalize_async()  # in-flight saves land first
                cancelled.paths = await manager.save_periodic_async(
                    name, {**loop_state, "cancelled": True}
                )
                raise

        module.main = main

    wrap(sl_train, sl=True)
    wrap(rl_train, sl=False)
    wrap(train_on_policy, sl=False)


def send_lora_alpha(alpha: float | None) -> None:
    """Every LoRA training client this (child) process creates asks for ``alpha`` (``train
    --lora-alpha``): in the request's ``user_metadata``, the one free-form field of the 0.38
    client's create request (its ``LoraConfig`` has no alpha), which rlcli's server reads
    (``server.schemas.LORA_ALPHA_METADATA``). The recipes pass ``user_metadata`` by keyword."""
    if alpha is None:
        return
    import tinker

    from rlcli.server.schemas import LORA_ALPHA_METADATA

    for name in ("create_lora_training_client", "create_lora_training_client_async"):
        original = getattr(tinker.ServiceClient, name)

        def create(self, *args, _original=original, **kwargs):
            if len(args) < 7:  # (base_model, rank, seed, mlp, attn, unembed, user_metadata)
                metadata = dict(kwargs.get("user_metadata") or {})
                kwargs["user_metadata"] = {**metadata, LORA_ALPHA_METADATA: repr(float(alpha))}
            return _original(self, *args, **kwargs)

        setattr(tinker.ServiceClient, name, create)


# ---- DPO: the cookbook's preference/train_dpo (train dpo) -----------------------------------
#
# tinker-cookbook 0.5.8's ``preference/train_dpo.py`` is synchronous: ``main`` makes its clients
# with ``create_dpo_clients(config, service_client, resume_info, user_metadata)`` (a module
# global), whose reference is ``training_client.save_weights_and_get_sampling_client()``: the
# weights it starts from. On a resume those are the checkpoint's, so the reference would move
# to the partly trained policy; ``install_dpo_hooks`` makes it the base model there (what a
# fresh LoRA, B = 0, computes). The recipe creates its LoRA with the synchronous
# ``create_lora_training_client`` and no seed (the run hooks seed the async one only), and it
# logs a step after its update, which is where ``runs cancel`` stops it: the checkpoint saved
# then records the batch that comes next (``{"epoch", "batch"}``, as the recipe's own periodic
# saves do before a step). tests/test_compat.py checks these seams.


def install_dpo_hooks(seed: int, batches_per_epoch: int) -> None:
    """In the recipe child of ``train dpo``: the reference on resume, the LoRA seed, and a
    checkpoint when ``runs cancel`` stops the run (see above)."""
    import asyncio

    import tinker
    from tinker_cookbook import checkpoint_utils
    from tinker_cookbook.preference import train_dpo

    original_create = tinker.ServiceClient.create_lora_training_client

    def create_lora_training_client(self, *args, **kwargs):
        if kwargs.get("seed") is None and len(args) < 3:
            kwargs["seed"] = seed
        return original_create(self, *args, **kwargs)

    tinker.ServiceClient.create_lora_training_client = create_lora_training_client

    original_clients = train_dpo.create_dpo_clients

    def create_dpo_clients(config, service_client, resume_info=None, user_metadata=None):
        training, reference = original_clients(config, service_client, resume_info, user_metadata)
        if resume_info is not None and config.load_checkpoint_path is None:
            reference = service_client.create_sampling_client(base_model=config.model_name)
        return training, reference

    train_dpo.create_dpo_clients = create_dpo_clients

    managers: list = []
    original_init = checkpoint_utils.CheckpointManager.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        managers.append(self)

    checkpoint_utils.CheckpointManager.__init__ = init
    original_main = train_dpo.main

    def main(config, *args, **kwargs):
        try:
            return original_main(config, *args, **kwargs)
        except RunCancelled as cancelled:
            if not managers:
                raise
            done = cancelled.step + 1  # steps applied; the next one's place in its epoch
            state = {"epoch": done // batches_per_epoch, "batch": done % batches_per_epoch}
            cancelled.paths = asyncio.run(
                managers[-1].save_periodic_async(done, {**state, "cancelled": True})
            )
            raise

    train_dpo.main = main


# ---- Harbor: the cookbook's recipes/harbor_rl with rlcli's sandbox (train harbor, eval rl) ---
#
# tinker-cookbook 0.5.7's ``recipes/harbor_rl/harbor_env.py`` imports
# ``tinker_cookbook.sandbox.modal_sandbox`` at module top, which raises ImportError without the
# ``modal`` package, even when a sandbox factory of one's own is passed. ``import_harbor_env``
# puts a stand-in module there when ``modal`` is not installed (its ``ModalSandbox`` says what
# to install when used), so the recipe imports with only rlcli's Docker sandbox.
# ``HarborEnvGroupBuilder.make_envs`` builds each env's reward as
# ``HarborReward(tests_dir=..., sandbox=..., grader_timeout=...)``, a name it looks up in
# ``harbor_env``'s globals: ``install_harbor_hooks`` points that name at rlcli's ``Verifier``
# (same arguments; a broken verifier is reward 0 and a logged error, not a warning). It also
# makes the renderers it builds (``harbor_env.get_renderer(name, tokenizer)``) share their
# tokenizer safely: the cached tokenizer is one object for every rollout, and the Rust
# tokenizer raised ``RuntimeError: Already borrowed`` when two threads used it at once; each
# call goes through one lock. tests/test_compat.py checks these seams.


class _LockedTokenizer:
    """A tokenizer whose methods run one at a time (one ``RLock`` for all threads)."""

    def __init__(self, tokenizer, lock) -> None:
        object.__setattr__(self, "_tokenizer", tokenizer)
        object.__setattr__(self, "_lock", lock)

    def __getattr__(self, name: str):
        value = getattr(self._tokenizer, name)
        if not callable(value):
            return value
        lock = self._lock

        def locked(*args, **kwargs):
            with lock:
                return value(*args, **kwargs)

        return locked

    def __call__(self, *args, **kwargs):
        with self._lock:
            return self._tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._tokenizer)


def import_harbor_env():
    """``tinker_cookbook.recipes.harbor_rl.harbor_env``, importable without ``modal``."""
    import importlib.util
    import sys
    import types

    name = "tinker_cookbook.sandbox.modal_sandbox"
    if importlib.util.find_spec("modal") is None and name not in sys.modules:
        stand_in = types.ModuleType(name)

        class ModalSandbox:
            """Stand-in: the ``modal`` package is not installed."""

            @classmethod
            async def create(cls, *args, **kwargs):
                raise RuntimeError(
                    "--sandbox modal needs the modal package: pip install 'rlcli[modal]'"
                )

        stand_in.ModalSandbox = ModalSandbox  # type: ignore[attr-defined]
        sys.modules[name] = stand_in
    from tinker_cookbook.recipes.harbor_rl import harbor_env

    return harbor_env


def install_harbor_hooks() -> None:
    """In the recipe child of ``train harbor`` and in ``eval rl`` on Harbor tasks: rlcli's
    verifier as the recipe's reward, and renderers whose shared tokenizer is safe across
    threads (see above). Installing twice changes nothing."""
    import threading

    from rlcli.harbor.verifier import Verifier

    harbor_env = import_harbor_env()
    harbor_env.HarborReward = Verifier
    original = harbor_env.get_renderer
    if getattr(original, "rlcli_locked", False):
        return
    locks: dict[int, threading.RLock] = {}

    def get_renderer(name, tokenizer, *args, **kwargs):
        if not isinstance(tokenizer, _LockedTokenizer):
            lock = locks.setdefault(id(tokenizer), threading.RLock())
            tokenizer = _LockedTokenizer(tokenizer, lock)
        return original(name, tokenizer, *args, **kwargs)

    get_renderer.rlcli_locked = True  # type: ignore[attr-defined]
    harbor_env.get_renderer = get_renderer


# ---- SkyRL 0.4.0 as the server (serve start --backend jax|fsdp|megatron) ---------------------
#
# What the pinned client meets on SkyRL's Tinker server, adapted here (docs/skyrl.md):
# - ``compute_logprobs`` answers one value fewer than tokens (none for the first token):
#   ``align_prompt_logprobs`` above pads the front with None (train opsd's teachers).
# - Sampling seeds are int32 on the jax backend: a seed of 2**31 or more is a 400
#   ("Python integer ... out of bounds for int32"). ``bounded_seed`` keeps derived seeds below.
# - Each training client holds a LoRA slot (``max_lora_adapters``, 32 by default) until its
#   session times out (300 s without a heartbeat), not when the client's process ends: a few
#   runs in a row fill the slots. ``release_adapters_at_exit`` unloads, when the recipe's process
#   exits, every training client it created (``/api/v1/unload_model``, which both servers serve).
# - SkyRL 0.4.0 speaks the 0.25 protocol: its ``asample`` futures carry no
#   ``sample_sequence_ids``, which the 0.38 client asserts. ``accept_unnumbered_samples`` gives
#   such a response ids made here (unique in the process), as 0.25 clients never had any.
# tests/test_compat.py and tests/test_skyrl_jax.py check these.


def accept_unnumbered_samples() -> None:
    """Let the 0.38 client take a sample response without sequence ids (a server of the 0.25
    protocol: SkyRL): ids are made up client-side, one per sequence. Responses that carry ids
    (rlcli's server) are untouched. Installing twice changes nothing."""
    import itertools

    from tinker.lib.public_interfaces import sampling_client

    original = sampling_client._attach_sequence_ids
    if getattr(original, "rlcli_numbered", False):
        return
    counter = itertools.count()

    def _attach_sequence_ids(response, sample_sequence_ids):
        if sample_sequence_ids is None:
            request = next(counter)
            sample_sequence_ids = [f"local-{os.getpid()}-{request}:{i}"
                                   for i in range(len(response.sequences))]  # fmt: skip
        return original(response, sample_sequence_ids)

    _attach_sequence_ids.rlcli_numbered = True  # type: ignore[attr-defined]
    sampling_client._attach_sequence_ids = _attach_sequence_ids


SKYRL_MAX_SEED = 2**31 - 1


def bounded_seed(value: int) -> int:
    """A sampling seed every server takes (SkyRL's jax sampler: int32)."""
    return value & SKYRL_MAX_SEED


def release_adapters_at_exit() -> list[tuple[str, str]]:
    """Record every training client this process makes (``TrainingClient(holder, model_seq_id,
    model_id)``, however it was created); unload them all at exit. Returns the live list of
    (base_url, model_id) to unload. Installing twice changes nothing."""
    import atexit
    import os

    import tinker

    original = tinker.TrainingClient.__init__
    if getattr(original, "rlcli_created", None) is not None:
        return original.rlcli_created
    created: list[tuple[str, str]] = []

    def __init__(self, holder, *args, **kwargs):
        original(self, holder, *args, **kwargs)
        kwargs_of = getattr(holder, "_constructor_kwargs", None) or {}
        base_url = kwargs_of.get("base_url") or os.environ.get("TINKER_BASE_URL") or ""
        if base_url and self.model_id:
            created.append((str(base_url), str(self.model_id)))

    __init__.rlcli_created = created  # type: ignore[attr-defined]
    tinker.TrainingClient.__init__ = __init__
    atexit.register(unload_adapters, created)
    return created


def unload_adapters(created: list[tuple[str, str]]) -> None:
    """Free each training client's adapter on its server (best effort: a server that is gone
    has freed it already)."""
    import contextlib

    import httpx

    from rlcli import endpoint

    while created:
        base_url, model_id = created.pop()
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(
                f"{base_url.rstrip('/')}/api/v1/unload_model",
                json={"model_id": model_id},
                headers=endpoint.headers(),
                timeout=10,
            )
