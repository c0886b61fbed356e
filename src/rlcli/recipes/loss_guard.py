"""Fail fast when the server cannot compute the chosen loss, before any rollout is sampled.

Our torch server lists its losses in ``get_server_capabilities``; SkyRL's lists only models, so
there a one-datum ``forward`` with the loss is the probe (SkyRL answers 400/422 for losses its
backend lacks). ``--backend`` names the backend outright and is checked against what each one
is known to serve.
"""

from __future__ import annotations

from rlcli import endpoint
from rlcli.errors import RlcliError

CHOICES = ("importance_sampling", "ppo", "cispo", "dro", "gspo", "dppo", "ppo_critic")
BACKEND_LOSSES = {
    "torch": ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"),
    # SkyRL 0.4.0: jax serves four; fsdp/megatron add gspo, dppo, ppo_critic; none serve dro.
    "jax": ("cross_entropy", "importance_sampling", "ppo", "cispo"),
    "fsdp": ("cross_entropy", "importance_sampling", "ppo", "cispo", "gspo", "dppo", "ppo_critic"),
    "megatron": (
        "cross_entropy",
        "importance_sampling",
        "ppo",
        "cispo",
        "gspo",
        "dppo",
        "ppo_critic",
    ),  # fmt: skip
}


def refuse(backend: str, loss: str, served) -> RlcliError:
    return RlcliError(
        f"the {backend} backend cannot compute loss {loss!r}; it serves: {', '.join(served)}"
    )


def check_backend_hint(backend: str | None, loss: str) -> None:
    """The part of the guard that needs no server (also run by --dry-run)."""
    if backend is None:
        return
    if backend not in BACKEND_LOSSES:
        raise RlcliError(f"--backend {backend}: choose from {', '.join(BACKEND_LOSSES)}")
    if loss not in BACKEND_LOSSES[backend]:
        raise refuse(backend, loss, BACKEND_LOSSES[backend])


def check_server(
    base_url: str, loss: str, backend: str | None, model: str, loss_config: dict | None = None
) -> str:
    """Returns the backend name; raises ``RlcliError`` if the server cannot serve ``loss``, or
    (where the server lists each loss's ``loss_fn_config`` keys) does not know a config key."""
    check_backend_hint(backend, loss)
    base_url = base_url.rstrip("/")
    body = endpoint.get_json(base_url, "/api/v1/get_server_capabilities")  # one line on failure
    served = body.get("supported_loss_fns")
    if served is not None:  # an rlcli torch server says what it computes
        name = body.get("backend", backend or "torch")
        if loss not in served:
            raise refuse(name, loss, served)
        known = (body.get("loss_fn_config") or {}).get(loss)
        if loss_config and isinstance(known, dict):
            for key in loss_config:
                if key not in known:
                    keys = ", ".join(known) or "none"
                    raise RlcliError(
                        f"--loss-config: loss {loss!r} has no setting {key!r} on the server "
                        f"at {base_url}; it accepts: {keys}"
                    )
        return name
    _probe(base_url, loss, backend or "unknown", model)
    return backend or "unknown"


def probe_forward(base_url: str, model: str, loss: str, config: dict | None = None) -> None:
    """A one-datum ``forward`` with ``loss`` (and its config) on a throwaway rank-1 client:
    cheap, and refused (the SDK's 400/422 error, raised) by a server that lacks the loss or
    rejects the config. The probe's adapter is freed at once, not at its session's timeout."""
    import contextlib

    import httpx
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=base_url, api_key=endpoint.api_key())
    try:
        trainer = service.create_lora_training_client(base_model=model, rank=1)
    except tinker.APIError as e:
        raise RlcliError(
            f"the server at {base_url} refused a training client for {model} "
            f"({type(e).__name__}: {_first_line(e)})"
        ) from None
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={
            "target_tokens": [2, 3],
            "logprobs": [-1.0, -1.0],
            "advantages": [1.0, 1.0],
        },
    )
    try:
        trainer.forward([datum], loss, config).result()  # type: ignore[arg-type]
    finally:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(
                f"{base_url.rstrip('/')}/api/v1/unload_model",
                json={"model_id": trainer.model_id},
                headers=endpoint.headers(),
                timeout=10,
            )


def _probe(base_url: str, loss: str, backend: str, model: str) -> None:
    """Does the server compute ``loss``? (For servers whose capabilities do not say.)"""
    import tinker

    try:
        probe_forward(base_url, model, loss)
    except (tinker.BadRequestError, tinker.UnprocessableEntityError) as e:
        known = BACKEND_LOSSES.get(backend)
        served = ", ".join(known) if known else "see the server's documentation"
        raise RlcliError(
            f"the server at {base_url} ({backend} backend) refused loss {loss!r} "
            f"({e.status_code}); losses it serves: {served}"
        ) from None
    except tinker.APIError as e:
        raise RlcliError(
            f"the loss probe at {base_url} failed ({type(e).__name__}: {_first_line(e)})"
        ) from None


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]
