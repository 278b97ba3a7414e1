"""What each config admitted, drawn with matplotlib (the ``plot`` extra).

One panel per config, on the same axes: the hits admitted, stacked by group of identical
clients (one band each), against the cap and λ. For a per-second cap the y axis is hits per
second; for a longer window it is the hits admitted so far in the current window, so the
stack climbs to the cap and starts again at each window: how a burst at second 0 or a late
arrival shares a minute shows at a glance. When a config's shared limit is ``sliding`` or
``gcra``, every panel draws instead the hits admitted in the last window's length, so a
fixed window's two limits across an edge show beside the smooth ones.
"""

import importlib
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fairlimit.simulate.report import ConfigResult, Result

PLOT_HINT = "--plot needs matplotlib: pip install 'fairlimit[plot]'"
DPI = 100
MAX_BANDS = 8  # groups drawn apart; the rest share one band (10 colours cycle)
OTHERS = "\0others"  # the merged band's key: no group's name
UNITS = {1: "second", 60: "minute", 3600: "hour", 86400: "day"}


def plotting() -> Any:
    """matplotlib's ``figure`` module; ModuleNotFoundError (PLOT_HINT) without the extra."""
    try:
        # Imported by name: matplotlib is an optional extra, and mypy must pass without it.
        return importlib.import_module("matplotlib.figure")
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(PLOT_HINT) from exc


def bands(config: ConfigResult, window: int, trailing: bool = False) -> dict[str, list[float]]:
    """Per group (in order of first client), the hits to draw at each second's end: so far
    in the window, or (``trailing``) in the last ``window`` seconds."""
    out: dict[str, list[float]] = {}
    for client in config.clients:
        name = client.group or client.name
        per_second = client.per_second
        series = _in_last(per_second, window) if trailing else _so_far(per_second, window)
        if name in out:
            out[name] = [a + b for a, b in zip(out[name], series, strict=True)]
        else:
            out[name] = series
    return out


def _so_far(per_second: Sequence[int], window: int) -> list[float]:
    """Per second: admitted in that second (window 1 s) or so far in its window."""
    out, total = [], 0.0
    for second, hits in enumerate(per_second):
        total = hits if second % window == 0 else total + hits
        out.append(total)
    return out


def _in_last(per_second: Sequence[int], window: int) -> list[float]:
    """Per second: admitted in the ``window`` seconds that end with it."""
    out, total = [], 0.0
    for second, hits in enumerate(per_second):
        total += hits - (per_second[second - window] if second >= window else 0)
        out.append(total)
    return out


def _counts(result: Result) -> dict[str, int]:
    """Clients per group (in order of first client)."""
    counts: dict[str, int] = {}
    for client in result.configs[0].clients:
        name = client.group or client.name
        counts[name] = counts.get(name, 0) + 1
    return counts


def _labels(result: Result, others: set[str]) -> dict[str, str]:
    """Band labels: a group of several clients says how many; the groups merged into one
    band are ``OTHERS``, saying how many clients."""
    counts = _counts(result)
    labels = {g: f"{g} (x{n})" if n > 1 else g for g, n in counts.items()}
    merged = sum(counts[g] for g in others)
    labels[OTHERS] = f"{merged} other clients"
    return labels


def _others(result: Result) -> set[str]:
    """The groups drawn as one band: past MAX_BANDS groups (a legend of 41 entries says
    nothing), all but the MAX_BANDS - 1 that were admitted most in all configs together."""
    totals = dict.fromkeys(_counts(result), 0)
    for config in result.configs:
        for client in config.clients:
            totals[client.group or client.name] += sum(client.per_second)
    if len(totals) <= MAX_BANDS:
        return set()
    ranked = sorted(totals, key=lambda g: totals[g], reverse=True)
    return set(ranked[MAX_BANDS - 1 :])


def _merged(series: dict[str, list[float]], others: set[str]) -> dict[str, list[float]]:
    """``series`` with the ``others`` groups summed into one band, drawn last (on top)."""
    if not others:
        return series
    kept = {g: ys for g, ys in series.items() if g not in others}
    rest = [ys for g, ys in series.items() if g in others]
    kept[OTHERS] = [sum(values) for values in zip(*rest, strict=True)]
    return kept


def _title(config: ConfigResult) -> str:
    cap = config.cap
    if cap is None:
        return f"{config.label}: no limit shared by every client"
    measured = [w for w in config.windows if w.complete and w.achievable > 0]
    achievable = sum(w.achievable for w in measured)
    used = sum(w.admitted for w in measured) / achievable if achievable else 1.0
    verdict = "EXCEEDED" if any(c.exceeded for c in config.levels) else "never exceeded"
    # two lines: the figures of a long rule path or label no longer run off the right edge
    if cap.smooth:
        return (
            f"{config.label}: {cap.path} ({cap.algorithm})\n"
            f"max {cap.max_in_span}/{cap.bound} in any {cap.window} s, caps {verdict}"
        )
    edge = (
        f", {cap.max_in_span} in some {cap.window} s" if cap.max_in_span > cap.max_admitted else ""
    )
    return (
        f"{config.label}: {cap.path}\nutilisation {used:.2f} of achievable  |  "
        f"max {cap.max_admitted}/{cap.limit} per window{edge}, caps {verdict}"
    )


def _panel(
    ax: Any,
    config: ConfigResult,
    window: int,
    labels: dict[str, str],
    trailing: bool,
    others: set[str],
) -> None:
    series = _merged(bands(config, window, trailing), others)
    seconds = len(next(iter(series.values()), []))
    x = [s + 1 for s in range(seconds)]  # drawn at the end of each second
    colours = [f"C{i % 10}" for i in range(len(series))]
    ax.stackplot(
        [0, *x],
        *[[0.0, *ys] for ys in series.values()],
        labels=[labels.get(g, g) for g in series],
        colors=colours,
        alpha=0.85,
        step="pre",
    )
    if config.cap is not None:
        ax.axhline(config.cap.limit, color="black", linestyle="--", linewidth=1.2, label="cap")
        if config.cap.burst:
            ax.axhline(config.cap.bound, color="black", linestyle="-.", linewidth=1,
                       label="cap + gcra burst")  # fmt: skip
    levels = [
        math.nan if v is None or math.isinf(v) else v for v in config.levels_per_second[:seconds]
    ]
    if any(not math.isnan(v) for v in levels):
        ax.step(x[: len(levels)], levels, where="pre", color="black", linestyle=":", linewidth=2,
                label="λ: the fair share of one child of the cap")  # fmt: skip
    ax.set_title(_title(config), fontsize="medium", loc="left")
    ax.grid(axis="y", alpha=0.3)


def plot(result: Result, out: str | Path) -> None:
    """Admitted hits per group, one panel per config, written to ``out``.

    Raises ModuleNotFoundError (PLOT_HINT) without the ``plot`` extra, OSError if unwritable.
    """
    figure(result).savefig(out, dpi=DPI)


def figure(result: Result) -> Any:
    """The matplotlib Figure ``plot`` writes (ModuleNotFoundError without the extra)."""
    figure_module = plotting()
    panels = len(result.configs)
    drawn = figure_module.Figure(figsize=(11, 3.4 * panels), layout="constrained")
    axes = drawn.subplots(panels, 1, sharex=True, sharey=True, squeeze=False)
    caps = [c.cap for c in result.configs if c.cap is not None]
    window = caps[0].window if caps else 1
    others = _others(result)
    labels = _labels(result, others)
    trailing = window > 1 and any(c.smooth for c in caps)
    unit = UNITS.get(window, f"{window} s")
    if window == 1:
        ylabel = "admitted per second"
    else:
        ylabel = f"admitted in the last {window} s" if trailing else f"admitted so far this {unit}"
    for ax, config in zip(axes[:, 0], result.configs, strict=True):
        _panel(ax, config, window, labels, trailing, others)
        ax.set_ylabel(ylabel)
    # once every panel is drawn: the shared y axis then spans all of them (set in the first
    # panel, it froze the top at that panel's data and cut the later ones' bars)
    axes[0, 0].set_ylim(bottom=0)
    axes[-1, 0].set_xlabel("scenario time (s)")
    drawn.suptitle(f"fairlimit simulate: {result.summary.name}", fontsize="large")
    shown: dict[str, Any] = {}
    for ax in axes[:, 0]:
        for handle, name in zip(*ax.get_legend_handles_labels(), strict=True):
            shown.setdefault(name, handle)
    names = list(shown)[::-1]  # bands top-down, as stacked, under the cap and λ
    drawn.legend(
        [shown[n] for n in names],
        names,
        loc="outside lower center",
        ncols=min(len(names), 5),
        fontsize="small",
    )
    return drawn
