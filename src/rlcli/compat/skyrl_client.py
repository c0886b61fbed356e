"""What the pinned 0.38 client meets on SkyRL 0.4.0's Tinker server, adapted client-side
(docs/skyrl.md): int32 seeds, adapters unloaded at exit, sample ids made up locally."""

from __future__ import annotations

import contextlib
import os

from tinker.proto import tinker_public_pb2 as public_pb  # noqa: F401  (generated schema)

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

    import httpx

    from rlcli.client import endpoint

    while created:
        base_url, model_id = created.pop()
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(
                f"{base_url.rstrip('/')}/api/v1/unload_model",
                json={"model_id": model_id},
                headers=endpoint.headers(),
                timeout=10,
            )
