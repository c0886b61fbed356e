"""The pinned client versions (``tinker`` 0.38, ``tinker-cookbook`` 0.5.8) and what the pinned
client insists on. A leaf: the server may import it (nothing here patches anything).

rlcli itself runs on ``tinker`` 0.38 and drives ``tinker-cookbook==0.5.8`` (the server speaks
to every SDK generation from 0.25 on: ``server/http/tinker/generations.py``). Whatever on the
client side would break on a pin bump is named in ``rlcli.compat``, and ``tests/test_compat.py``
checks each assumption against the installed packages, so a bump fails loudly in one place.
"""

from __future__ import annotations

from tinker.proto import tinker_public_pb2 as public_pb  # noqa: F401  (generated schema)

TINKER_VERSION = "0.38.0"
TINKER_COOKBOOK_VERSION = "0.5.8"

# Losses the 0.38 client's ``LossFnType`` names (0.25's lacked gspo, stable_reinforce and
# custom). Other names (``dppo``) are sent as-is by the client; nothing checks them client-side.
CLIENT_LOSS_NAMES = (
    "cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce",
    "custom",
)  # fmt: skip

# The API key prefix the client insists on before it sends anything.
API_KEY_PREFIX = "tml-"
DEFAULT_API_KEY = "tml-dummy"
