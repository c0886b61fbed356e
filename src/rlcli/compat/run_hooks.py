"""The cookbook recipes patched in a recipe's child process (only there): exact SL resume,
LoRA seeds, progress reports, learning-rate warmup, cancel at a step boundary with a
checkpoint, ``--lora-alpha``, the DPO reference on resume. Each seam is described above its
hook and checked by ``tests/test_compat.py``."""

from __future__ import annotations

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


def install_grad_accum(requests: int) -> None:
    """``train sl --grad-accum N`` in its child: the cookbook's supervised loop sends a step's
    batch as one ``forward_backward_async`` and then ``optim_step``; this sends it as ``N``
    ``forward_backward`` requests instead (in order, each a slice of the batch), whose
    gradients the server sums before the one optim_step, and hands the loop their results
    combined as the SDK combines its own chunks (``combine_fwd_bwd_output_results``). Every
    Tinker loss is a sum over tokens, so the update is the whole batch's."""
    if requests <= 1:
        return
    import tinker
    from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results

    class Accumulated:  # the part of an APIFuture the loop awaits
        def __init__(self, futures) -> None:
            self.futures = futures

        async def result_async(self, timeout: float | None = None):
            results = [await f.result_async(timeout) for f in self.futures]
            return combine_fwd_bwd_output_results(results)

        def result(self, timeout: float | None = None):
            return combine_fwd_bwd_output_results([f.result(timeout) for f in self.futures])

    async def forward_backward_async(self, data, loss_fn, loss_fn_config=None):
        size = max(1, -(-len(data) // requests))
        return Accumulated(
            [
                self.forward_backward(data[i : i + size], loss_fn, loss_fn_config)
                for i in range(0, len(data), size)
            ]
        )

    tinker.TrainingClient.forward_backward_async = forward_backward_async


def install_packing(max_tokens: int | None) -> None:
    """``train sl --pack`` in its child: every ``forward_backward`` request goes out with its
    datums packed into sequences of up to ``max_tokens`` (``compat/packing.py``), and its
    result comes back unpacked, so the loop (and ``--grad-accum``'s split, which sends
    through this) sees the datums it sent."""
    if not max_tokens:
        return
    import tinker

    from rlcli.compat import packing

    plain = tinker.TrainingClient.forward_backward

    class Unpacked:  # the part of an APIFuture the loop awaits
        def __init__(self, future, groups, lengths) -> None:
            self.future, self.groups, self.lengths = future, groups, lengths

        async def result_async(self, timeout: float | None = None):
            return packing.unpack(
                await self.future.result_async(timeout), self.groups, self.lengths
            )

        def result(self, timeout: float | None = None):
            return packing.unpack(self.future.result(timeout), self.groups, self.lengths)

    def forward_backward(self, data, loss_fn, loss_fn_config=None):
        packed = packing.pack(data, max_tokens)
        if packed is None:
            return plain(self, data, loss_fn, loss_fn_config)
        lengths = [d.model_input.length for d in data]
        return Unpacked(plain(self, packed[0], loss_fn, loss_fn_config), packed[1], lengths)

    tinker.TrainingClient.forward_backward = forward_backward


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

    _say_when_finished(rl_train, report)

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

    _say_when_finished(train_on_policy, report)


def _say_when_finished(module, report) -> None:
    """``module.main`` (an async recipe loop) reports ``recipe finished`` however it ends."""
    original = module.main

    async def main(*args, **kwargs):
        try:
            return await original(*args, **kwargs)
        finally:
            report("recipe finished")

    module.main = main


def _saved_as(log_path, name: str) -> dict[str, str] | None:
    """The paths of the run's last checkpoint if it is already called ``name``, else None."""
    from tinker_cookbook import checkpoint_utils

    records = checkpoint_utils.load_checkpoints_file(str(log_path))
    if not records or records[-1].name != name:
        return None
    last = records[-1]
    return {k: last.get(k) for k in ("state_path", "sampler_path") if last.has(k)}


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


def send_lora_config(alpha: float | None, switches: dict[str, bool] | None = None) -> None:
    """Every LoRA training client this (child) process creates asks for ``alpha`` (``train
    --lora-alpha``) and the layer switches (``--lora-targets``: ``train_attn``, ``train_mlp``,
    ``train_unembed``). The alpha goes in the request's ``user_metadata``, the one free-form
    field of the 0.38 client's create request (its ``LoraConfig`` has no alpha), which rlcli's
    server reads (``server.schemas.LORA_ALPHA_METADATA``); the switches are the create call's
    own keywords. The recipes pass base model and rank only, ``user_metadata`` by keyword;
    a restored client keeps its checkpoint's."""
    if alpha is None and not switches:
        return
    import tinker

    from rlcli.server.http.tinker.schemas import LORA_ALPHA_METADATA  # lazy: imports pydantic

    for name in ("create_lora_training_client", "create_lora_training_client_async"):
        original = getattr(tinker.ServiceClient, name)

        def create(self, *args, _original=original, **kwargs):
            if alpha is not None and len(args) < 7:  # (base_model, rank, seed, mlp, attn,
                metadata = dict(kwargs.get("user_metadata") or {})  # unembed, user_metadata)
                kwargs["user_metadata"] = {**metadata, LORA_ALPHA_METADATA: repr(float(alpha))}
            if switches and len(args) < 4:
                kwargs.update(switches)
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
