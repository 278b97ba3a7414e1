"""Descriptor YAML read as text, as envoyproxy/ratelimit reads it, with duplicate keys refused."""

import pytest

from fairlimit.config.loader import parse_domain
from fairlimit.config.yaml_text import (
    Plain,
    as_bool,
    as_int,
    as_number,
    read_text_yaml,
    typed,
)
from fairlimit.errors import ConfigUnreadable

pytestmark = pytest.mark.unit


class TestScalarsAsText:
    def test_numbers_and_booleans_keep_the_text_written(self) -> None:
        """010 is not octal 8, 1.50 is not 1.5, true is not True."""
        raw = read_text_yaml("a: 010\nb: 1.50\nc: true\nd: '7'\n", "f.yaml")
        assert raw == {"a": "010", "b": "1.50", "c": "true", "d": "7"}
        assert isinstance(raw["a"], Plain) and not isinstance(raw["d"], Plain)

    def test_plain_nulls_are_unset(self) -> None:
        """~, null and an empty value leave the field unset, as upstream's decoder does."""
        assert read_text_yaml("a: ~\nb: null\nc:\nd: 'null'\n", "f") == {
            "a": None, "b": None, "c": None, "d": "null"}  # fmt: skip

    def test_booleans_and_integers_are_read_from_plain_text_only(self) -> None:
        raw = read_text_yaml("t: yes\nf: Off\nq: 'true'\nn: 12\nz: 012\nqn: '12'\n", "f")
        assert (as_bool(raw["t"]), as_bool(raw["f"]), as_bool(raw["q"])) == (True, False, None)
        assert (as_int(raw["n"]), as_int(raw["z"]), as_int(raw["qn"])) == (12, None, None)

    def test_an_integer_may_carry_a_plus_sign(self) -> None:
        """+12 is 12, as Go's yaml.v2 reads it; a sign after the digits is not a number."""
        raw = read_text_yaml("p: +12\ns: 12+\n", "f")
        assert (as_int(raw["p"]), as_int(raw["s"])) == (12, None)

    def test_text_that_is_not_ascii_decimal_digits_is_not_an_integer(self) -> None:
        """x, 1.5, 1e3 and Arabic-Indic digits (which str.isdigit accepts) are not integers."""
        raw = read_text_yaml("a: x\nb: 1.5\nc: 1e3\nd: \u0661\u0662\n", "f")
        assert [as_int(raw[k]) for k in "abcd"] == [None, None, None, None]

    def test_numbers_are_read_from_plain_decimals_only(self) -> None:
        """3 and .5 are numbers; '0.5' quoted, 1e3 and x are not."""
        raw = read_text_yaml("a: 3\nb: .5\nq: '0.5'\ne: 1e3\nx: x\n", "f")
        assert [as_number(raw[k]) for k in "abqex"] == [3.0, 0.5, None, None, None]

    def test_metadata_is_typed_as_yaml_types_it(self) -> None:
        raw = read_text_yaml("m: {n: 3, r: 0.5, b: true, s: '3', l: [1, x]}\n", "f")
        assert typed(raw["m"]) == {"n": 3, "r": 0.5, "b": True, "s": "3", "l": [1, "x"]}

    def test_metadata_without_a_json_form_stays_the_text_written(self) -> None:
        """A date is its text (a Struct has no dates); null is None."""
        raw = read_text_yaml("m: {d: 2024-01-31, t: 2024-01-31 10:00:00, z: null}\n", "f")
        assert typed(raw["m"]) == {"d": "2024-01-31", "t": "2024-01-31 10:00:00", "z": None}


class TestDuplicateKeys:
    def test_a_repeated_key_names_both_lines(self) -> None:
        with pytest.raises(ConfigUnreadable) as caught:
            read_text_yaml("domain: d\nx: 1\ndomain: e\n", "f.yaml")
        assert caught.value.problems == [
            "f.yaml: line 3 column 1: duplicate key: 'domain' (first on line 1)"
        ]

    def test_repeats_in_different_mappings_are_fine(self) -> None:
        assert read_text_yaml("- {k: 1}\n- {k: 2}\n", "f") == [{"k": "1"}, {"k": "2"}]


class TestDocuments:
    """A file's first YAML document is its config, as envoyproxy/ratelimit reads it (issue 37)."""

    @pytest.mark.parametrize(
        "tail", ["---\n", "---", "...\n", "---\n# nothing more\n", "---\n---\n", "--- ~\n"]
    )
    def test_a_trailing_empty_document_is_fine(self, tail: str) -> None:
        assert read_text_yaml("domain: d\nx: 1\n" + tail, "f") == {"domain": "d", "x": "1"}

    def test_an_upstream_file_ending_in_a_marker_loads(self) -> None:
        domain = parse_domain(
            "domain: edge\ndescriptors:\n  - key: k\n    value: v\n"
            "    rate_limit: {unit: second, requests_per_unit: 1}\n---\n",
            "edge.yaml",
        )
        assert (domain.name, [r.path for r in domain.rules]) == ("edge", ["edge/k=v"])

    def test_a_leading_document_marker_is_fine(self) -> None:
        assert read_text_yaml("---\ndomain: d\n---\n", "f") == {"domain": "d"}

    def test_a_second_document_with_content_names_its_line(self) -> None:
        """Upstream ignores it without a word; a domain dropped silently is refused here."""
        with pytest.raises(ConfigUnreadable) as caught:
            read_text_yaml("domain: d\n---\ndomain: e\n", "f.yaml")
        assert caught.value.problems == [
            "f.yaml: line 3 column 1: a second YAML document: envoyproxy/ratelimit reads only "
            "a file's first document and ignores this one: put each domain in its own file"
        ]

    def test_duplicate_keys_are_still_refused_before_the_marker(self) -> None:
        with pytest.raises(ConfigUnreadable) as caught:
            read_text_yaml("domain: d\ndomain: e\n---\n", "f.yaml")
        assert "duplicate key: 'domain' (first on line 1)" in caught.value.problems[0]

    def test_an_empty_file_is_none(self) -> None:
        assert read_text_yaml("", "f") is None
        assert read_text_yaml("# only a comment\n", "f") is None


class TestUnreadableYaml:
    def test_invalid_yaml_names_line_and_column(self) -> None:
        """PyYAML's problem, at the line and column where PyYAML marks it."""
        with pytest.raises(ConfigUnreadable) as caught:
            read_text_yaml("a: [\n", "f")
        assert caught.value.problems == [
            "f: line 2 column 1: invalid YAML: expected the node content, but found '<stream end>'"
        ]

    def test_a_control_character_names_the_file_and_pyyamls_reason(self) -> None:
        """YAML refuses a control character before parsing: no line and column, so (file) and
        PyYAML's reason, which gives the character's position."""
        with pytest.raises(ConfigUnreadable) as caught:
            read_text_yaml("domain: bell\x07\n", "f.yaml")
        assert caught.value.problems == [
            "f.yaml: (file): invalid YAML: unacceptable character #x0007: special characters "
            'are not allowed\n  in "<unicode string>", position 12'
        ]
