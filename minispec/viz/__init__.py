"""General-purpose pictures: token strips for notebooks and terminals, and matplotlib figures of acceptance.

The figures of one notebook live with that notebook's helpers in `minispec.lessons`.
"""
from minispec.viz.strip import AnsiStrip, TokenStrip, ansi_legend, ansi_strip

PLOTS = ("tau_histogram", "per_position_acceptance", "acceptance_vs_temperature", "distribution_pair", "LivePlot")


def __getattr__(name):
    # The figures need matplotlib (the `notebooks` extra); the terminal demo needs only the strips.
    # Loading plots on first use keeps `import minispec.viz` quick, and working without matplotlib.
    if name in PLOTS:
        from minispec.viz import plots

        return getattr(plots, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AnsiStrip", "TokenStrip", "ansi_legend", "ansi_strip", *PLOTS]
