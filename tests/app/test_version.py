"""One version: the package, both CLI spellings, the installed metadata and the chart agree."""

import os
import re
import subprocess
import sys

import pytest
import yaml

from fairlimit import __version__
from servers import ROOT

pytestmark = pytest.mark.process


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "server")}
    return subprocess.run(
        [sys.executable, "-m", "fairlimit", *args],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


class TestVersion:
    def test_version_flag_and_command_print_the_package_version(self) -> None:
        """`fairlimit --version` and `fairlimit version` both print `fairlimit <__version__>`."""
        flag, command = cli("--version"), cli("version")
        assert (flag.returncode, command.returncode) == (0, 0), flag.stderr + command.stderr
        assert flag.stdout == command.stdout == f"fairlimit {__version__}\n"

    def test_version_is_semantic(self) -> None:
        """__version__ is MAJOR.MINOR.PATCH (an optional pre-release suffix)."""
        assert re.fullmatch(r"\d+\.\d+\.\d+(?:[-.]?[a-z0-9.]+)?", __version__)

    def test_pyproject_reads_the_package_version(self) -> None:
        """pyproject declares the version dynamic, read from fairlimit.__version__."""
        text = (ROOT / "pyproject.toml").read_text()
        assert 'dynamic = ["version"]' in text
        assert 'version = {attr = "fairlimit.__version__"}' in text

    def test_chart_app_version_follows(self) -> None:
        """helm/fairlimit's appVersion is the package version."""
        chart = yaml.safe_load((ROOT / "helm" / "fairlimit" / "Chart.yaml").read_text())
        assert chart["appVersion"] == __version__

    def test_changelog_has_a_section_for_the_version(self) -> None:
        """CHANGELOG.md keeps an Unreleased section and one for the current version."""
        headings = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
        assert "Unreleased" in headings
        assert any(h.startswith(f"{__version__} - ") for h in headings), headings

    def test_license_is_apache_2(self) -> None:
        """LICENSE holds the Apache License 2.0 the metadata declares."""
        text = (ROOT / "LICENSE").read_text()
        assert "Apache License" in text and "Version 2.0, January 2004" in text
        assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()
