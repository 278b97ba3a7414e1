"""envoyproxy/ratelimit's environment variables read as aliases of fairlimit's settings."""

from pathlib import Path

import pytest

from fairlimit.errors import SettingsError
from fairlimit.settings import Settings
from fairlimit.settings.upstream import go_duration, translate
from fairlimit.settings.xds import XdsSection, XdsTlsFiles

pytestmark = pytest.mark.unit


class TestListeners:
    def test_grpc_and_http_ports_become_addresses_on_every_interface(self) -> None:
        """GRPC_PORT and PORT alone listen on 0.0.0.0, upstream's default host."""
        values = translate({"GRPC_PORT": "9081", "PORT": "9080"}).values
        assert values["grpc_addr"] == "0.0.0.0:9081"
        assert values["admin_addr"] == "0.0.0.0:9080"

    def test_unix_socket_wins_over_host_and_port(self) -> None:
        """GRPC_UDS serves gRPC on a unix socket, as upstream."""
        values = translate({"GRPC_UDS": "/tmp/rl.sock", "GRPC_PORT": "1"}).values
        assert values["grpc_addr"] == "unix:/tmp/rl.sock"

    def test_debug_listener_only_when_asked(self) -> None:
        """The debug listener (text /rlconfig) is opened only when DEBUG_* is set."""
        assert "debug_addr" not in translate({}).values
        assert translate({"DEBUG_PORT": "6070"}).values["debug_addr"] == "0.0.0.0:6070"

    def test_go_durations_are_read_in_seconds(self) -> None:
        """24h, 1h30m, 500ms and 0 are Go durations."""
        assert go_duration("X", "24h") == 86400
        assert go_duration("X", "1h30m") == 5400
        assert go_duration("X", "500ms") == 0.5
        assert go_duration("X", "0") == 0

    def test_a_malformed_duration_names_the_variable(self) -> None:
        with pytest.raises(SettingsError, match="GRPC_MAX_CONNECTION_AGE: expected a duration"):
            translate({"GRPC_MAX_CONNECTION_AGE": "a day"})


class TestPrometheus:
    def test_use_prometheus_serves_upstream_names_on_9090_by_default(self) -> None:
        """As upstream's Prometheus sink: PROMETHEUS_ADDR, ``:9090`` unless set."""
        assert translate({"USE_PROMETHEUS": "true"}).values["metrics_addr"] == "0.0.0.0:9090"
        env = {"USE_PROMETHEUS": "true", "PROMETHEUS_ADDR": "127.0.0.1:9102"}
        assert translate(env).values["metrics_addr"] == "127.0.0.1:9102"
        assert "metrics_addr" not in translate({"PROMETHEUS_ADDR": ":9090"}).values


class TestConfigLayout:
    def test_runtime_layout_names_the_config_directory(self) -> None:
        """Files come from RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY."""
        env = {"RUNTIME_ROOT": "/data", "RUNTIME_SUBDIRECTORY": "ratelimit"}
        assert translate(env).values["config"] == "/data/ratelimit/config"

    def test_upstreams_files_charge_as_upstream(self) -> None:
        """Upstream's layout: a rule that does not say charge_when_over_limit counts every
        hit, refused or not (upstream's files cannot say it)."""
        env = {"RUNTIME_ROOT": "/data"}
        assert translate(env).values["charge_when_over_limit"] == "true"
        assert "charge_when_over_limit" not in translate({}).values

    def test_upstreams_layout_accepts_a_config_without_limits(self) -> None:
        """Upstream's layout loads a directory without limits as upstream does; fairlimit's
        own --config keeps refusing one unless asked."""
        assert translate({"RUNTIME_ROOT": "/data"}).values["allow_empty_config"] == "true"
        assert "allow_empty_config" not in translate({}).values

    @pytest.mark.parametrize(("stop", "charge"), [("true", "false"), ("false", "true")])
    def test_stop_cache_key_increment_switches_it(self, stop: str, charge: str) -> None:
        """STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT is its upstream name, inverted; honoured,
        so never in the warning."""
        env = {"RUNTIME_ROOT": "/data", "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT": stop}
        out = translate(env)
        assert out.values["charge_when_over_limit"] == charge and out.warning() is None

    def test_no_runtime_variable_keeps_fairlimits_default(self) -> None:
        assert "config" not in translate({}).values

    def test_xds_source_takes_its_server_node_and_headers(self) -> None:
        """CONFIG_TYPE=GRPC_XDS_SOTW: RateLimitConfig resources over ADS from that server."""
        env = {"CONFIG_TYPE": "GRPC_XDS_SOTW", "CONFIG_GRPC_XDS_SERVER_URL": "cp:18000",
               "CONFIG_GRPC_XDS_NODE_ID": "rl", "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS": "a:b",
               "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL": "500ms"}  # fmt: skip
        assert translate(env).values == {
            "config_source": "xds", "xds_server": "cp:18000", "xds_node_id": "rl",
            "xds_headers": "a:b", "xds_retry": "0.5"}  # fmt: skip

    def test_the_xds_section_comes_typed(self) -> None:
        """Settings.xds: the node metadata and headers as pairs (header names in lower
        case, items without a separator dropped, as upstream drops them), TLS as paths."""
        env = {"CONFIG_TYPE": "GRPC_XDS_SOTW", "CONFIG_GRPC_XDS_SERVER_URL": "cp:18000",
               "CONFIG_GRPC_XDS_NODE_METADATA": "zone=eu, rack = r1 ,bare,=x",
               "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS": "X-Token:t,Other: o:p,bare",
               "CONFIG_GRPC_XDS_SERVER_USE_TLS": "true",
               "CONFIG_GRPC_XDS_SERVER_TLS_CACERT": "/ca"}  # fmt: skip
        assert Settings.from_env(env).xds == XdsSection(
            "cp:18000", "default", (("zone", "eu"), ("rack", "r1")),
            (("x-token", "t"), ("other", "o:p")), 3.0, XdsTlsFiles(Path("/ca")))  # fmt: skip
        assert Settings.from_env({"CONFIG_TYPE": "GRPC_XDS_SOTW"}).xds.tls is None

    def test_xds_over_mtls(self) -> None:
        env = {"CONFIG_TYPE": "GRPC_XDS_SOTW", "CONFIG_GRPC_XDS_SERVER_USE_TLS": "true",
               "CONFIG_GRPC_XDS_SERVER_TLS_CACERT": "/ca",
               "CONFIG_GRPC_XDS_CLIENT_TLS_CERT": "/c", "CONFIG_GRPC_XDS_CLIENT_TLS_KEY": "/k",
               "CONFIG_GRPC_XDS_SERVER_TLS_SAN": "cp"}  # fmt: skip
        values = translate(env).values
        assert (values["xds_tls"], values["xds_server_ca"], values["xds_server_san"]) == (
            "true", "/ca", "cp")  # fmt: skip
        assert translate(env).warning() is None

    def test_force_start_is_honoured(self) -> None:
        """FORCE_START_WITHOUT_INITIAL_CONFIG (Envoy Gateway sets it): serve before xDS."""
        env = {"CONFIG_TYPE": "GRPC_XDS_SOTW", "FORCE_START_WITHOUT_INITIAL_CONFIG": "true"}
        out = translate(env)
        assert out.values["force_start"] == "true" and out.warning() is None

    def test_the_root_is_watched_unless_told_not_to(self) -> None:
        """RUNTIME_WATCH_ROOT: true by default (upstream's), false as Envoy Gateway sets it."""
        values = translate({"RUNTIME_ROOT": "/srv/current"}).values
        assert values["runtime_root"] == "/srv/current" and "watch_root" not in values
        off = translate({"RUNTIME_ROOT": "/data", "RUNTIME_WATCH_ROOT": "false"}).values
        assert off["watch_root"] == "false"

    def test_ignoring_dotfiles_is_honoured(self) -> None:
        assert translate({"RUNTIME_IGNOREDOTFILES": "true"}).values["ignore_dotfiles"] == "true"

    def test_unknown_config_type_is_refused(self) -> None:
        with pytest.raises(SettingsError, match="CONFIG_TYPE"):
            translate({"CONFIG_TYPE": "ETCD"})


class TestRedis:
    def test_single_tcp_with_auth_and_pool(self) -> None:
        """REDIS_URL host:port with REDIS_AUTH user:password and REDIS_POOL_SIZE."""
        env = {"REDIS_SOCKET_TYPE": "tcp", "REDIS_URL": "redis:6379",
               "REDIS_AUTH": "app:s3cret", "REDIS_POOL_SIZE": "20"}  # fmt: skip
        assert translate(env).values["backend"] == (
            "redis://app:s3cret@redis:6379?max_connections=20"
        )

    def test_password_only_auth(self) -> None:
        env = {"REDIS_SOCKET_TYPE": "tcp", "REDIS_URL": "r:6379", "REDIS_AUTH": "pw"}
        assert translate(env).values["backend"] == "redis://:pw@r:6379"

    def test_tls_uses_rediss_with_its_files(self) -> None:
        env = {"REDIS_SOCKET_TYPE": "tcp", "REDIS_URL": "r:6380", "REDIS_TLS": "true",
               "REDIS_TLS_CACERT": "/ca.pem",
               "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION": "true"}  # fmt: skip
        assert translate(env).values["backend"] == (
            "rediss://r:6380?ssl_ca_certs=/ca.pem&ssl_check_hostname=false"
        )

    def test_sentinel_list_starts_with_the_master_name(self) -> None:
        env = {"REDIS_SOCKET_TYPE": "tcp", "REDIS_TYPE": "sentinel",
               "REDIS_URL": "mymaster,s1:26379,s2:26379"}  # fmt: skip
        assert translate(env).values["backend"] == "redis+sentinel://s1:26379,s2:26379/mymaster"

    def test_cluster_nodes(self) -> None:
        env = {"REDIS_SOCKET_TYPE": "tcp", "REDIS_TYPE": "CLUSTER", "REDIS_URL": "a:1,b:2"}
        assert translate(env).values["backend"] == "redis+cluster://a:1,b:2"

    def test_memcache_and_unix_sockets_are_refused(self) -> None:
        """Carrying on with another backend would be wrong, so these stop the start."""
        with pytest.raises(SettingsError, match="memcache"):
            translate({"BACKEND_TYPE": "memcache"})
        with pytest.raises(SettingsError, match="unix sockets"):
            translate({"REDIS_URL": "/var/run/nutcracker/ratelimit.sock"})


class TestWarning:
    def test_unsupported_variables_are_named_in_one_warning(self) -> None:
        """Set, known and not honoured: each is named, in one line."""
        env = {"STATSD_HOST": "x", "EXTRA_TAGS": "a:b", "USE_STATSD": "true"}
        warning = translate(env).warning()
        assert warning is not None
        assert "EXTRA_TAGS, STATSD_HOST, USE_STATSD" in warning

    def test_quiet_and_default_valued_variables_draw_no_warning(self) -> None:
        """USE_STATSD=false and the goruntime knobs change nothing, so nothing is said."""
        env = {"USE_STATSD": "false", "RUNTIME_IGNOREDOTFILES": "true",
               "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT": "true"}  # fmt: skip
        assert translate(env).warning() is None
