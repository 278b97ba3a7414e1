"""The budgets a servicer gets when built without settings are the server's defaults."""

import pytest

from fairlimit.grpc_api.guards import Budgets, server_options
from fairlimit.settings import Settings, SettingsError

pytestmark = pytest.mark.unit


def test_budgets_default_to_the_settings_defaults() -> None:
    """Budgets() (the servicer's default, used by tests and embedders) and Settings() (the
    flags' defaults) name the same numbers: a default changed in one is changed in both."""
    budgets, settings = Budgets(), Settings()
    assert (budgets.rls, budgets.rlqs, budgets.per_connection) == (
        settings.grpc_max_concurrent,
        settings.rlqs_max_streams,
        settings.grpc_max_streams_per_connection,
    )
    assert budgets.read_timeout == settings.grpc_read_timeout
    assert budgets.max_receive == settings.grpc_max_receive_bytes


def test_no_stream_limit_per_connection_is_sent_unless_set() -> None:
    """By default grpc gets no max_concurrent_streams (its 0 would refuse every stream, and
    any limit resets the streams a fresh connection opens past it); one set is passed on."""
    assert "grpc.max_concurrent_streams" not in dict(server_options(Budgets()))
    assert dict(server_options(Budgets(per_connection=16)))["grpc.max_concurrent_streams"] == 16


def test_the_stream_limit_flag_takes_0_and_refuses_what_is_not_a_count() -> None:
    """0 (the default) is no limit; a negative or non-numeric value names the flag."""
    assert (
        Settings()
        .override({"grpc_max_streams_per_connection": "0"})
        .grpc_max_streams_per_connection
        == 0
    )
    with pytest.raises(SettingsError, match="expected a whole number, got '-1'"):
        Settings().override({"grpc_max_streams_per_connection": "-1"})
