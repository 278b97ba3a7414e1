"""Signals while the server starts (issue 26): a SIGHUP that comes before the serve loop
installs its reload handler must not end the process (it did, 0.2-0.6 s after start)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import STARTUP_SECONDS
from servers import ROOT

pytestmark = pytest.mark.process


def _ignores_sighup(pid: int) -> bool:
    """Whether ``pid`` ignores SIGHUP now (/proc/PID/status, SigIgn: bit 0 is SIGHUP)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGHUP - 1)))
    return False


def test_a_sighup_during_start_is_survived() -> None:
    """SIGHUP sent as soon as the process ignores it (before the config is loaded and the
    servers start): the server still comes up, and a later SIGHUP reloads it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "server")}
    command = [sys.executable, "-m", "fairlimit", "serve", "--grpc-addr", "127.0.0.1:0",
               "--admin-addr", "127.0.0.1:0"]  # fmt: skip
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while not _ignores_sighup(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, "never ignored SIGHUP"
            time.sleep(0.001)
        proc.send_signal(signal.SIGHUP)
        assert proc.stderr is not None
        lines = []
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "serving gRPC" in line:
                break
        assert proc.poll() is None, "".join(lines)
        assert any("serving gRPC" in line for line in lines), "".join(lines)
        proc.send_signal(signal.SIGHUP)  # the reload handler is in now
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line or "reload" in line.lower():
                break
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(STARTUP_SECONDS)
        if proc.stderr is not None:
            proc.stderr.close()
