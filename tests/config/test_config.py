"""Loading descriptor YAML: every error as FILE: PATH: message, all or nothing."""

import locale
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from fairlimit.config.loader import assemble, load, parse_domain
from fairlimit.core.units import Unit
from fairlimit.core.validation import Mode
from fairlimit.errors import ConfigError, ConfigUnreadable, ConfigWarningError
from helpers import load_text

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parents[1] / "fixtures"
ALLOW = "a config without limits turns the limiter off; --allow-empty-config accepts it"


def _expected(path: Path) -> list[str]:
    lines = re.findall(r"^# expect: (.*)$", path.read_text(), re.MULTILINE)
    return [line.replace("{file}", str(path)) for line in lines]


@pytest.fixture
def ascii_locale() -> Iterator[None]:
    """The locale's encoding ASCII, as under a non-UTF-8 locale. Python in UTF-8 mode (PYTHONUTF8=1,
    or started under the C locale) ignores it, and a test using it cannot tell there."""
    before = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")
    try:
        yield
    finally:
        locale.setlocale(locale.LC_CTYPE, before)


class TestErrorFixtures:
    @pytest.mark.parametrize(
        "path", sorted((FIXTURES / "config").glob("*.yaml")), ids=lambda p: p.stem
    )
    def test_each_fixture_is_rejected_with_its_exact_message(self, path: Path) -> None:
        """Each broken file is rejected with exactly the lines it declares."""
        with pytest.raises(ConfigError) as caught:
            load([path])
        assert caught.value.problems == _expected(path)


class TestClassificationFixtures:
    @pytest.mark.parametrize(
        "path", sorted((FIXTURES / "validation").glob("*.yaml")), ids=lambda p: p.stem
    )
    def test_each_cap_is_classified_with_its_exact_message(self, path: Path) -> None:
        """Every cap and shared bucket gets the mode and message the fixture declares."""
        loaded = load([path])
        got = [f"{c.mode.value} {c.line}" for c in loaded.classifications]
        assert got == _expected(path)

    @pytest.mark.parametrize(
        "path", sorted((FIXTURES / "validation").glob("*.yaml")), ids=lambda p: p.stem
    )
    def test_strict_turns_exactly_the_warnings_into_errors(self, path: Path) -> None:
        """--strict rejects a file with warnings, listing them, and accepts a clean one."""
        warnings = [c.line for c in load([path]).classifications if c.is_warning]
        if not warnings:
            assert load([path], strict=True).config.domains
            return
        with pytest.raises(ConfigWarningError) as caught:
            load([path], strict=True)
        assert caught.value.problems == warnings


class TestLoading:
    def test_full_upstream_format_is_accepted(self, tmp_path: Path) -> None:
        """Every envoyproxy/ratelimit field loads with its meaning."""
        loaded = load_text(
            tmp_path,
            """
            domain: mongo_cps
            descriptors:
              - key: database
                value: users
                rate_limit: {unit: second, requests_per_unit: 500, name: users}
                shadow_mode: true
                detailed_metric: true
              - key: database
                value: "default*"
                rate_limit:
                  unit: WEEK
                  requests_per_unit: 3
                  replaces: [{name: users}]
              - key: message_type
                value: 42
                descriptors:
                  - key: to_number
                    rate_limit: {unit: year, requests_per_unit: 1}
              - key: health
                rate_limit: {unlimited: true}
            """,
        )
        rules = loaded.config.domains["mongo_cps"].rules
        assert rules[0].shadow_mode and rules[0].detailed_metric
        assert rules[0].rate_limit is not None and rules[0].rate_limit.name == "users"
        assert rules[1].is_wildcard and rules[1].rate_limit is not None
        assert rules[1].rate_limit.unit is Unit.WEEK and rules[1].rate_limit.replaces == ("users",)
        assert (
            rules[2].value == "42"
            and rules[2].children[0].path == "mongo_cps/message_type=42/to_number"
        )
        assert rules[3].rate_limit is not None and rules[3].rate_limit.unlimited

    def test_all_units_have_their_upstream_lengths(self) -> None:
        """Month is 30 days and year 365, as envoyproxy/ratelimit counts them."""
        assert [u.seconds for u in Unit] == [1, 60, 3600, 86400, 604800, 2592000, 31536000]

    def test_directory_loads_its_yaml_files_only(self, tmp_path: Path) -> None:
        """A directory contributes its *.yaml and *.yml files, not others or subfolders."""
        (tmp_path / "a.yaml").write_text("domain: a\ndescriptors: []\n")
        (tmp_path / "b.yml").write_text("domain: b\ndescriptors: []\n")
        (tmp_path / "notes.txt").write_text("not yaml: [")
        (tmp_path / "sub").mkdir()
        (tmp_path / "sub" / "c.yaml").write_text("domain: c\n")
        loaded = load([tmp_path], allow_empty=True)  # which files load, not what they limit
        assert sorted(loaded.config.domains) == ["a", "b"]

    def test_duplicate_domain_across_files_is_rejected(self, tmp_path: Path) -> None:
        """Two files may not define the same domain."""
        (tmp_path / "a.yaml").write_text("domain: x\ndescriptors: []\n")
        (tmp_path / "b.yaml").write_text("domain: x\ndescriptors: []\n")
        with pytest.raises(ConfigError) as caught:
            load([tmp_path])
        assert caught.value.problems == [
            f"{tmp_path / 'b.yaml'}: x: duplicate domain 'x' (first in {tmp_path / 'a.yaml'})"
        ]

    def test_one_bad_file_rejects_the_whole_set(self, tmp_path: Path) -> None:
        """Loading is all or nothing: a good file does not load beside a bad one."""
        (tmp_path / "good.yaml").write_text("domain: good\ndescriptors: []\n")
        (tmp_path / "bad.yaml").write_text("domain: bad\nextra: 1\n")
        with pytest.raises(ConfigError):
            load([tmp_path])

    def test_descriptor_files_are_utf8_whatever_the_locale(
        self, tmp_path: Path, ascii_locale: None
    ) -> None:
        """A value written in UTF-8 loads as written under an ASCII locale too."""
        path = tmp_path / "cafe.yaml"
        path.write_text(
            "domain: menu\ndescriptors:\n  - key: dish\n    value: café\n"
            "    rate_limit: {unit: second, requests_per_unit: 1}\n",
            encoding="utf-8",
        )
        (rule,) = load([path]).config.domains["menu"].rules
        assert rule.value == "café"

    def test_missing_path_is_unusable_input(self, tmp_path: Path) -> None:
        """A path that does not exist is reported as unreadable, not as a rule problem."""
        with pytest.raises(ConfigUnreadable) as caught:
            load([tmp_path / "nope.yaml"])
        assert caught.value.problems == [
            f"{tmp_path / 'nope.yaml'}: (file): no such file or directory"
        ]

    def test_fair_share_loads_weights_and_active_clients(self, tmp_path: Path) -> None:
        """fair_share keeps active_clients and per-client weights (default 1)."""
        loaded = load_text(
            tmp_path,
            """
            domain: edge
            descriptors:
              - key: route
                value: public
                rate_limit: {unit: second, requests_per_unit: 1000}
                fair_share: {active_clients: 10, weights: {batch-etl: 1, checkout: 3}}
                descriptors:
                  - key: client_id
                    rate_limit: {unit: second, requests_per_unit: 100}
            """,
        )
        fair = loaded.config.domains["edge"].rules[0].fair_share
        assert fair is not None and fair.active_clients == 10
        assert (fair.weight("checkout"), fair.weight("batch-etl"), fair.weight("other")) == (
            3,
            1,
            1,
        )
        assert [c.mode for c in loaded.classifications] == [Mode.PER_CLIENT_BUCKETS]

    def test_bundled_descriptors_load_strictly(self) -> None:
        """The descriptors fairlimit ships pass --strict."""
        loaded = load([Path(__file__).parents[2] / "descriptors"], strict=True)
        assert "edge" in loaded.config.domains

    def test_an_unlimited_limit_keeps_its_name_and_replaces(self, tmp_path: Path) -> None:
        """unlimited takes name and replaces as upstream does (admin /config shows them)."""
        loaded = load_text(
            tmp_path,
            """
            domain: edge
            descriptors:
              - key: health
                rate_limit: {unlimited: true, name: health, replaces: [{name: per_ip}]}
              - key: remote_address
                rate_limit: {unit: second, requests_per_unit: 10, name: per_ip}
            """,
        )
        limit = loaded.config.domains["edge"].rules[0].rate_limit
        assert limit is not None and limit.unlimited
        assert (limit.name, limit.replaces) == ("health", ("per_ip",))


class TestDotfiles:
    """upstream's RUNTIME_IGNOREDOTFILES: a directory's files named with a leading dot."""

    EDGE = (
        "domain: edge\ndescriptors:\n"
        "  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n"
    )

    def test_ignored_when_asked(self, tmp_path: Path) -> None:
        """A dotfile ending in .yaml (an editor's or a sync tool's) is left out, and so
        cannot stop the load."""
        (tmp_path / "edge.yaml").write_text(self.EDGE)
        (tmp_path / ".edge.yaml.swp.yaml").write_text("domain: [not, a, config\n")
        loaded = load([tmp_path], ignore_dotfiles=True)
        assert sorted(loaded.config.domains) == ["edge"]
        assert [f.name for f in loaded.files] == ["edge.yaml"]

    def test_read_by_default_as_upstream(self, tmp_path: Path) -> None:
        (tmp_path / "edge.yaml").write_text(self.EDGE)
        (tmp_path / ".other.yaml").write_text(self.EDGE.replace("edge", "other"))
        assert sorted(load([tmp_path]).config.domains) == ["edge", "other"]


class TestEmptyConfig:
    def test_a_directory_without_descriptor_files_is_refused_naming_it(
        self, tmp_path: Path
    ) -> None:
        """An emptied --config directory: one line naming it, and no second line for the
        limits it cannot have."""
        (tmp_path / "notes.txt").write_text("domain: x\n")
        with pytest.raises(ConfigError) as caught:
            load([tmp_path])
        assert caught.value.problems == [
            f"{tmp_path}: (directory): no descriptor files (*.yaml, *.yml): {ALLOW}"
        ]

    def test_files_without_a_limit_are_refused_naming_every_path(self, tmp_path: Path) -> None:
        """Domains with no rules or only unlimited ones limit nothing: one line naming all the
        paths given, comma-separated."""
        first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
        first.write_text("domain: a\ndescriptors: [{key: health, rate_limit: {unlimited: true}}]\n")
        second.write_text("domain: b\ndescriptors: []\n")
        with pytest.raises(ConfigError) as caught:
            load([first, second])
        assert caught.value.problems == [
            f"{first}, {second}: (config): no rate limit in any domain: {ALLOW}"
        ]


class TestAssemble:
    """assemble: the step xDS resources share with files, all or nothing."""

    def test_by_default_warnings_do_not_refuse(self) -> None:
        """Not strict unless asked: a contended cap loads with its warning."""
        path = FIXTURES / "validation" / "contended.yaml"
        loaded = assemble([parse_domain(path.read_text(), str(path))], [path])
        got = [f"{c.mode.value} {c.line}" for c in loaded.classifications if c.is_warning]
        assert got == _expected(path)

    def test_by_default_one_domain_twice_is_refused(self) -> None:
        """Not merged unless asked: a domain from two sources is an error naming both."""
        merge = FIXTURES / "upstream" / "merge"
        first, later = merge / "part_one.yaml", merge / "part_two.yaml"
        domains = [parse_domain(p.read_text(), str(p)) for p in (first, later)]
        with pytest.raises(ConfigError) as caught:
            assemble(domains, [first, later])
        assert caught.value.problems == [
            f"{later}: merged: duplicate domain 'merged' (first in {first})"
        ]


class TestUnreadableInput:
    """Unreadable input and rule problems are told apart (``check`` exits 2 and 1)."""

    def test_one_file_that_is_not_yaml_makes_the_whole_set_unreadable(self) -> None:
        """A file that is not YAML beside a rule problem: unreadable, every line kept in order."""
        broken, wrong = (
            FIXTURES / "config" / "invalid_yaml.yaml",
            FIXTURES / "config" / "unknown_root_key.yaml",
        )
        with pytest.raises(ConfigUnreadable) as caught:
            load([broken, wrong])
        assert caught.value.problems == _expected(broken) + _expected(wrong)

    def test_rule_problems_alone_are_not_unreadable(self) -> None:
        """A file that parses but breaks rules is a ConfigError, not unreadable input."""
        with pytest.raises(ConfigError) as caught:
            load([FIXTURES / "config" / "unknown_root_key.yaml"])
        assert not isinstance(caught.value, ConfigUnreadable)


class TestNumberRanges:
    """A number field's range includes both of its ends."""

    def test_ends_of_the_ranges_load_as_written(self, tmp_path: Path) -> None:
        """requests_per_unit 0 and 4294967295 (upstream's uint32), max_in_flight 1000000000."""
        loaded = load_text(
            tmp_path,
            """
            domain: edge
            descriptors:
              - key: closed
                rate_limit: {unit: second, requests_per_unit: 0}
              - key: open
                rate_limit: {unit: second, requests_per_unit: 4294967295}
              - key: slots
                concurrency: {max_in_flight: 1000000000}
            """,
        )
        closed, open_, slots = loaded.config.domains["edge"].rules
        assert closed.rate_limit is not None and open_.rate_limit is not None
        assert [closed.rate_limit.requests_per_unit, open_.rate_limit.requests_per_unit] == [
            0,
            4294967295,
        ]
        assert slots.concurrency is not None and slots.concurrency.max_in_flight == 10**9

    def test_a_cap_may_hold_a_single_active_client(self, tmp_path: Path) -> None:
        """active_clients: 1, the smallest cap declaration, loads."""
        loaded = load_text(
            tmp_path,
            """
            domain: edge
            descriptors:
              - key: route
                rate_limit: {unit: second, requests_per_unit: 100}
                fair_share: {active_clients: 1}
                descriptors:
                  - key: client_id
                    rate_limit: {unit: second, requests_per_unit: 100}
            """,
        )
        fair = loaded.config.domains["edge"].rules[0].fair_share
        assert fair is not None and fair.active_clients == 1
