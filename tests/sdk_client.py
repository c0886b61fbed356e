"""One tinker client journey, runnable under any SDK generation (0.25 or 0.38), as a user's
script would run it: ``python tests/sdk_client.py BASE_URL MODEL OUT.json [--cookbook]``.

``tests/test_generations.py`` runs it with the 0.25 SDK (a venv of its own) and with the
installed one, against one server, at once. It writes what it saw as JSON for the test to
check; it asserts nothing itself beyond what the SDK asserts.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import tinker
from tinker import types


def ready(value):
    """0.38 returns futures of clients where 0.25 returned clients."""
    return value.result() if type(value).__name__.startswith("Backcompat") else value


def journey(base_url: str, model: str) -> dict:
    out: dict = {"tinker": tinker.__version__}
    service = tinker.ServiceClient(base_url=base_url, api_key="tml-dummy")
    trainer = ready(service.create_lora_training_client(base_model=model, rank=8, seed=0))
    tokens = list(range(5, 25))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    out["losses"] = []
    for _ in range(4):
        result = trainer.forward_backward([datum], "cross_entropy").result()
        out["losses"].append(result.metrics["loss:sum"])
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    rl_datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [-2.0] * (len(tokens) - 1),
            "advantages": [0.5] * (len(tokens) - 1),
        },
    )
    out["is_metrics"] = trainer.forward_backward([rl_datum], "importance_sampling").result().metrics
    sampler = ready(trainer.save_weights_and_get_sampling_client())
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    response = sampler.sample(types.ModelInput.from_ints(tokens[:5]), 3, params).result()
    out["samples"] = [list(s.tokens) for s in response.sequences]
    out["sequence_ids"] = [getattr(s, "sequence_id", None) for s in response.sequences]
    out["prompt_logprobs"] = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    state = trainer.save_state("journey").result().path
    out["state_path"] = state
    restored = ready(service.create_training_client_from_state_with_optimizer(state))
    out["restored_model_id"] = restored.model_id
    original = trainer.forward([datum], "cross_entropy").result()
    again = restored.forward([datum], "cross_entropy").result()
    out["restore_max_diff"] = max(
        abs(a - b)
        for a, b in zip(
            original.loss_fn_outputs[0]["logprobs"].tolist(),
            again.loss_fn_outputs[0]["logprobs"].tolist(),
            strict=True,
        )
    )
    out["sampler_path"] = trainer.save_weights_for_sampler("journey-named").result().path
    if hasattr(tinker, "RestClient") and tinker.__version__ >= "0.3":
        rest = tinker.RestClient(base_url=base_url, api_key="tml-dummy")
    else:
        rest = service.create_rest_client()
    listed = rest.list_checkpoints(trainer.model_id).result()
    out["checkpoint_types"] = sorted({c.checkpoint_type for c in listed.checkpoints})
    out["model_id"] = trainer.model_id
    if hasattr(service, "close"):  # 0.38: the session ends here (heartbeats stop)
        ready(service.close("success"))
        out["closed"] = True
    return out


def cookbook_loops(base_url: str, model: str, folder: Path) -> dict:
    """The cookbook's own supervised and RL training loops, offline, a few steps each."""
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl import train as rl_train
    from tinker_cookbook.supervised import train as sl_train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    folder.mkdir(parents=True, exist_ok=True)
    chats = folder / "chats.jsonl"
    with chats.open("w") as f:
        for i in range(8):
            messages = [
                {"role": "user", "content": f"Say {i}"},
                {"role": "assistant", "content": f"{i} {i} {i}"},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=model, renderer_name="qwen3_instruct", max_length=256,
        batch_size=4,
    )  # fmt: skip
    sl_config = sl_train.Config(
        log_path=str(folder / "sl"), model_name=model, base_url=base_url, lora_rank=8,
        recipe_name="rlcli_generations",
        learning_rate=1e-3, num_epochs=1, save_every=0, eval_every=0,
        dataset_builder=FromConversationFileBuilder(file_path=str(chats), common_config=common),
    )  # fmt: skip
    asyncio.run(sl_train.main(sl_config))
    rl_config = rl_train.Config(
        learning_rate=1e-3, model_name=model, max_tokens=6, log_path=str(folder / "rl"),
        recipe_name="rlcli_generations",
        base_url=base_url, lora_rank=8, save_every=0, eval_every=0, num_groups_to_log=0,
        loss_fn="importance_sampling",
        dataset_builder=ArithmeticDatasetBuilder(
            batch_size=2, model_name_for_tokenizer=model, renderer_name="qwen3_instruct",
            n_batches=2, group_size=2,
        ),
    )  # fmt: skip
    asyncio.run(rl_train.main(rl_config))

    def rows(name: str) -> list[dict]:
        return [json.loads(line) for line in (folder / name / "metrics.jsonl").open()]

    return {"sl_steps": len(rows("sl")), "rl_steps": len(rows("rl"))}


if __name__ == "__main__":
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    os.environ.setdefault("TINKER_API_KEY", "tml-dummy")  # the cookbook loops read it
    base_url, model, out_path = sys.argv[1:4]
    result = journey(base_url, model)
    if "--cookbook" in sys.argv:
        result |= cookbook_loops(base_url, model, Path(out_path).parent / "cookbook")
    Path(out_path).write_text(json.dumps(result))
