"""Validated chat rows (``data/chat.py``: OpenAI's format) as the cookbook's renderers take them.

The cookbook's ``Message`` carries tool calls as its pydantic ``ToolCall``, not OpenAI's dicts,
and renders a message's ``tool_calls`` whenever the key is there (``None`` included: a
``datasets`` table fills keys a row lacks with ``None``, so the cookbook's own
``FromConversationFileBuilder`` fails on a file where one message has calls and another not).
A row's ``tools`` become the renderer's own tool prefix (``create_conversation_prefix_with_tools``,
the system message the model was served with), merged with the row's system message.
``ChatFileBuilder`` is that builder over rows validated by ``read_conversations`` (the same
checks as the dry run), in the cookbook's order: the same shuffle and split.
"""

from __future__ import annotations

import json

import chz
import datasets
from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.renderers.base import Message, Renderer, ToolCall
from tinker_cookbook.supervised.data import (
    FromConversationFileBuilder,
    SupervisedDatasetFromHFDataset,
    conversation_to_datum,
)

from rlcli.data.chat import read_conversations
from rlcli.errors import RlcliError


@chz.chz
class ChatFileBuilder(FromConversationFileBuilder):
    """``FromConversationFileBuilder`` whose rows keep their own keys (one JSON string a row,
    not a table that gives every message every key) and become ``to_cookbook``'s messages."""

    def __call__(self):
        with open(self.file_path, encoding="utf-8") as f:
            rows = read_conversations(f, self.file_path)
        table = datasets.Dataset.from_dict({"row": [json.dumps(r) for r in rows]})
        if self.shuffle_seed is not None:
            table = table.shuffle(seed=self.shuffle_seed)
        train, test = table, None
        if self.test_size > 0 and len(table) > self.test_size:
            train, test = table.skip(self.test_size), table.take(self.test_size)
        renderer, config = self.renderer, self.common_config
        train_on = TrainOnWhat(config.train_on_what or TrainOnWhat.ALL_ASSISTANT_MESSAGES)

        def datum(row: dict):
            messages = to_cookbook(json.loads(row["row"]), renderer)
            return conversation_to_datum(messages, renderer, config.max_length, train_on)

        batches = SupervisedDatasetFromHFDataset(train, config.batch_size, map_fn=datum)
        held_out = test and SupervisedDatasetFromHFDataset(test, len(test), map_fn=datum)
        return batches, held_out


def to_cookbook(conversation: dict, renderer: Renderer) -> list[Message]:
    """``conversation`` (``{"messages", "tools"?}``, validated) as the renderer's messages."""
    messages: list[Message] = []
    for m in conversation["messages"]:
        message: Message = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("tool_calls"):
            message["tool_calls"] = [ToolCall.model_validate(c) for c in m["tool_calls"]]
        if m.get("tool_call_id"):
            message["tool_call_id"] = m["tool_call_id"]
        messages.append(message)
    tools = conversation.get("tools")
    if not tools:
        return messages
    system = ""
    if messages and messages[0]["role"] == "system":
        system, messages = str(messages[0]["content"]), messages[1:]
    try:
        prefix = renderer.create_conversation_prefix_with_tools(tools, system_prompt=system)
    except NotImplementedError:
        raise RlcliError(
            f"renderer {type(renderer).__name__} cannot write the tools a conversation offers; "
            "pass --renderer chat_template (the model's own template) or a renderer with tools"
        ) from None
    return [*prefix, *messages]
