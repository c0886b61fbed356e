"""Everything that depends on the pinned ``tinker`` / ``tinker-cookbook`` versions.

rlcli speaks the wire protocol of ``tinker==0.25.0`` and drives ``tinker-cookbook==0.5.7``.
Whatever would break on a pin bump is named here, and ``tests/test_compat.py`` checks each
assumption against the installed packages, so a bump fails loudly in one place.
"""

from __future__ import annotations

from tinker.proto import tinker_public_pb2 as public_pb  # noqa: F401  (generated schema)

TINKER_VERSION = "0.25.0"
TINKER_COOKBOOK_VERSION = "0.5.7"

# Losses the 0.25.0 client's ``LossFnType`` names. Other names (``gspo``) are sent as-is by the
# client; nothing checks them client-side.
CLIENT_LOSS_NAMES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")

# Feature flags the server answers to ``/api/v1/client/config``. The defaults of the 0.25.0
# client assume Thinking Machines' hosted service; these turn off what a local server lacks.
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,  # plain X-API-Key, no JWT exchange
    "use_pyqwest_transport": False,  # httpx; pyqwest is not a dependency of tinker
    "proto_compress_fwdbwd": False,  # loopback: compression only costs CPU
    "parallel_fwdbwd_chunks": True,
    "create_model_via_load_weights": False,
    "sample_no_retries": False,
}

# The API key prefix the client insists on before it sends anything.
API_KEY_PREFIX = "tml-"
DEFAULT_API_KEY = "tml-dummy"


def installed_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("tinker", "tinker-cookbook", "torch", "transformers", "peft"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "missing"
    return out
