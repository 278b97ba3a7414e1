"""The fairlimit command: check's exit codes and reports, serve's flags and their env twins."""

import json
import socket
from pathlib import Path

import pytest

from limit_configs import CAP_OF_TWO, FOUR_LIMITS
from servers import ROOT, fairlimit_server, run_cli

pytestmark = pytest.mark.process

FIXTURES = Path(__file__).parents[1] / "fixtures"
# serve on ports of its own: the defaults (8081, 8080) may be taken on the machine, and a
# serve that cannot bind says so before it reads its config or its backend's options
LOCAL = ("--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0")


class TestCheck:
    def test_clean_config_exits_0_and_prints_each_classification(self) -> None:
        """The bundled descriptors are clean: exit 0, one line per cap."""
        out = run_cli("check", str(ROOT / "descriptors"))
        assert out.returncode == 0, out.stderr
        assert "ok: " in out.stdout and "edge/route=public: per-client-buckets" in out.stdout

    def test_rule_violation_exits_1_with_file_path_message(self) -> None:
        """A broken rule: exit 1 and the FILE: PATH: message line on stderr."""
        path = FIXTURES / "config" / "misspelled_key.yaml"
        out = run_cli("check", str(path))
        assert out.returncode == 1
        assert out.stderr.strip() == f"{path}: edge/route=public: unknown key 'valeu'"

    def test_unusable_input_exits_2(self, tmp_path: Path) -> None:
        """A missing path or a file that is not YAML: exit 2."""
        assert run_cli("check", str(tmp_path / "missing.yaml")).returncode == 2
        assert run_cli("check", str(FIXTURES / "config" / "invalid_yaml.yaml")).returncode == 2

    def test_warnings_pass_unless_strict(self) -> None:
        """A contended cap is a warning (exit 0), an error under --strict (exit 1)."""
        path = str(FIXTURES / "validation" / "contended.yaml")
        lenient, strict = run_cli("check", path), run_cli("check", "--strict", path)
        assert lenient.returncode == 0 and "warning: " in lenient.stdout
        assert strict.returncode == 1 and "error: " in strict.stdout

    def test_json_report_lists_each_cap_with_figures(self) -> None:
        """--format json: machine-readable classification for CI pipelines."""
        out = run_cli("check", "--format", "json", str(FIXTURES / "validation" / "contended.yaml"))
        report = json.loads(out.stdout)
        (cap,) = report["classifications"]
        assert cap["mode"] == "weighted-fair-queue" and cap["warning"] is True
        assert (cap["cap_per_second"], cap["required_per_second"]) == (1000, 2000)
        assert (cap["per_client_per_second"], cap["active_clients"]) == (100, 20)
        assert report["ok"] is True and len(report["warnings"]) == 1

    def test_concurrency_caps_are_checked_and_reported(self) -> None:
        """A contended concurrency cap: a warning line, the JSON's concurrency list, and
        exit 1 under --strict (issue 16)."""
        path = str(FIXTURES / "concurrency" / "contended.yaml")
        report = json.loads(run_cli("check", "--format", "json", path).stdout)
        (cap,) = report["concurrency"]
        assert (cap["mode"], cap["max_in_flight"], cap["required_in_flight"]) == (
            "weighted-fair-queue", 10, 19,
        )  # fmt: skip
        lenient, strict = run_cli("check", path), run_cli("check", "--strict", path)
        assert f"warning: {path}: edge/route=export: global max_in_flight 10 <" in lenient.stdout
        assert strict.returncode == 1


# A cap whose second limit is contended, a bucket with a burst per second, a sliding 5
# minutes, a gcra with a burst and a calendar month in a zone, and a plain upstream bucket.
SEVERAL = (
    """
domain: api
descriptors:
"""
    + CAP_OF_TWO
    + """  - key: generic_key
    value: search
"""
    + FOUR_LIMITS
    + """  - key: generic_key
    value: health
    rate_limit: {unit: second, requests_per_unit: 50}
"""
)


class TestCheckShowsEveryLimit:
    def test_text_names_the_limits_each_verdict_is_about(self, tmp_path: Path) -> None:
        """Under a cap's verdict its one limit, under a bucket's all of them; nothing more
        for a rule with one plain limit, as before."""
        path = tmp_path / "api.yaml"
        path.write_text(SEVERAL)
        out = run_cli("check", str(path))
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].startswith(f"ok: {path}: api/tenant: rate_limits[0]: per-client-buckets")
        assert lines[1] == "    limit: 100 per second"
        assert lines[2].startswith(f"warning: {path}: api/tenant: rate_limits[1]: global cap 10/s")
        assert lines[3] == "    limit: 3000 per 5m"
        assert lines[4].startswith(f"note: {path}: api/generic_key=search: global bucket only")
        assert lines[5] == (
            "    limits: 20 per second; 3000 per 5m, sliding; 600 per minute, gcra, burst 30; "
            "1000000 per calendar month in Europe/Berlin"
        )
        assert lines[6].startswith(f"note: {path}: api/generic_key=health: global bucket only")
        assert lines[7].startswith("1 files, 1 domains: ")

    def test_json_lists_the_limits_of_each_verdict(self, tmp_path: Path) -> None:
        path = tmp_path / "api.yaml"
        path.write_text(SEVERAL)
        report = json.loads(run_cli("check", "--format", "json", str(path)).stdout)
        first, second, search, health = report["classifications"]
        assert first["limits"] == [{"unit": "second", "requests_per_unit": 100,
                                    "window_seconds": 1, "algorithm": "fixed"}]  # fmt: skip
        assert second["limits"] == [{"unit": "minute", "requests_per_unit": 3000,
                                     "window_seconds": 300, "algorithm": "fixed"}]  # fmt: skip
        assert [(f["algorithm"], f["window_seconds"]) for f in search["limits"]] == [
            ("fixed", 1), ("sliding", 300), ("gcra", 60), ("fixed", 2592000)]  # fmt: skip
        assert (search["limits"][2]["burst"], search["limits"][3]["calendar"]) == (
            30, "Europe/Berlin")  # fmt: skip
        assert health["limits"] == [{"unit": "second", "requests_per_unit": 50,
                                     "window_seconds": 1, "algorithm": "fixed"}]  # fmt: skip


def docs_block(page: str, heading: str, lang: str = "yaml") -> str:
    """The first ``lang`` code block under ``heading`` of docs/``page``."""
    text = (ROOT / "docs" / page).read_text()
    after = text[text.index(heading) :]
    start = after.index(f"```{lang}\n") + len(f"```{lang}\n")
    return after[start : after.index("```", start)]


class TestCheckCountsRulesOutsideCaps:
    """A limited rule outside any cap with a bucket per client is counted and listed, not
    `no limits` (issue 37)."""

    def test_the_docs_several_limits_example(self, tmp_path: Path) -> None:
        """configuration.md's own example: one per-client-buckets rule with its 3 limits."""
        path = tmp_path / "api.yaml"
        path.write_text(docs_block("configuration.md", "### Several limits, windows"))
        for flags in ([], ["--strict"]):
            out = run_cli("check", *flags, str(path))
            assert out.returncode == 0, out.stderr
            assert out.stdout.splitlines() == [
                f"ok: {path}: api/user: per-client buckets: each client has its own limits, "
                "under no shared cap",
                "    limits: 10 per second, gcra, burst 20; 10000 per calendar day in "
                "Europe/Berlin; 500 per 5m, sliding",
                "1 files, 1 domains: 1 per-client-buckets",
            ]

    def test_json_lists_them_with_their_limits(self, tmp_path: Path) -> None:
        path = tmp_path / "api.yaml"
        path.write_text("domain: api\ndescriptors:\n  - key: user\n" + FOUR_LIMITS)
        report = json.loads(run_cli("check", "--format", "json", str(path)).stdout)
        (rule,) = report["classifications"]
        assert (rule["path"], rule["mode"]) == ("api/user", "per-client-buckets")
        assert rule["note"] is False
        assert len(rule["limits"]) == 4 and rule["cap_per_second"] == 20

    def test_a_shared_wildcard_is_a_global_bucket(self, tmp_path: Path) -> None:
        """Every value of a share_threshold wildcard counts in one counter: a note."""
        path = tmp_path / "api.yaml"
        path.write_text(
            "domain: api\ndescriptors:\n  - key: path\n    value: /api/*\n"
            "    share_threshold: true\n"
            "    rate_limit: {unit: second, requests_per_unit: 10}\n"
        )
        out = run_cli("check", "--strict", str(path))
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"note: {path}: api/path=/api/*: global bucket only")
        assert "1 files, 1 domains: 1 global-bucket-only" in out.stdout

    def test_under_a_cap_a_client_rule_is_its_caps(self, tmp_path: Path) -> None:
        """Below a fair_share cap the clients' rule is in the cap's verdict, not listed again."""
        path = tmp_path / "api.yaml"
        path.write_text("domain: api\ndescriptors:\n" + CAP_OF_TWO)
        out = run_cli("check", str(path))
        assert "per-client buckets: each client" not in out.stdout
        assert "1 files, 1 domains: 1 per-client-buckets, 1 weighted-fair-queue" in out.stdout


class TestCheckMergesDomains:
    """Two files of one domain: refused unless merged, as `serve` decides it (upstream's
    MERGE_DOMAIN_CONFIG, FAIRLIMIT_MERGE_DOMAINS, or check's --merge-domains)."""

    @pytest.fixture
    def split(self, tmp_path: Path) -> Path:
        for name, value in (("a.yaml", "public"), ("b.yaml", "private")):
            tmp_path.joinpath(name).write_text(
                "domain: edge\ndescriptors:\n"
                f"  - key: route\n    value: {value}\n"
                "    rate_limit: {unit: second, requests_per_unit: 10}\n"
            )
        return tmp_path

    def test_refused_by_default(self, split: Path) -> None:
        out = run_cli("check", str(split))
        assert out.returncode == 1 and "duplicate domain 'edge'" in out.stderr

    @pytest.mark.parametrize(
        "env", [{"MERGE_DOMAIN_CONFIG": "true"}, {"FAIRLIMIT_MERGE_DOMAINS": "true"}]
    )
    def test_merged_as_serve_merges_them(self, split: Path, env: dict[str, str]) -> None:
        out = run_cli("check", str(split), env=env)
        assert out.returncode == 0, out.stderr
        assert "2 files, 1 domains" in out.stdout

    def test_merged_by_the_flag(self, split: Path) -> None:
        assert run_cli("check", "--merge-domains", str(split)).returncode == 0


class TestServe:
    def test_rejected_first_load_refuses_to_start(self) -> None:
        """A bad config at start: FILE: PATH: message logged, exit 2."""
        path = FIXTURES / "config" / "invalid_unit.yaml"
        out = run_cli("serve", "--config", str(path), *LOCAL)
        assert out.returncode == 2
        assert f"{path}: edge/generic_key=api: invalid rate limit unit 'fortnight'" in out.stderr

    def test_a_plain_upstream_config_passes_strict_with_notes(self) -> None:
        """Global buckets, as every upstream config has them, are notes that say what to do."""
        path = str(ROOT / "tests" / "fixtures" / "upstream" / "keys")
        out = run_cli("check", "--strict", path)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "note: " in out.stdout and "error: " not in out.stdout
        assert "advice, never an error, --strict included" in out.stdout

    def test_strict_refuses_a_contended_cap(self) -> None:
        """--strict (or FAIRLIMIT_STRICT) makes a classification warning a load error."""
        path = str(FIXTURES / "validation" / "contended.yaml")
        out = run_cli(
            "serve",
            "--config",
            path,
            *LOCAL,
            env={"FAIRLIMIT_STRICT": "true"},
        )
        assert out.returncode == 2 and "contention shifts to the cap" in out.stderr

    def test_env_twins_configure_serve(self, tmp_path: Path) -> None:
        """FAIRLIMIT_CONFIG and FAIRLIMIT_LOG_FORMAT work as the flags do."""
        config = tmp_path / "only.yaml"
        limit = "    rate_limit: {unit: second, requests_per_unit: 1}\n"
        config.write_text(f"domain: envtwin\ndescriptors:\n  - key: k\n{limit}")
        env = {"FAIRLIMIT_CONFIG": str(config), "FAIRLIMIT_LOG_FORMAT": "json"}
        with fairlimit_server(env=env) as server:
            pass
        records = [json.loads(line) for line in server.lines if line.startswith("{")]
        assert any(str(config) in r["message"] for r in records)

    @pytest.mark.parametrize(
        ("args", "message"),
        [
            (["--workers", "2"], "--workers: several workers need shared state"),
            (["--backend", "redis://h/?tiemout=1"], "--backend: unknown Redis URL option(s)"),
            (["--backend", "localhost:6379"], "--backend: expected a URL (SCHEME://...)"),
            (["--grpc-addr", "nowhere"], "--grpc-addr: expected HOST:PORT, got 'nowhere'"),
            (["--rlqs-max-buckets", "0"], "--rlqs-max-buckets: must be 1 or more, got 0"),
            (
                ["--rlqs-max-buckets-per-stream", "many"],
                "--rlqs-max-buckets-per-stream: expected a whole number, got 'many'",
            ),
        ],
    )
    def test_bad_flags_exit_2_with_a_clear_message(self, args: list[str], message: str) -> None:
        """Unusable settings are refused before anything starts."""
        out = run_cli("serve", *LOCAL, *args)  # a flag in args wins over LOCAL's
        assert out.returncode == 2 and message in out.stderr

    @pytest.mark.parametrize("workers", ["1", "2"])
    def test_an_unknown_backend_scheme_exits_2_naming_the_supported_ones(
        self, workers: str
    ) -> None:
        """The store refuses a scheme it does not know, before serving; the flag is named."""
        out = run_cli("serve", "--backend", "mongodb://x", "--workers", workers, *LOCAL)
        assert out.returncode == 2
        assert "--backend: " in out.stderr and "mongodb://" in out.stderr
        assert "memory://" in out.stderr and "redis://" in out.stderr

    def test_bad_env_value_names_the_variable(self) -> None:
        """A bad FAIRLIMIT_* value names the variable."""
        out = run_cli("serve", env={"FAIRLIMIT_FAILURE_MODE": "maybe"})
        assert out.returncode == 2
        assert "FAIRLIMIT_FAILURE_MODE: expected open, closed or local, got 'maybe'" in out.stderr
        out = run_cli("serve", env={"FAIRLIMIT_RLQS_MAX_BUCKETS": "-1"})
        assert out.returncode == 2
        assert "FAIRLIMIT_RLQS_MAX_BUCKETS: expected a whole number, got '-1'" in out.stderr


class TestHelp:
    def test_the_command_says_what_it_is(self) -> None:
        """--help describes fairlimit to its user, not the module to its maintainers."""
        out = run_cli("--help")
        assert out.returncode == 0
        assert "Envoy-compatible gRPC rate-limit server" in out.stdout
        assert "``" not in out.stdout and "Logging is set up" not in out.stdout

    def test_every_serve_flag_says_what_it_does_and_its_default(self) -> None:
        """Each option has help; those with a setting behind them show its default."""
        from fairlimit.cli import _parser  # the parser itself: every option, none missed
        from fairlimit.settings import Settings

        (sub,) = [a for a in _parser()._actions if a.dest == "command"]
        serve = sub.choices["serve"]  # type: ignore[index]
        options = [a for a in serve._actions if a.dest != "help"]
        assert [a.option_strings[0] for a in options if not a.help] == []
        defaults = Settings()
        for name in ("backend", "grpc_addr", "admin_addr", "workers", "log_level",
                     "top_clients", "grpc_max_concurrent", "admin_json"):  # fmt: skip
            (action,) = [a for a in options if a.dest == name]
            assert f"(default {getattr(defaults, name)})" in action.help, name
        text = run_cli("serve", "--help").stdout
        assert "FAIRLIMIT_GRPC_ADDR" in text and "/readyz" in text


class TestBusyPort:
    """A port another process holds: one line naming the address and what sets it, exit 2
    (it was a 40-line traceback with the cause at the bottom)."""

    @pytest.fixture
    def taken(self) -> object:
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            yield holder.getsockname()[1]

    @pytest.mark.parametrize(
        ("flag", "what", "names"),
        [
            ("--grpc-addr", "gRPC", "--grpc-addr, FAIRLIMIT_GRPC_ADDR or GRPC_HOST/GRPC_PORT"),
            ("--admin-addr", "admin HTTP", "--admin-addr, FAIRLIMIT_ADMIN_ADDR or HOST/PORT"),
        ],
    )
    def test_one_line_names_the_port_and_the_setting(
        self, taken: int, flag: str, what: str, names: str
    ) -> None:
        ports = {"--grpc-addr": "127.0.0.1:0", "--admin-addr": "127.0.0.1:0"}
        ports[flag] = f"127.0.0.1:{taken}"
        out = run_cli("serve", *[x for pair in ports.items() for x in pair])
        assert out.returncode == 2
        assert out.stderr.splitlines() == [
            f"fairlimit: cannot listen for {what} on 127.0.0.1:{taken}: address already in "
            f"use; set another with {names}"
        ]

    def test_upstreams_variables_too(self, taken: int) -> None:
        """/bin/ratelimit's environment: the same line (its variables are in it)."""
        env = {"GRPC_HOST": "127.0.0.1", "GRPC_PORT": "0", "HOST": "127.0.0.1",
               "PORT": str(taken), "DEBUG_PORT": "0"}  # fmt: skip
        out = run_cli("serve", env=env)
        assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
        assert f"127.0.0.1:{taken}" in out.stderr and "HOST/PORT" in out.stderr


def test_version() -> None:
    """version prints the package version."""
    out = run_cli("version")
    assert out.returncode == 0 and out.stdout.startswith("fairlimit ")
