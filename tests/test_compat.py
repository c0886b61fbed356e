"""Every assumption rlcli makes about the pinned tinker / tinker-cookbook, checked against the
installed packages: a pin bump that breaks one fails here first, with the reason."""

from __future__ import annotations

import json
import typing
from importlib.metadata import version

from rlcli.compat import harbor_hooks, pins, renderer_choice, skyrl_client


def test_pins_are_the_installed_versions():
    assert version("tinker") == pins.TINKER_VERSION
    assert version("tinker-cookbook") == pins.TINKER_COOKBOOK_VERSION


def test_client_config_flags_exist_in_the_clients_schema():
    from tinker.types import ClientConfigResponse

    from rlcli.server.http.tinker import generations

    fields = ClientConfigResponse.model_fields
    for key in generations.CLIENT_CONFIG:
        if key not in generations.LEGACY_FLAGS:
            assert key in fields, f"the client no longer has the flag {key!r}"
    for name, field in fields.items():  # a new feature gate defaults to off, or is set here
        if name.startswith(("sample_use", "custom_loss", "sample_join")):
            assert field.default is False or name in generations.CLIENT_CONFIG, name


def test_loss_names_the_client_types_know():
    from tinker.types import LossFnType

    assert set(typing.get_args(LossFnType)) == set(pins.CLIENT_LOSS_NAMES)


def test_protobuf_schema_has_the_fields_the_server_uses():
    pb = pins.public_pb
    request = pb.ForwardBackwardRequest.DESCRIPTOR.fields_by_name
    assert {"model_id", "seq_id", "data", "loss_fn", "loss_fn_config", "forward_only"} <= set(
        request
    )
    output = pb.ForwardBackwardOutput.DESCRIPTOR.fields_by_name
    assert {"loss_fn_output_type", "loss_fn_outputs", "metrics"} <= set(output)
    assert {"data", "offsets", "dtype", "trailing_shape"} <= set(
        pb.BatchedTensor.DESCRIPTOR.fields_by_name
    )


def test_the_client_asks_for_protobuf_results_of_forward_backward():
    from tinker.proto.response_conv import PROTO_SUPPORTED_TYPES
    from tinker.types import ForwardBackwardOutput

    assert ForwardBackwardOutput in PROTO_SUPPORTED_TYPES


def test_api_key_prefix_is_what_the_client_enforces():
    import pytest
    from tinker.lib._auth_token_provider import ApiKeyAuthProvider

    assert pins.DEFAULT_API_KEY.startswith(pins.API_KEY_PREFIX)
    with pytest.raises(Exception, match="tml-"):
        ApiKeyAuthProvider(api_key="sk-not-tinker")


def test_renderer_fallback_for_models_outside_the_cookbook_tables(tmp_path, monkeypatch):
    import huggingface_hub.constants

    from rlcli.models.tiny import build_tiny_model

    name, why, tokenizer = renderer_choice.resolve_renderer(str(build_tiny_model(tmp_path)), None)
    assert name == "qwen3_instruct" and tokenizer is not None
    assert why == "ChatML chat template; matches the model's chat template exactly"
    # A hub id whose tokenizer cannot be had: offline at once, not after the hub client's
    # retries without a network (~50 s), nor a download where there is one.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    name, why, _ = renderer_choice.resolve_renderer("Qwen/Qwen3-8B", None)
    assert name.startswith("qwen3") and why.startswith("recommended for the model")


def test_the_distillation_recipe_scores_through_the_seam_train_opsd_replaces():
    """distill.score_teachers_with swaps the teacher clients that ``prepare_minibatch`` hands
    to the module-level ``incorporate_kl_penalty``, which only calls
    ``compute_logprobs_async`` on them and reads one value per token from position 1."""
    import inspect

    from tinker_cookbook.distillation import datasets, train_on_policy
    from tinker_cookbook.rl.problem_env import ProblemGroupBuilder

    params = list(inspect.signature(train_on_policy.incorporate_kl_penalty).parameters)
    assert params[:2] == ["data_D", "teacher_clients_D"]
    assert "incorporate_kl_penalty(" in inspect.getsource(train_on_policy.prepare_minibatch)
    scoring = inspect.getsource(train_on_policy.incorporate_kl_penalty)
    assert "teacher_client.compute_logprobs_async(sequence_input)" in scoring
    assert "teacher_logprobs[1:]" in scoring
    assert {"prompt", "renderer", "convo_prefix"} <= set(
        inspect.signature(datasets.PromptOnlyEnv).parameters
    )
    assert {"env_thunk", "num_envs", "dataset_name"} <= set(
        inspect.signature(ProblemGroupBuilder).parameters
    )
    assert "teacher_config.load_checkpoint_path" in inspect.getsource(train_on_policy.main)
    # the run hooks' per-step rollout count: one get_batch per step, rollouts through the
    # module-level group rollout
    loop = inspect.getsource(train_on_policy.do_sync_training)
    assert "dataset.get_batch(i_batch)" in loop
    assert "do_group_rollout_and_filter_constant_reward(" in loop


def test_the_cancel_hook_seams_are_where_runs_cancel_expects_them():
    """``run_hooks.install_cancel_hook``: each loop ends a step with ``log_metrics`` on the
    MultiplexLogger, SL hands its loop state to ``maybe_save_async`` first, and the manager
    saves "both" under ``f"{step:06d}"`` and appends the row to checkpoints.jsonl."""
    import inspect

    from tinker_cookbook import checkpoint_utils
    from tinker_cookbook.distillation import train_on_policy
    from tinker_cookbook.rl import train as rl_train
    from tinker_cookbook.supervised import train as sl_train
    from tinker_cookbook.utils import ml_log

    assert "MultiplexLogger(loggers)" in inspect.getsource(ml_log.setup_logging)
    sl = inspect.getsource(sl_train.main)
    assert "ml_logger.log_metrics(metrics=submitted.metrics, step=submitted.step)" in sl
    assert sl.index("checkpoint_mgr.maybe_save_async(") < sl.index("ml_logger.log_metrics(")
    assert '"batch": submitted.batch_idx' in sl and '"epoch": submitted.epoch_idx' in sl
    assert 'metrics["progress"] = min((submitted.step + 1) / progress_denominator, 1.0)' in sl
    for loop in (rl_train.do_sync_training, train_on_policy.do_sync_training):
        source = inspect.getsource(loop)
        assert "ml_logger.log_metrics(metrics, step=i_batch)" in source
        assert "for i_batch in range(start_batch, end_batch)" in source
        assert '"progress/done_frac": (i_batch + 1) / num_batches' in source
    assert "training_func = do_sync_training" in inspect.getsource(rl_train.main)
    assert "resume_info.batch" in inspect.getsource(rl_train.main)
    manager = checkpoint_utils.CheckpointManager
    assert list(inspect.signature(manager.save_periodic_async).parameters) == [
        "self",
        "step",
        "loop_state",
    ]
    periodic = inspect.getsource(manager.save_periodic_async)
    assert 'name=f"{step:06d}"' in periodic and 'kind="both"' in periodic
    assert inspect.iscoroutinefunction(manager.finalize_async)
    assert "checkpoints.jsonl" in inspect.getsource(checkpoint_utils.save_checkpoint_async)


def test_the_harbor_recipe_imports_without_modal_and_has_the_seams_train_harbor_uses():
    import dataclasses
    import inspect
    from pathlib import Path

    from tinker_cookbook.recipes.harbor_rl import harbor_tools
    from tinker_cookbook.sandbox import SandboxInterface, SandboxResult

    from rlcli.harbor import tasks
    from rlcli.harbor.docker import DockerSandbox

    harbor_env = harbor_hooks.import_harbor_env()  # modal is not a dependency of rlcli
    # make_envs builds each env's reward and renderer by these global names (harbor_hooks.py).
    source = inspect.getsource(harbor_env.HarborEnvGroupBuilder.make_envs)
    assert "HarborReward(" in source and "get_renderer(renderer_name, tokenizer)" in source
    assert "self.sandbox_factory(env_dir, self.sandbox_timeout)" in source
    reward_fields = {f.name for f in dataclasses.fields(harbor_tools.HarborReward)}
    assert reward_fields == {"tests_dir", "sandbox", "grader_timeout"}  # what Verifier takes
    builder_fields = set(inspect.signature(harbor_env.HarborDatasetBuilder).parameters)
    assert {
        "tasks", "batch_size", "group_size", "model_name", "renderer_name", "max_turns",
        "sandbox_timeout", "command_timeout", "grader_timeout", "max_trajectory_tokens",
        "max_generation_tokens", "sandbox_factory",
    } <= builder_fields  # fmt: skip
    assert {"task_name", "instruction", "task_dir", "config"} <= {
        f.name for f in dataclasses.fields(harbor_env.HarborTask)
    }
    # rlcli's Docker sandbox is a SandboxInterface, and results are the cookbook's.
    task = tasks.load_task(Path(__file__).resolve().parents[1] / "examples/harbor-tasks/write-file")
    assert isinstance(DockerSandbox("c0ffee", task, {}), SandboxInterface)
    assert {"stdout", "stderr", "exit_code"} <= set(inspect.signature(SandboxResult).parameters)
    bash = inspect.getsource(harbor_tools.HarborBashTool)
    assert "timeout=self._command_timeout" in bash and "max_output_bytes=" in bash


def test_harbor_hooks_put_rlcli_verifier_in_and_share_the_tokenizer_safely(monkeypatch, tiny_model):
    import threading

    from tinker_cookbook.tokenizer_utils import get_tokenizer

    from rlcli.harbor.verifier import Verifier

    harbor_env = harbor_hooks.import_harbor_env()
    monkeypatch.setattr(harbor_env, "HarborReward", harbor_env.HarborReward)  # restored after
    monkeypatch.setattr(harbor_env, "get_renderer", harbor_env.get_renderer)
    harbor_hooks.install_harbor_hooks()
    assert harbor_env.HarborReward is Verifier
    installed = harbor_env.get_renderer
    harbor_hooks.install_harbor_hooks()  # again (each `eval rl` on Harbor tasks installs them)
    assert harbor_env.get_renderer is installed
    tokenizer = get_tokenizer(str(tiny_model))
    renderer = harbor_env.get_renderer("qwen3_instruct", tokenizer)
    assert isinstance(renderer.tokenizer, harbor_hooks._LockedTokenizer)
    messages = [{"role": "user", "content": "count the rows of /app/scores.csv " * 20}]
    expected = renderer.build_generation_prompt(messages).to_ints()
    assert expected and tokenizer.decode(expected).endswith("assistant\n")
    errors, results = [], []

    def render() -> None:
        try:
            for _ in range(30):
                results.append(renderer.build_generation_prompt(messages).to_ints())
        except Exception as e:  # "RuntimeError: Already borrowed" without the lock
            errors.append(e)

    threads = [threading.Thread(target=render) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(results) == 240 and all(r == expected for r in results)


def test_samples_without_sequence_ids_get_made_up_ones():
    """A 0.25-protocol server (SkyRL 0.4.0) answers no ``sample_sequence_ids``; the 0.38 client
    asserts them in ``sampling_client._attach_sequence_ids(response, ids)``."""
    import inspect

    from tinker import types
    from tinker.lib.public_interfaces import sampling_client

    skyrl_client.accept_unnumbered_samples()
    skyrl_client.accept_unnumbered_samples()  # twice changes nothing
    params = list(inspect.signature(sampling_client._attach_sequence_ids).parameters)
    assert params == ["response", "sample_sequence_ids"]
    import numpy as np

    seq = types.SampledSequence(
        stop_reason="length", sequence_id=None, tokens_np=np.array([1, 2], np.int32)
    )
    response = types.SampleResponse(sequences=[seq, seq])
    made = sampling_client._attach_sequence_ids(response, None)
    ids = [s.sequence_id for s in made.sequences]
    assert len(set(ids)) == 2 and None not in ids
    given = sampling_client._attach_sequence_ids(response, ["a:0", "a:1"])
    assert [s.sequence_id for s in given.sequences] == ["a:0", "a:1"]


def test_the_sl_loop_takes_its_learning_rate_from_the_name_warmup_replaces():
    import inspect

    from tinker_cookbook.supervised import train
    from tinker_cookbook.utils.lr_scheduling import compute_schedule_lr_multiplier

    from rlcli.compat.run_hooks import SL_LR_MULTIPLIER, warmup_multiplier

    assert f"{SL_LR_MULTIPLIER}(" in inspect.getsource(train.main)
    assert getattr(train, SL_LR_MULTIPLIER) is compute_schedule_lr_multiplier
    steps = [warmup_multiplier(compute_schedule_lr_multiplier, "linear", s, 6, 2) for s in range(6)]
    assert steps == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]


def test_the_sl_loop_sends_a_step_as_the_call_grad_accum_splits():
    """--grad-accum replaces TrainingClient.forward_backward_async (what the SL loop calls
    once a step, then optim_step) and merges with the SDK's own chunk combiner."""
    import inspect

    from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results
    from tinker_cookbook.supervised import train

    source = inspect.getsource(train.main)
    assert "training_client.forward_backward_async(data" in source
    assert source.index("forward_backward_async(data") < source.index("optim_step_async(")
    assert combine_fwd_bwd_output_results([]).loss_fn_outputs == []


def test_the_dpo_recipe_has_the_seams_train_dpo_hooks():
    import inspect

    from tinker_cookbook.preference import train_dpo

    main = inspect.getsource(train_dpo.main)
    assert "create_dpo_clients(" in main and "CheckpointManager(" in main
    assert not inspect.iscoroutinefunction(train_dpo.main)  # the hook wraps a plain function
    clients = inspect.getsource(train_dpo.create_dpo_clients)
    assert "save_weights_and_get_sampling_client()" in clients  # the reference it starts from
    assert "create_lora_training_client(" in clients  # the synchronous one: seeded by the hook
    update = inspect.getsource(train_dpo.do_update)
    assert '"epoch": epoch_idx, "batch": batch_idx' in update  # saved before the step
    assert update.index("forward_backward_custom") < update.index("log_metrics")


def test_a_plain_tokenizer_folder_loads_as_auto_tokenizer_would(tiny_model, tmp_path):
    """``load_tokenizer`` skips ``AutoTokenizer``'s imports only where it would pick the same
    class; the cookbook's registry (``compat.tokenizers``) then returns that tokenizer."""
    import shutil

    from tinker_cookbook import tokenizer_utils
    from transformers import AutoTokenizer

    from rlcli.compat import tokenizers
    from rlcli.models.tokenizer import load_tokenizer, plain_tokenizer_folder

    ours, theirs = load_tokenizer(str(tiny_model)), AutoTokenizer.from_pretrained(tiny_model)
    assert type(ours) is type(theirs)
    chat = [{"role": "user", "content": "Hi there, 2 + 2?"}]
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(
        chat, tokenize=False
    )
    assert ours.encode(" héllo  world\n") == theirs.encode(" héllo  world\n")
    assert ours.all_special_tokens == theirs.all_special_tokens
    tokenizers.register(str(tiny_model))
    assert type(tokenizer_utils.get_tokenizer(str(tiny_model))) is type(theirs)

    custom = tmp_path / "custom"
    shutil.copytree(tiny_model, custom)
    config = custom / "tokenizer_config.json"
    for change in ({"tokenizer_class": "Qwen2Tokenizer"}, {"auto_map": {"AutoTokenizer": "x.Y"}}):
        config.write_text(
            json.dumps({**json.loads((tiny_model / config.name).read_text()), **change})
        )
        assert not plain_tokenizer_folder(str(custom))  # left to AutoTokenizer
    assert not plain_tokenizer_folder("HuggingFaceTB/SmolLM2-135M-Instruct")
