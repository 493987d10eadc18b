"""Plots of precision plans, their refreshes, SNIP divergences and loss curves (docs/plots.md).

:mod:`.inputs` reads the files, :mod:`.plots` draws the figures (matplotlib, Agg canvas, PNG
written atomically), :mod:`.colors` gives each number-format family its stable colour, and
:mod:`.cli` is ``tools/plot_precision.py``'s command line.
"""
