"""envoyproxy/ratelimit's descriptor files: every key it accepts, read as it reads them."""

import re
from pathlib import Path

import pytest

from fairlimit.config.loader import load
from fairlimit.core.units import seconds_until_reset
from fairlimit.errors import ConfigError

pytestmark = pytest.mark.unit

UPSTREAM = Path(__file__).parents[1] / "fixtures" / "upstream"


def _expected(path: Path) -> list[str]:
    lines = re.findall(r"^# expect: (.*)$", path.read_text(), re.MULTILINE)
    return [line.replace("{file}", str(path)) for line in lines]


class TestUpstreamErrors:
    @pytest.mark.parametrize(
        "path", sorted((UPSTREAM / "errors").glob("*.yaml")), ids=lambda p: p.stem
    )
    def test_each_fixture_is_rejected_with_its_exact_message(self, path: Path) -> None:
        """Duplicate keys, a share_threshold without wildcard, bad metadata, octal numbers."""
        with pytest.raises(ConfigError) as caught:
            load([path])
        assert caught.value.problems == _expected(path)


class TestUpstreamKeys:
    def test_every_upstream_key_loads(self) -> None:
        """The fixtures use every key upstream's loader accepts."""
        loaded = load([UPSTREAM / "keys"])
        assert sorted(loaded.config.domains) == [
            "files", "metrics", "modes", "quotas", "scalars", "tiers"]  # fmt: skip
        text = "".join(p.read_text() for p in (UPSTREAM / "keys").glob("*.yaml"))
        keys = ("share_threshold", "quota_mode", "metadata", "value_to_metric", "detailed_metric",
                "shadow_mode", "replaces", "unlimited", "name:")  # fmt: skip
        assert all(key in text for key in keys)

    def test_scalars_are_the_text_written(self) -> None:
        """010 stays "010", 1.50 stays "1.50", true stays "true"; an empty value is none."""
        rules = load([UPSTREAM / "keys" / "scalars.yaml"]).config.domains["scalars"].rules
        assert [r.value for r in rules] == ["010", "1.50", "true", None]

    def test_flags_and_metadata_are_kept_on_the_rule(self) -> None:
        domains = load([UPSTREAM / "keys"]).config.domains
        quota = domains["quotas"].rules
        assert [r.quota_mode for r in quota] == [True, True, False]
        shared = domains["files"].rules
        assert [r.share_threshold for r in shared] == [True, False, True]
        gold = domains["tiers"].rules[0].metadata
        assert gold == {"tier": "gold", "weight": 3, "ratio": 0.5, "labels": ["a", "b"],
                        "nested": {"beta": True}}  # fmt: skip
        tenant = domains["metrics"].rules[0]
        assert tenant.value_to_metric and not tenant.children[0].value_to_metric

    def test_two_files_of_one_domain_are_refused_unless_merged(self) -> None:
        """MERGE_DOMAIN_CONFIG: the later file's descriptors join the first's."""
        with pytest.raises(ConfigError, match="duplicate domain 'merged'"):
            load([UPSTREAM / "merge"])
        merged = load([UPSTREAM / "merge"], merge_domains=True).config.domains["merged"]
        assert [r.key for r in merged.rules] == ["one", "two"]
        assert merged.source == str(UPSTREAM / "merge" / "part_one.yaml")  # the first file

    def test_merging_keeps_composite_keys_unique(self, tmp_path: Path) -> None:
        for name in ("a", "b"):
            (tmp_path / f"{name}.yaml").write_text(
                "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, "
                "requests_per_unit: 1}\n"
            )
        with pytest.raises(ConfigError) as caught:
            load([tmp_path], merge_domains=True)
        assert caught.value.problems == [
            f"{tmp_path / 'b.yaml'}: d/k: duplicate descriptor composite key "
            f"(also in {tmp_path / 'a.yaml'})"
        ]

    def test_merging_keeps_the_first_files_request_id_keys(self, tmp_path: Path) -> None:
        """The merged domain pairs its slots by the request_id_keys of its first file."""
        (tmp_path / "a.yaml").write_text(
            "domain: d\nrequest_id_keys: {acquire: rid, release: rid_done}\n"
            "descriptors:\n  - key: k\n    concurrency: {max_in_flight: 1}\n"
        )
        (tmp_path / "b.yaml").write_text(
            "domain: d\ndescriptors:\n  - key: j\n    concurrency: {max_in_flight: 1}\n"
        )
        merged = load([tmp_path], merge_domains=True).config.domains["d"]
        assert [r.key for r in merged.rules] == ["k", "j"]
        assert (merged.acquire_key, merged.release_key) == ("rid", "rid_done")


class TestReset:
    @pytest.mark.parametrize(
        ("window", "now", "reset"),
        [(1, 100.0, 1), (1, 100.99, 1), (60, 120.0, 60), (60, 179.5, 1), (60, 150.2, 30)],
    )
    def test_whole_seconds_rounded_up(self, window: int, now: float, reset: int) -> None:
        """window - now % window in whole seconds, as upstream: never 0."""
        assert seconds_until_reset(window, now) == reset
