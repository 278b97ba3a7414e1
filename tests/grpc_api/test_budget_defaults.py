"""The call budgets come from the settings, whose defaults are the only ones."""

import dataclasses

import pytest

from fairlimit.grpc_api.guards import Budgets, server_options
from fairlimit.settings import Settings, SettingsError

pytestmark = pytest.mark.unit


def test_budgets_have_no_defaults_of_their_own() -> None:
    """The call budgets' defaults are written once, in Settings: every Budgets field a flag
    sets has no default (only ``other``, which no flag sets, has one), so the servicer's
    default budgets are Budgets.of(Settings()) and cannot drift from the flags'."""
    defaulted = {
        f.name for f in dataclasses.fields(Budgets) if f.default is not dataclasses.MISSING
    }
    assert defaulted == {"other"}
    with pytest.raises(TypeError):
        Budgets()  # type: ignore[call-arg]  # what the test is about: no defaults


def test_budgets_are_the_settings_values() -> None:
    """Budgets.of takes each budget from its own setting (each set to a distinct value)."""
    settings = Settings().override({
        "grpc_max_concurrent": "3", "rlqs_max_streams": "5",
        "grpc_max_streams_per_connection": "7", "grpc_read_timeout": "0.25",
        "grpc_max_receive_bytes": "1000",
    })  # fmt: skip
    budgets = Budgets.of(settings)
    assert (budgets.rls, budgets.rlqs, budgets.per_connection) == (3, 5, 7)
    assert (budgets.read_timeout, budgets.max_receive) == (0.25, 1000)
    assert Budgets.of(Settings()) == Budgets(32, 64, 0, 1.0, 256 * 1024)


def test_no_stream_limit_per_connection_is_sent_unless_set() -> None:
    """By default grpc gets no max_concurrent_streams (its 0 would refuse every stream, and
    any limit resets the streams a fresh connection opens past it); one set is passed on."""
    defaults = Budgets.of(Settings())
    assert "grpc.max_concurrent_streams" not in dict(server_options(defaults))
    limited = dataclasses.replace(defaults, per_connection=16)
    assert dict(server_options(limited))["grpc.max_concurrent_streams"] == 16


def test_grpc_cancels_no_call_waiting_to_be_taken_up_below_its_hard_limit() -> None:
    """grpc's default cancels new calls at random from 1,000 waiting for the server to take
    them up (tests/e2e/test_e2e_fresh_envoy.py's 2,000 at once lost 9-124): the soft
    limit is the hard one, so none is cancelled below it."""
    options = dict(server_options(Budgets.of(Settings())))
    soft = options["grpc.server.max_pending_requests"]
    assert soft == options["grpc.server.max_pending_requests_hard_limit"] >= 3000


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
