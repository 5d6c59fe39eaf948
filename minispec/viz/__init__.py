"""Live acceptance visualizations: token strips for notebooks and terminals, and matplotlib figures."""
from minispec.viz.strip import AnsiStrip, TokenStrip, ansi_legend, ansi_strip

PLOTS = ("tau_histogram", "per_position_acceptance", "acceptance_vs_temperature", "distribution_pair", "LivePlot")
# The interactive and figure pieces of the teaching notebooks (minispec/viz/lessons.py), loaded on first use too.
LESSONS = ("speedup_curve", "acceptance_explorer", "acceptance_figure", "convergence_figure", "speculative_draws",
           "verification_table", "temperature_sweep", "draft_agreement", "predicted_acceptance")


def __getattr__(name):
    # The figures need matplotlib (the `notebooks` extra); the terminal demo needs only the strips.
    # Loading plots on first use keeps `import minispec.viz` quick, and working without matplotlib.
    if name in PLOTS:
        from minispec.viz import plots

        return getattr(plots, name)
    if name in LESSONS:
        from minispec.viz import lessons

        return getattr(lessons, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AnsiStrip", "TokenStrip", "ansi_legend", "ansi_strip", *PLOTS]
__all__ += list(LESSONS)
