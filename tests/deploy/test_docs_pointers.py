"""Pointers between the docs land where the facts are, and the exit codes they list are the
ones the commands return (the migration guide sent readers to a README that had neither;
issue 37)."""

import re
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

from servers import ROOT, run_cli

pytestmark = pytest.mark.process

DOCS = ROOT / "docs"
GUIDE = DOCS / "migrating-from-envoy-ratelimit.md"
FIXTURES = ROOT / "tests" / "fixtures"


def anchors(page: Path) -> set[str]:
    """The heading ids MkDocs gives ``page`` (its default toc slugify)."""
    headings = re.findall(r"^#{1,6} (.+)$", page.read_text(), re.M)
    return {slugify(h.strip(), "-") for h in headings}


def exit_codes() -> dict[str, dict[int, str]]:
    """configuration.md's exit code table: command -> {code: what it means} ("-": none)."""
    text = (DOCS / "configuration.md").read_text()
    table = text[text.index("### Exit codes") :].split("\n\n")[1]
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    return {row[0].strip("| `"): {0: row[1], 1: row[2], 2: row[3]} for row in rows}


class TestMigrationGuidePointers:
    def test_no_pointer_to_the_readme(self) -> None:
        """The README has neither exit codes nor metric naming."""
        assert "README" not in GUIDE.read_text()

    def test_each_anchor_it_links_exists(self) -> None:
        links = re.findall(r"\]\(([\w-]+\.md)#([^)]+)\)", GUIDE.read_text())
        assert ("configuration.md", "exit-codes") in links
        assert ("operations.md", "where-the-telemetry-goes") in links
        for page, anchor in links:
            assert anchor in anchors(DOCS / page), f"{page}#{anchor}"

    def test_the_linked_section_names_the_metrics(self) -> None:
        text = (DOCS / "operations.md").read_text()
        goes = text[text.index("## Where the telemetry goes") :]
        assert "Prometheus sees dots as underscores" in goes.split("\n## ")[0]


IDS = ["check-ok", "check-broken", "check-strict", "check-yaml", "check-missing",
       "serve-settings", "simulate-missing", "top-unreachable"]  # fmt: skip


class TestExitCodesAsDocumented:
    @pytest.mark.parametrize(
        ("args", "code"),
        [
            (("check", str(ROOT / "descriptors")), 0),
            (("check", str(FIXTURES / "config" / "misspelled_key.yaml")), 1),
            (("check", "--strict", str(FIXTURES / "validation" / "contended.yaml")), 1),
            (("check", str(FIXTURES / "config" / "invalid_yaml.yaml")), 2),
            (("check", "/nonexistent/edge.yaml"), 2),
            (
                (
                    "serve",
                    "--backend",
                    "foo://",
                    "--grpc-addr",
                    "127.0.0.1:0",
                    "--admin-addr",
                    "127.0.0.1:0",
                ),
                2,
            ),
            (("simulate", "/nonexistent/scenario.yaml"), 2),
            (("top", "--once", "--admin-addr", "127.0.0.1:1"), 2),
        ],
        ids=IDS,
    )
    def test_a_run_ends_with_a_code_the_table_gives(self, args: tuple[str, ...], code: int) -> None:
        table = exit_codes()
        assert set(table) == {"fairlimit check", "fairlimit serve", "fairlimit simulate",
                              "fairlimit top"}  # fmt: skip
        assert run_cli(*args).returncode == code
        assert table[f"fairlimit {args[0]}"][code].strip() != "-"
