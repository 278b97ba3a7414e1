"""The memory store gives memory back after a spike of clients (RSS, not only its count).

Issue 13: 500k minute-window clients took a server from 60 to 182 MB, and after they expired
it fell back only to 147 MB. This runs bench/memory.py's measurement in a fresh process
(so the heap is this scenario's alone): two waves of 100k clients, each expired.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import skip_or_fail
from servers import ROOT

pytestmark = pytest.mark.process


def test_rss_returns_near_its_baseline_after_two_waves_expire(tmp_path: Path) -> None:
    """The store holds its 3 entries again, and RSS is within 10 MB of the baseline (it
    stayed ~15 MB above it, and grew with each wave, before)."""
    if not Path("/proc/self/statm").exists():
        skip_or_fail("reads RSS from Linux /proc")
    command = [sys.executable, str(ROOT / "bench" / "memory.py"), "--one", "minute",
               "--clients", "100000", "--waves", "2", "--workdir", str(tmp_path)]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
    row = json.loads(out.stdout)
    (baseline, held_before), (peak, held), (after, held_after) = (
        row["baseline"],
        row["wave 2"],
        row["after 2"],
    )
    assert (held_before, held, held_after) == (3, 100_003, 3)
    assert peak > baseline + 30  # the waves were big enough to measure anything
    assert after < baseline + 10, row
