"""Fixtures of the deployment specs: the helm binary, in a scratch home."""

import pytest

from .helpers import Helm, require


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    path = require("helm", "bash tests/run.sh installs helm v3 into .tools/bin")
    return Helm(path, tmp_path_factory.mktemp("helm"))
