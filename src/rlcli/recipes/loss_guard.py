"""Fail fast when the server cannot compute the chosen loss, before any rollout is sampled.

Our torch server lists its losses in ``get_server_capabilities``; SkyRL's lists only models, so
there a one-datum ``forward`` with the loss is the probe (SkyRL answers 400/422 for losses its
backend lacks). ``--backend`` names the backend outright and is checked against what each one
is known to serve.
"""

from __future__ import annotations

from rlcli.client import endpoint
from rlcli.errors import RlcliError
from rlcli.home import rlcli_home
from rlcli.launch import process
from rlcli.recipes.options import BACKEND_LOSSES

SKYRL_BACKENDS = ("jax", "fsdp", "megatron")
CLIP_KEYS = ("clip_low_threshold", "clip_high_threshold")


def skyrl_differences(backend: str | None, loss: str, config: dict | None) -> list[str]:
    """Where SkyRL 0.4.0's loss differs from Tinker's definition (which the torch backend
    follows), for this loss and config; measured side by side on the same datums
    (docs/skyrl.md has the table)."""
    if backend not in SKYRL_BACKENDS:
        return []
    config = config or {}
    clips_set = any(key in config for key in CLIP_KEYS)
    found = []
    if backend == "jax":
        found.append(
            "the loss is averaged over datums, each divided by its weight count (Tinker sums)"
        )
    if loss == "cispo" and not clips_set:
        found.append(
            "cispo's default clip is 0.8/1.2 (Tinker: 0/4)"
            if backend == "jax"
            else "cispo's clip is 0/5 (Tinker: 0/4)"
        )
    if loss == "cispo" and clips_set and backend != "jax":
        found.append("explicit cispo clip thresholds are refused")
    if loss == "gspo":
        found.append(
            "gspo averages the sequence ratio over every weighted position (prompt included) and "
            "ignores sequence_ratio_mask"
        )
        if not clips_set:
            found.append("gspo's default clip is 0.8/1.2 (Tinker: 0.9997/1.0004)")
    return found


def skyrl_note(backend: str | None, loss: str, config: dict | None) -> str | None:
    """The one line ``train rl`` / ``train harbor`` print against a SkyRL backend."""
    found = skyrl_differences(backend, loss, config)
    if not found:
        return None
    return f"note: SkyRL {backend} differs from Tinker's {loss} loss: " + "; ".join(found)


def managed_backend(base_url: str) -> str | None:
    """The backend of the server ``rlcli serve start`` runs here, if ``base_url`` is it."""
    record, _ = process.live_record(rlcli_home())
    if record is None or record.base_url.rstrip("/") != base_url.rstrip("/"):
        return None
    return record.backend


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
    backend = backend or managed_backend(base_url)  # our own SkyRL server says which it is
    check_backend_hint(backend, loss)
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
        trainer = service.create_lora_training_client(base_model=model, rank=1).result()
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

    def refused(detail: str) -> RlcliError:
        known = BACKEND_LOSSES.get(backend)
        served = ", ".join(known) if known else "see the server's documentation"
        return RlcliError(
            f"the server at {base_url} ({backend} backend) refused loss {loss!r} "
            f"({detail}); losses it serves: {served}"
        )

    try:
        probe_forward(base_url, model, loss)
    except (tinker.BadRequestError, tinker.UnprocessableEntityError) as e:
        raise refused(str(e.status_code)) from None
    except ValueError as e:  # the SDK's error once retrieving the result got a 400/422
        if "Error code: 400" not in str(e) and "Error code: 422" not in str(e):
            raise
        raise refused(_first_line(e)) from None
    except tinker.APIError as e:
        raise RlcliError(
            f"the loss probe at {base_url} failed ({type(e).__name__}: {_first_line(e)})"
        ) from None


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]
