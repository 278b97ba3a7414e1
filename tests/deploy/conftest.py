"""Fixtures of the deployment specs: the helm binary (in a scratch home) and envoy."""

import pytest

from envoy_proxy import envoy_binary

from .helpers import Helm, require


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    path = require("helm", "bash tests/run.sh installs helm v3 into .tools/bin")
    return Helm(path, tmp_path_factory.mktemp("helm"))


@pytest.fixture(scope="module")
def envoy() -> str:
    """The envoy binary; a skip where it is missing, a failure in CI."""
    return envoy_binary()
