"""The test command's installs are pinned: every package pyproject names has a pin, and
tests/run.sh reads the pins unless told to take the newest releases."""

import re
import tomllib

import pytest

from servers import ROOT

pytestmark = [pytest.mark.unit, pytest.mark.app]

CONSTRAINTS = ROOT / "tests" / "constraints.txt"
RUN = ROOT / "tests" / "run.sh"


def _name(requirement: str) -> str:
    """The normalised project name of a PEP 508 requirement ("redis[hiredis]>=5" -> "redis")."""
    bare = re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", bare).lower()


def pins() -> dict[str, str]:
    found: dict[str, str] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version, f"tests/constraints.txt: {line!r} is not NAME==VERSION"
            found[_name(name)] = version
    return found


class TestPins:
    def test_every_package_the_test_command_installs_is_pinned(self) -> None:
        """The runtime dependencies and the test and plot extras each have an exact pin."""
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        extras = project["optional-dependencies"]
        named = {_name(r) for r in [*project["dependencies"], *extras["test"], *extras["plot"]]}
        missing = sorted(named - pins().keys())
        assert not missing, f"not in tests/constraints.txt (bash tests/refresh-pins.sh): {missing}"

    def test_run_sh_installs_with_the_pins_and_latest_without(self) -> None:
        """The pinned install reads constraints.txt; FAIRLIMIT_LATEST=1 upgrades instead."""
        text = RUN.read_text()
        assert "PIP_PINS=(-c tests/constraints.txt)" in text
        assert re.search(r'FAIRLIMIT_LATEST:-}" = 1 \]; then\n\s+BUF_VERSION=latest', text)
        assert re.search(r"^BUF_VERSION=\d+\.\d+\.\d+ ", text, re.M)
        assert re.search(r"^HELM_LAYER_VERSION=\d+\.\d+\.\d+ ", text, re.M)
        assert '"${PIP_PINS[@]}" -e' in text

    def test_xds_protos_is_pinned_and_kept_out_of_site_packages(self) -> None:
        """xds-protos overwrites opentelemetry-proto's files (issue 41): not an extra; run.sh
        installs it, pinned, into the venv's own xds-protos/ directory; refresh-pins pins it."""
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        named = {_name(r) for extra in extras["optional-dependencies"].values() for r in extra}
        assert "xds-protos" not in named
        assert "xds-protos" in pins()
        text = RUN.read_text()
        assert 'XDS_PROTOS="$VIRTUAL_ENV/xds-protos"' in text
        assert re.search(
            r'--no-deps --upgrade \\\n\s+--target "\$XDS_PROTOS" "\$\{PIP_PINS\[@\]\}" xds-protos',
            text,
        )
        refresh = (ROOT / "tests" / "refresh-pins.sh").read_text()
        assert "'.[test,plot]' xds-protos" in refresh
