"""The README and the docs site: short, self-contained, built by MkDocs, commands that work."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from envoy_proxy import envoy_in_front, http_get
from helpers import skip_or_fail
from servers import fairlimit_server

from .helpers import ROOT

pytestmark = pytest.mark.process

README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
MARKDOWN = [README, ROOT / "CHANGELOG.md", *PAGES]
# Links outside the repository may only go to public upstream documentation.
UPSTREAM_DOCS = (
    "https://keepachangelog.com/",
    "https://semver.org/",
    "https://www.envoyproxy.io/docs/",
    "https://istio.io/latest/docs/",
    "https://kubernetes.io/docs/",
    "https://helm.sh/docs/",
    "https://prometheus.io/docs/",
    "https://grafana.com/docs/",
    "https://opentelemetry.io/docs/",
)
LOCAL = re.compile(r"https?://(127\.0\.0\.1|localhost|\$INGRESS_HOST|[\w.-]*example\.com)")
QUICKSTART = ROOT / "examples" / "envoy" / "descriptors" / "quickstart.yaml"


def external_links(text: str) -> list[str]:
    return [u for u in re.findall(r"https?://[^\s)`'\"<>]+", text) if not LOCAL.match(u)]


class TestReadme:
    def test_opens_with_the_two_commands(self) -> None:
        """The first code block is the install-and-run command and the test command."""
        block = re.search(r"```sh\n(.*?)```", README.read_text(), re.S)
        assert block is not None
        lines = [line.split("  #")[0].strip() for line in block.group(1).splitlines()]
        assert lines == [
            "python3 -m venv .venv && .venv/bin/pip install . && .venv/bin/fairlimit serve",
            "bash tests/run.sh",
        ]
        assert (ROOT / ".ci" / "run").read_text().rstrip().endswith("exec bash tests/run.sh")

    def test_names_python_the_admin_port_and_how_to_see_it_is_up(self) -> None:
        """The prerequisite is pyproject's; the addresses are the settings' defaults; a
        real server's /readyz answers what the README says it prints."""
        from fairlimit.settings import Settings

        text = " ".join(README.read_text().split())
        wanted = re.search(
            r'requires-python = ">=(\d+\.\d+)"', (ROOT / "pyproject.toml").read_text()
        )
        assert wanted is not None and f"Python {wanted.group(1)} or later" in text
        defaults = Settings()
        assert f"gRPC on `{defaults.grpc_addr}`" in text
        assert f"admin HTTP port on `{defaults.admin_addr}`" in text
        assert f"`curl -fs http://{defaults.admin_addr}/readyz` prints `ready`" in text
        with fairlimit_server() as server:
            status, _, body = http_get(f"http://127.0.0.1:{server.admin_port}/readyz")
        assert (status, body) == (200, b"ready\n")

    def test_is_short_and_points_at_the_docs(self) -> None:
        """Under 100 lines; every docs page is linked from it."""
        text = README.read_text()
        assert len(text.splitlines()) < 100
        for page in PAGES:
            if page.name != "index.md":
                assert f"(docs/{page.name})" in text, page.name

    def test_quick_start_waits_for_readiness(self) -> None:
        """The quick start polls /readyz and Envoy's /ready before the first request."""
        for path in (README, DOCS / "getting-started.md"):
            text = path.read_text()
            assert text.index("/readyz") < text.index("/ready >") < text.index("x-client-id")
            assert "examples/envoy/descriptors/quickstart.yaml" in text


class TestSelfContained:
    @pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.name)
    def test_links_stay_in_the_repository_or_go_to_upstream_docs(self, path: Path) -> None:
        """No link leaves the repository except to public upstream documentation."""
        outside = [u for u in external_links(path.read_text()) if not u.startswith(UPSTREAM_DOCS)]
        assert outside == []

    @pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.name)
    def test_relative_links_and_paths_exist(self, path: Path) -> None:
        """Every relative link and every repository path named in the text exists."""
        text = path.read_text()
        links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
        targets = [path.parent / link for link in links if "://" not in link]
        named = re.findall(
            r"(?<![\w/.])((?:examples|helm|descriptors|docs|tests)/[\w./-]*\w)", text
        )
        missing = [str(t) for t in targets if not t.exists()]
        missing += [p for p in named if not (ROOT / p).exists()]
        assert missing == []


class TestSite:
    def test_nav_lists_every_page(self) -> None:
        """mkdocs.yml's nav has every docs/*.md page, and no other."""
        config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
        nav = {next(iter(item.values())) for item in config["nav"]}
        assert nav == {page.name for page in PAGES}

    def test_mkdocs_build_strict(self, tmp_path: Path) -> None:
        """`mkdocs build --strict` builds the site: no broken link, anchor or missing page."""
        try:
            import mkdocs  # noqa: F401  (installed by the test extra)
        except ImportError:
            skip_or_fail("mkdocs is not installed (the test extra installs it)")
        result = subprocess.run(
            [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
            cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        assert (tmp_path / "site" / "getting-started" / "index.html").exists()


class TestQuickStartRuns:
    def test_ten_200s_then_429s_through_envoy(self, tmp_path: Path) -> None:
        """The quick start's config behind the Envoy example: alice gets 10, then 429."""
        config = yaml.safe_load(QUICKSTART.read_text())
        assert config["descriptors"][0]["descriptors"][0]["rate_limit"] == {
            "unit": "minute",
            "requests_per_unit": 10,
        }
        for _ in range(3):  # a minute boundary mid-test spoils an attempt
            with (
                fairlimit_server("--config", str(QUICKSTART)) as server,
                envoy_in_front(server.grpc_port, tmp_path) as envoy,
            ):
                answers = [http_get(envoy.url, {"x-client-id": "alice"}) for _ in range(12)]
            resets = [int(h.get("x-ratelimit-reset", "0")) for _, h, _ in answers]
            if resets != sorted(resets, reverse=True):
                continue
            assert [code for code, _, _ in answers] == [200] * 10 + [429] * 2
            return
        raise AssertionError("three attempts straddled minute boundaries")
