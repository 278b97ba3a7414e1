"""The admitted rate per client and second, drawn with matplotlib (the ``plot`` extra)."""

import importlib
from pathlib import Path
from typing import Any

from fairlimit.simulate.report import Result

PLOT_HINT = "--plot needs matplotlib: pip install 'fairlimit[plot]'"


def plotting() -> Any:
    """matplotlib's ``figure`` module; ModuleNotFoundError (PLOT_HINT) without the extra."""
    try:
        # Imported by name: matplotlib is an optional extra, and mypy must pass without it.
        return importlib.import_module("matplotlib.figure")
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(PLOT_HINT) from exc


def plot(result: Result, out: str | Path) -> None:
    """Admitted rate per client and second, one panel per config, written to ``out``.

    Raises ModuleNotFoundError (PLOT_HINT) without the ``plot`` extra, OSError if unwritable.
    """
    figure_module = plotting()
    panels = len(result.configs)
    figure = figure_module.Figure(figsize=(9, 3.2 * panels), layout="constrained")
    axes = figure.subplots(panels, 1, sharex=True, squeeze=False)
    for ax, config in zip(axes[:, 0], result.configs, strict=True):
        for client in config.clients:
            seconds = list(range(len(client.per_second) + 1))
            rates = [*client.per_second, client.per_second[-1] if client.per_second else 0]
            ax.step(seconds, rates, where="post", label=client.name, linewidth=1.2)
        if config.cap is not None:
            ax.axhline(
                config.cap.limit / config.cap.window,
                color="black",
                linestyle="--",
                linewidth=0.8,
                label="cap",
            )
        ax.set_title(f"{config.label}: admitted requests per second")
        ax.set_ylabel("admitted/s")
        ax.set_ylim(bottom=0)
    axes[-1, 0].set_xlabel(f"scenario time (s): {result.summary.name}")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside right upper", fontsize="small")
    figure.savefig(out, dpi=100)
