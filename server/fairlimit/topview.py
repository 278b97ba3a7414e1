"""``fairlimit top``: a terminal view of each cap's top clients, polled from ``GET /top``.

A client of the admin port only (standard library HTTP, no server code; core/describe.py
writes the limits, as every view does): it asks the running server every ``interval``
seconds and redraws one table per cap with plain ANSI escapes when the output is a
terminal; ``--once`` prints one snapshot and exits.
"""

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any, TextIO

from fairlimit.core.describe import words

CLEAR = "\x1b[H\x1b[2J"  # cursor home, erase the screen
_WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


class Unreachable(Exception):
    """The admin port did not answer ``GET /top`` with a snapshot."""


class Refused(Unreachable):
    """The server refused the question itself (an unknown ``--rule``, a bad ``-n``): asking
    again would not help, so even a refreshing view ends."""


def url_of(admin_addr: str, n: int, rule: str | None) -> str:
    """The ``/top`` URL for an admin ``HOST:PORT`` (a wildcard bind is asked on loopback)."""
    host, _, port = admin_addr.rpartition(":")
    host = host.strip("[]")
    host = _WILDCARD_HOSTS.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    query = {"n": str(n)} | ({"rule": rule} if rule else {})
    return f"http://{host}:{port}/top?{urllib.parse.urlencode(query)}"


def fetch(url: str, timeout: float = 2.0) -> dict[str, Any]:
    """One snapshot from ``url``; Unreachable with the reason when there is none."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:  # url_of builds an http URL
            snapshot: dict[str, Any] = json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        error = Refused if 400 <= exc.code < 500 else Unreachable
        raise error(f"{url}: HTTP {exc.code}: {_reason(exc.read())}") from exc
    except (OSError, ValueError) as exc:
        raise Unreachable(f"{url}: {exc}") from exc
    return snapshot


def _reason(body: bytes) -> str:
    """An error answer's reason: the ``error`` of its JSON, else its text."""
    text = body.decode(errors="replace")
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return text
    return error if isinstance(error, str) else text


def _rate(count: float, seconds: float) -> str:
    return f"{count / seconds:10.1f}" if seconds > 0 else f"{count:10d}"


def _limits_line(limits: list[dict[str, Any]]) -> list[str]:
    """``  limits: 100 per second; 3000 per 5m, sliding``: every limit of the rule, each
    with its own mode when a cap has several (none from a server that sends no limits)."""
    if not limits:
        return []
    several = len(limits) > 1
    shown = [words(f) + (f" ({f['mode']})" if several and "mode" in f else "") for f in limits]
    return ["  limits: " + "; ".join(shown)]


def _cap_table(cap: dict[str, Any], sort: str) -> list[str]:
    seconds = float(cap["seconds"])
    per = "/s" if seconds > 0 else ""
    head = f"{cap['rule']}  {cap['mode']}"
    limits = _limits_line(cap.get("limits", []))
    if not cap["hits"]:
        return [f"{head}  no requests", *limits, ""]
    lines = [
        f"{head}  last {seconds:.1f} s: {_rate(cap['hits'], seconds).strip()} hits{per}, "
        f"{_rate(cap['rejected'], seconds).strip()} rejected{per}",
        *limits,
    ]
    clients = cap["by_rejections"] if sort == "rejections" else cap["by_demand"]
    several = any(c["cap"] != cap["rule"] for c in clients)
    lines.append(
        f"  {'#':>3}  {'CLIENT':<24}" + (f"  {'CAP':<28}" if several else "")
        + f"  {'HITS' + per:>10}  {'SHARE':>6}  {'REJECTED' + per:>10}"
    )  # fmt: skip
    for rank, c in enumerate(clients, 1):
        lines.append(
            f"  {rank:>3}  {c['client'][:24]:<24}" + (f"  {c['cap'][:28]:<28}" if several else "")
            + f"  {_rate(c['hits'], seconds)}  {c['share']:>6.1%}  {_rate(c['rejected'], seconds)}"
        )  # fmt: skip
    error = max((c["error"] for c in clients), default=0)
    if error:
        lines.append(f"  (counts are upper bounds, at most {error} hits over the true count)")
    lines.append("")
    return lines


def render(snapshot: dict[str, Any], source: str, sort: str, now: float) -> str:
    """One frame: a title line, then a table per cap ranked by ``sort``."""
    stamp = time.strftime("%H:%M:%S", time.gmtime(now))
    lines = [
        f"fairlimit top  {source}  {stamp} UTC  (top {snapshot['n']} per cap by {sort}, "
        f"this {snapshot['scope']})",
        "",
    ]
    if not snapshot["caps"]:
        lines.append("no caps or global buckets configured")
    for cap in snapshot["caps"]:
        lines += _cap_table(cap, sort)
    return "\n".join(lines).rstrip("\n") + "\n"


def run(
    url: str,
    *,
    sort: str,
    once: bool,
    interval: float,
    out: TextIO,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Print one snapshot (``once``; Unreachable when there is none) or redraw for ever."""
    source = urllib.parse.urlsplit(url).netloc
    while True:
        try:
            frame = render(fetch(url), source, sort, time.time())
        except Unreachable as exc:
            if once or isinstance(exc, Refused):
                raise
            frame = f"fairlimit top: cannot read {exc}\n"
        if once:
            out.write(frame)
            out.flush()  # here, not at exit: a closed pipe is the caller's to see
            return 0
        out.write((CLEAR if out.isatty() else "\n") + frame)
        out.flush()
        sleep(interval)
