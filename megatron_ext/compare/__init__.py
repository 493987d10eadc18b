"""Compare precision runs: a grid of runs (any pretrain flags) x seeds, trained in parallel,
scored by final validation loss with standard errors and paired differences (docs/compare.md).

* :mod:`.grid` — the grid from a YAML / JSON config and command-line flags, checked;
* :mod:`.jobs` — one job's directory, command, completion mark and metrics;
* :mod:`.runner` — training the unfinished jobs ``--jobs`` at a time, with progress and ETA;
* :mod:`.stats` — mean, standard error, paired differences, ranks (the math);
* :mod:`.results` — ``results.json``; :mod:`.report` — ``results.md``; :mod:`.figures` — PNGs;
* :mod:`.cli` — ``tools/compare_precision.py``'s command line.

Nothing here imports torch, a method or ``megatron_ext.precision``: the cost model's numbers
(``fp4_flop_frac``, ``gemm_time_vs_bf16``) are read from each run's ``metrics.jsonl``.
"""
