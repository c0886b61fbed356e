"""Every assumption rlcli makes about the pinned tinker / tinker-cookbook, checked against the
installed packages: a pin bump that breaks one fails here first, with the reason."""

from __future__ import annotations

import typing
from importlib.metadata import version

from rlcli import compat


def test_pins_are_the_installed_versions():
    assert version("tinker") == compat.TINKER_VERSION
    assert version("tinker-cookbook") == compat.TINKER_COOKBOOK_VERSION


def test_client_config_flags_exist_in_the_clients_schema():
    from tinker.types import ClientConfigResponse

    fields = ClientConfigResponse.model_fields
    for key in compat.CLIENT_CONFIG:
        assert key in fields, f"the client no longer has the flag {key!r}"


def test_loss_names_the_client_types_know():
    from tinker.types import LossFnType

    assert set(typing.get_args(LossFnType)) == set(compat.CLIENT_LOSS_NAMES)


def test_protobuf_schema_has_the_fields_the_server_uses():
    pb = compat.public_pb
    request = pb.ForwardBackwardRequest.DESCRIPTOR.fields_by_name
    assert {"model_id", "seq_id", "data", "loss_fn", "loss_fn_config", "forward_only"} <= set(
        request
    )
    output = pb.ForwardBackwardOutput.DESCRIPTOR.fields_by_name
    assert {"loss_fn_output_type", "loss_fn_outputs", "metrics"} <= set(output)
    assert {"data", "offsets", "dtype", "trailing_shape"} <= set(
        pb.BatchedTensor.DESCRIPTOR.fields_by_name
    )


def test_the_client_asks_for_protobuf_results_of_forward_backward():
    from tinker.proto.response_conv import PROTO_SUPPORTED_TYPES
    from tinker.types import ForwardBackwardOutput

    assert ForwardBackwardOutput in PROTO_SUPPORTED_TYPES


def test_api_key_prefix_is_what_the_client_enforces():
    import pytest
    from tinker.lib._auth_token_provider import ApiKeyAuthProvider

    assert compat.DEFAULT_API_KEY.startswith(compat.API_KEY_PREFIX)
    with pytest.raises(Exception, match="tml-"):
        ApiKeyAuthProvider(api_key="sk-not-tinker")
