"""``fairlimit top``: the terminal view of the top clients, against a real server process."""

import io
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from fairlimit import topview
from servers import ROOT, ServerProcess, fairlimit_server, free_port, run_cli

pytestmark = pytest.mark.process


def post_json(port: int, client: str, hits: int = 1) -> int:
    """One request through the admin's POST /json (the real limiter path); its status."""
    entries = [{"key": "route", "value": "public"}, {"key": "client_id", "value": client}]
    asked = {"domain": "edge", "descriptors": [{"entries": entries}], "hits_addend": hits}
    body = json.dumps(asked).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/json", body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """The bundled descriptors (route=public: 100/s per client), after a hog and a calm one."""
    with fairlimit_server() as process:
        port = process.admin_port
        # 200 hits at once are over 100/s in any window: rejected whatever the timing
        assert post_json(port, "batch-etl", hits=200) == 429
        assert post_json(port, "batch-etl", hits=60) in (200, 429)
        assert [post_json(port, "checkout") for _ in range(3)] == [200, 200, 200]
        yield process


class TestTopOnce:
    def test_once_prints_one_snapshot_of_each_cap(self, server: ServerProcess) -> None:
        """--once: the hog first, its rejections counted, the calm client below; exit 0."""
        addr = f"127.0.0.1:{server.admin_port}"
        out = run_cli("top", "--once", "--admin-addr", addr, "-n", "5")
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].startswith(f"fairlimit top  {addr}  ")
        assert "(top 5 per cap by demand, this process)" in lines[0]
        at = next(i for i, line in enumerate(lines) if line.startswith("edge/route=public  "))
        assert "per-client-buckets  last " in lines[at] and "hits/s" in lines[at]
        assert lines[at + 1] == "  limits: 1000 per second"  # descriptors/edge.yaml's cap
        assert lines[at + 2].split() == ["#", "CLIENT", "HITS/s", "SHARE", "REJECTED/s"]
        first, second = lines[at + 3].split(), lines[at + 4].split()
        assert first[:2] == ["1", "batch-etl"] and float(first[4]) > 0  # rejected/s
        assert second[:2] == ["2", "checkout"] and float(second[4]) == 0
        assert "edge/route=admin  per-client-buckets  no requests" in out.stdout

    def test_sort_by_rejections_and_one_rule(self, server: ServerProcess) -> None:
        """--sort rejections --rule PATH: only that cap, only clients that were refused."""
        addr = f"127.0.0.1:{server.admin_port}"
        out = run_cli("top", "--once", "--admin-addr", addr, "--sort", "rejections",
                  "--rule", "edge/route=public")  # fmt: skip
        assert out.returncode == 0, out.stderr
        rows = [line.split() for line in out.stdout.splitlines() if line[:5].strip().isdigit()]
        assert [row[1] for row in rows] == ["batch-etl"]
        assert "edge/route=admin" not in out.stdout

    @pytest.mark.parametrize("once", [["--once"], []])
    def test_an_unknown_rule_is_an_error_naming_it(
        self, server: ServerProcess, once: list[str]
    ) -> None:
        """--rule nosuch: exit 2 naming the rule and the ones there are, not an empty view
        (refreshing too: asking again would not help; issue 37)."""
        addr = f"127.0.0.1:{server.admin_port}"
        out = run_cli("top", *once, "--admin-addr", addr, "--rule", "nosuch", "--interval", "0.1")
        assert out.returncode == 2 and out.stdout == ""
        assert "HTTP 404: rule: no cap or global bucket 'nosuch' (there are: " in out.stderr
        assert "edge/route=public" in out.stderr

    def test_the_admin_address_comes_from_the_environment_too(self, server: ServerProcess) -> None:
        """FAIRLIMIT_ADMIN_ADDR, as for serve; a wildcard bind is asked on loopback."""
        env = {"FAIRLIMIT_ADMIN_ADDR": f"0.0.0.0:{server.admin_port}"}
        out = run_cli("top", "--once", env=env)
        assert out.returncode == 0, out.stderr
        assert f"127.0.0.1:{server.admin_port}" in out.stdout.splitlines()[0]

    def test_no_server_is_exit_2_with_the_reason(self) -> None:
        """Nothing listening: one line on stderr naming the URL, exit 2."""
        port = free_port()
        out = run_cli("top", "--once", "--admin-addr", f"127.0.0.1:{port}")
        assert out.returncode == 2
        assert out.stderr.startswith(f"fairlimit top: http://127.0.0.1:{port}/top?n=10: ")


class _Stop(Exception):
    """Ends the refresh loop in place of Ctrl-C."""


class TestRefresh:
    def test_redraws_every_interval_until_interrupted(self, server: ServerProcess) -> None:
        """Each interval polls again and draws a new frame; the sleep is injected, not slept."""
        url = topview.url_of(f"127.0.0.1:{server.admin_port}", 3, None)
        out, slept = io.StringIO(), []

        def sleep(seconds: float) -> None:
            slept.append(seconds)
            if len(slept) == 3:
                raise _Stop

        with pytest.raises(_Stop):
            topview.run(url, sort="demand", once=False, interval=0.5, out=out, sleep=sleep)
        assert slept == [0.5, 0.5, 0.5]
        frames = out.getvalue().split("\nfairlimit top  ")[1:]
        assert len(frames) == 3  # not a terminal: each frame after a blank line, not cleared
        assert all("batch-etl" in frame for frame in frames)
        assert topview.CLEAR not in out.getvalue()

    def test_an_unreachable_server_is_shown_and_polled_again(self) -> None:
        """While refreshing, a failed poll is a frame that says why, not an exit."""
        out, slept = io.StringIO(), []

        def sleep(seconds: float) -> None:
            slept.append(seconds)
            raise _Stop

        url = topview.url_of(f"127.0.0.1:{free_port()}", 10, None)
        with pytest.raises(_Stop):
            topview.run(url, sort="demand", once=False, interval=1.0, out=out, sleep=sleep)
        assert f"fairlimit top: cannot read {url}: " in out.getvalue()


class TestUrl:
    @pytest.mark.parametrize(
        ("addr", "url"),
        [
            ("127.0.0.1:8080", "http://127.0.0.1:8080/top?n=10"),
            ("0.0.0.0:8080", "http://127.0.0.1:8080/top?n=10"),
            ("[::]:9", "http://[::1]:9/top?n=10"),
            ("[::1]:9", "http://[::1]:9/top?n=10"),
        ],
    )
    def test_admin_address_to_url(self, addr: str, url: str) -> None:
        """Where ``top`` asks: the admin address, a wildcard bind as loopback."""
        assert topview.url_of(addr, 10, None) == url

    def test_rule_is_quoted(self) -> None:
        assert topview.url_of("h:1", 2, "edge/route=public") == (
            "http://h:1/top?n=2&rule=edge%2Froute%3Dpublic"
        )


class TestPipe:
    """`fairlimit top | head`: the reader going away ends top quietly (no BrokenPipe
    traceback), refreshing or --once."""

    @pytest.mark.parametrize("once", [False, True])
    def test_a_closed_pipe_ends_it_quietly(self, server: ServerProcess, once: bool) -> None:
        addr = f"127.0.0.1:{server.admin_port}"
        command = [sys.executable, "-m", "fairlimit", "top", "--admin-addr", addr,
                   "--interval", "0.05", *(["--once"] if once else [])]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT / "server")}
        process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert process.stdout is not None and process.stderr is not None
        try:
            if not once:
                process.stdout.readline()  # as head: one line, then gone
            process.stdout.close()
            code = process.wait(timeout=60)
            errors = process.stderr.read()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            process.stderr.close()
        assert (code, errors) == (0, "")
