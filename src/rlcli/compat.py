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


def resolve_renderer(model: str, requested: str | None):
    """(renderer name, why it was chosen, tokenizer or None).

    The cookbook's ``model_info`` knows hub names only; for local folders and other models
    it raises, so fall back on the tokenizer's chat template: ChatML (``<|im_start|>``) ->
    ``qwen3_instruct`` (no thinking tags), Llama 3 headers -> ``llama3``, else ``role_colon``.
    """
    tokenizer = None
    try:
        from tinker_cookbook import tokenizer_utils

        tokenizer = tokenizer_utils.get_tokenizer(model)
    except Exception:  # hub id without network: the recipe will say so if it needs it
        tokenizer = None
    if requested:
        return requested, "--renderer", tokenizer
    from tinker_cookbook import model_info

    try:
        name = model_info.get_recommended_renderer_name(model)
        return name, "recommended for the model", tokenizer
    except Exception:
        pass
    template = str(getattr(tokenizer, "chat_template", "") or "")
    if "<|im_start|>" in template:
        return "qwen3_instruct", "ChatML chat template", tokenizer
    if "<|start_header_id|>" in template:
        return "llama3", "Llama 3 chat template", tokenizer
    return "role_colon", "no known chat template", tokenizer


def gsm8k_dataset(rows: list[dict], batch_size: int, group_size: int, renderer, convo_prefix):
    """The cookbook's ``Gsm8kDataset`` over rows we supply (its constructor loads the hub).

    Relies on the attributes its methods read (``ds``, ``batch_size``, ``group_size``,
    ``renderer``, ``convo_prefix``); tests/test_compat.py checks they still suffice.
    """
    import datasets
    from tinker_cookbook.recipes.math_rl.math_env import Gsm8kDataset

    class _Gsm8kFromRows(Gsm8kDataset):
        def __init__(self) -> None:  # deliberately not calling super(): no hub download
            self.ds = datasets.Dataset.from_list(rows)
            self.batch_size, self.group_size = batch_size, group_size
            self.renderer, self.convo_prefix = renderer, convo_prefix

    return _Gsm8kFromRows()
