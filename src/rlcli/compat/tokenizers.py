"""The cookbook's ``get_tokenizer`` for a local model folder, through its public registry
(``tokenizer_utils.register_tokenizer``): the same tokenizer ``AutoTokenizer`` gives, loaded
without importing ``AutoTokenizer`` (``rlcli.models.tokenizer.load_tokenizer``). Every recipe
child and the server's HTTP process ask the cookbook for a tokenizer once; ``AutoTokenizer``'s
module costs ~2 CPU s of imports each time. A hub id or a folder with another tokenizer class
or custom code is left to the cookbook."""

from __future__ import annotations

import functools

from rlcli.models.tokenizer import load_tokenizer, plain_tokenizer_folder


def register(*names: str | None) -> None:
    """Make ``get_tokenizer(name)`` load each plain local folder directly (once per process)."""
    from tinker_cookbook import tokenizer_utils

    for name in names:
        if (
            name
            and plain_tokenizer_folder(name)
            and not tokenizer_utils.is_tokenizer_registered(name)
        ):
            tokenizer_utils.register_tokenizer(
                name, functools.cache(lambda n=name: load_tokenizer(n))
            )
