"""Which cookbook renderer a model is trained and sampled with (``resolve_renderer``): the
cookbook's recommendation or the tokenizer's chat template, checked token for token against the
template (``renderers.compare``). Patches nothing; the server's OpenAI endpoint uses it too."""

from __future__ import annotations

import contextlib
from pathlib import Path

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
    from rlcli.compat import renderers, tokenizers  # lazy: imports torch, the cookbook, tinker

    renderers.register()
    tokenizers.register(model)
    if not Path(model).expanduser().exists():  # a hub id: a lookup that may be slow
        for check in list(_BEFORE_HUB_LOOKUP):
            check()
    from rlcli.models import hub

    # None: a hub id without network and not in the cache (found out in seconds, no retries);
    # the recipe will say so if it needs it
    tokenizer = hub.tokenizer(model)
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
    from rlcli.compat import renderers  # lazy: imports torch, the cookbook, tinker

    if tokenizer is None:
        return "; not compared with the chat template (no tokenizer here)"
    if not getattr(tokenizer, "chat_template", None):
        return "; the tokenizer has no chat template to compare with"
    difference = renderers.compare(name, tokenizer)
    if difference is None:
        return "; matches the model's chat template exactly"
    return f"; differs from the model's chat template: {difference}"


def for_tool_data(name: str, why: str, tokenizer, conversation: dict) -> tuple[str, str]:
    """The renderer for data with tool calls or tools, chosen (not asked for) as ``name``:
    ``name`` if it writes ``conversation`` (the data's first such row) as the chat template
    does, else the template itself: the server renders tool conversations with the template
    (``apply_chat_template(tools=...)``), and a model is trained on what it will be served."""
    from tinker_cookbook import renderers as cookbook

    from rlcli.compat import renderers
    from rlcli.compat.chat_messages import to_cookbook

    if name == renderers.NAME or not getattr(tokenizer, "chat_template", None):
        return name, why

    def written(renderer_name: str):
        try:
            renderer = cookbook.get_renderer(renderer_name, tokenizer)
            return renderer.build_supervised_example(to_cookbook(conversation, renderer))[0]
        except Exception:  # noqa: BLE001 - a renderer that cannot write tools: no tokens
            return None

    theirs, ours = written(renderers.NAME), written(name)
    if theirs is None:  # the template itself cannot: keep the choice (the recipe will say why)
        return name, why
    if ours is not None and ours.to_ints() == theirs.to_ints()[: ours.length]:
        return name, why
    return renderers.NAME, f"the model's own chat template, exactly: {name} writes tools otherwise"
