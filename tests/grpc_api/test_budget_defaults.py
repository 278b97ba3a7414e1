"""The budgets a servicer gets when built without settings are the server's defaults."""

import pytest

from fairlimit.grpc_api.guards import Budgets
from fairlimit.settings import Settings

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
