"""The cookbook's ``recipes/harbor_rl`` with rlcli's sandbox and verifier (``train harbor``,
``eval rl`` on Harbor tasks): importable without ``modal``, thread-safe shared tokenizers."""

from __future__ import annotations

from tinker.proto import tinker_public_pb2 as public_pb  # noqa: F401  (generated schema)

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
