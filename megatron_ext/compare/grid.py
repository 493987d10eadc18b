"""A comparison grid: named runs (any pretrain flags) x seeds, from a config file or flags.

A config is a YAML (or JSON) mapping with these keys (only ``runs`` and ``seeds`` required)::

    entry: pretrain_llama.py          # the training script (default)
    base_flags: --train-iters 200 --lr 1e-3      # every run's flags (string or list)
    seeds: [1234, 1235, 1236]         # or "1234,1235,1236"
    reference: fp32                   # paired differences against this run
    group_by: --snip-budget           # rank runs within groups of this flag's value
    random_draws: 4                   # a run with {draw} in its flags: 4 runs NAME.d0-d3
    runs:                             # name -> flags (string or list); "" = base flags only
      fp32: ""
      snip-0.5: --precision snip --snip-budget 0.5

The command line's values replace the config's, ``--base-flags`` is appended to the config's
base flags (pretrain's argparse: a later flag wins) and ``--run`` adds runs. The tool sets
``--seed``, ``--run-dir`` and ``--no-save`` of every job itself, so the flags must not.

``random_draws: K`` makes a random baseline a distribution: every run whose flags contain
the placeholder ``{draw}`` (``--pgq-random --pgq-random-draw {draw}``, ``--precision random
--snip-random-draw {draw}``) becomes the K runs ``NAME.d0`` .. ``NAME.d<K-1>`` with ``{draw}``
replaced by 0 .. K-1: K random plans per training seed (``benchmarks/claims_metrics.py
--draws NAME`` gives the recipe's place among them, a permutation p).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.errors import UsageError

CONFIG_KEYS = ("entry", "base_flags", "seeds", "reference", "group_by", "random_draws",
               "runs")
"""Keys a config may have."""
OWNED_FLAGS = ("--seed", "--run-dir", "--save", "--no-save")
"""Flags the tool sets on every job (the runs' flags must not)."""
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
"""A run name: also a directory name, so letters, digits and ``._+-`` only."""
DRAW = "{draw}"
"""The placeholder of a random draw's index in a run's flags (``random_draws``)."""
DEFAULT_ENTRY = "pretrain_llama.py"
"""The training script when neither config nor flags name one."""


@dataclass(frozen=True)
class RunSpec:
    """One named run of the grid (trained once per seed)."""

    name: str
    """Unique name; the run's directory is ``OUT/runs/<name>/seed_<seed>``."""
    flags: tuple[str, ...]
    """Its pretrain flags, after the grid's base flags."""


@dataclass(frozen=True)
class Grid:
    """Everything that decides which jobs run and how their results are compared."""

    runs: tuple[RunSpec, ...]
    """The runs, in config order (also the order of the tables)."""
    seeds: tuple[int, ...]
    """Every run is trained once per seed (same init and data order across runs)."""
    entry: str = DEFAULT_ENTRY
    """The training script, as given (resolved by :func:`resolve_entry`)."""
    base_flags: tuple[str, ...] = ()
    """Flags of every run, before its own."""
    reference: str | None = None
    """Name of the run the paired differences are taken against (None: no differences)."""
    group_by: str | None = None
    """A flag (``--snip-budget``): runs are ranked among those with the same value of it."""

    def flags(self, run: RunSpec) -> tuple[str, ...]:
        """The run's whole flag list: base flags, then its own."""
        return (*self.base_flags, *run.flags)

    def group_of(self, run: RunSpec) -> str | None:
        """The value of ``group_by`` in the run's flags (the last one given), or None."""
        return flag_value(self.flags(run), self.group_by) if self.group_by else None


def flag_value(flags: tuple[str, ...], flag: str) -> str | None:
    """The value of the last ``flag VALUE`` or ``flag=VALUE`` in ``flags``, or None."""
    value = None
    for i, item in enumerate(flags):
        if item == flag and i + 1 < len(flags):
            value = flags[i + 1]
        elif item.startswith(flag + "="):
            value = item[len(flag) + 1:]
    return value


# ------------------------------------------------------------------------------ parsing


def parse_flags(value, where: str) -> tuple[str, ...]:
    """A flag list from a shell-quoted string or a list of strings."""
    if value is None:
        raise UsageError(f"{where}: flags missing (write \"\" for none)")
    if isinstance(value, str):
        try:
            return tuple(shlex.split(value))
        except ValueError as exc:
            raise UsageError(f"{where}: cannot split {value!r}: {exc}") from None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise UsageError(f"{where}: expected a string of flags or a list of strings, "
                     f"got {value!r}")


def parse_seeds(value, where: str) -> tuple[int, ...]:
    """Seeds from ``"1,2,3"`` (or ``"1 2 3"``), ``[1, 2, 3]`` or ``1``: non-negative,
    distinct, at least one."""
    items = (re.split(r"[,\s]+", value.strip()) if isinstance(value, str) else
             value if isinstance(value, list) else [value])
    try:
        seeds = tuple(int(s) if isinstance(s, str) else s for s in items)
    except ValueError:
        raise UsageError(f"{where}: {value!r} is not a comma-separated list of "
                         "integers") from None
    if not seeds or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                            for s in seeds):
        raise UsageError(f"{where}: {value!r} is not a list of non-negative integers")
    if len(set(seeds)) != len(seeds):
        raise UsageError(f"{where}: {value!r} repeats a seed")
    return seeds


def parse_run_arg(text: str) -> tuple[str, str]:
    """``NAME=FLAGS`` of ``--run`` -> (name, flags string)."""
    name, sep, flags = text.partition("=")
    if not sep:
        raise UsageError(f"--run {text!r}: expected NAME=FLAGS (NAME= for the base flags "
                         "alone)")
    return name.strip(), flags


def _parse_text(path: str, text: str):
    """JSON for a ``.json`` file, YAML otherwise; a syntax error is one line."""
    if path.endswith(".json"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}: not valid JSON: {exc}") from None
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UsageError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None


def load_config(path: str) -> dict:
    """The config mapping of ``path``; unknown keys are an error."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--config: cannot read '{path}': {exc.strerror}") from None
    data = _parse_text(path, text)
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a mapping with keys {', '.join(CONFIG_KEYS)}")
    unknown = [k for k in data if k not in CONFIG_KEYS]
    if unknown:
        raise UsageError(f"{path}: unknown key {unknown[0]!r} (known: "
                         f"{', '.join(CONFIG_KEYS)})")
    return data


# ------------------------------------------------------------------------------ building


def _check_flags(flags: tuple[str, ...], where: str) -> None:
    for flag in flags:
        if flag.split("=")[0] in OWNED_FLAGS:
            raise UsageError(f"{where}: {flag.split('=')[0]} is set by the tool on every job "
                             "(seeds: --seeds; run directories: OUT/runs/NAME/seed_S)")


def _runs(config_runs, extra: list[str]) -> tuple[RunSpec, ...]:
    if config_runs is not None and not isinstance(config_runs, dict):
        raise UsageError("runs: expected a mapping NAME: FLAGS")
    named = [(str(n), parse_flags(f, f"runs.{n}")) for n, f in (config_runs or {}).items()]
    for text in extra:
        name, flags = parse_run_arg(text)
        named.append((name, parse_flags(flags, f"--run {name}")))
    if not named:
        raise UsageError("no runs: give --run NAME=FLAGS or a --config with runs")
    seen = set()
    for name, flags in named:
        if not NAME.fullmatch(name):
            raise UsageError(f"run name {name!r}: use letters, digits and ._+- only")
        if name in seen:
            raise UsageError(f"run {name!r} is given twice")
        seen.add(name)
        _check_flags(flags, f"run {name}")
    return tuple(RunSpec(n, f) for n, f in named)


def expand_draws(runs: tuple[RunSpec, ...], draws) -> tuple[RunSpec, ...]:
    """Each run with :data:`DRAW` in its flags as ``draws`` runs ``NAME.d<i>`` (None: as
    given, the placeholder then an error)."""
    has = [r for r in runs if any(DRAW in f for f in r.flags)]
    if draws is None:
        if has:
            raise UsageError(f"run {has[0].name}: {DRAW} in its flags needs random_draws "
                             "(--random-draws K)")
        return runs
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise UsageError(f"random_draws: expected a positive integer, got {draws!r}")
    if not has:
        raise UsageError(f"random_draws {draws}: no run has {DRAW} in its flags")
    out = []
    for run in runs:
        if run in has:
            out += [RunSpec(f"{run.name}.d{i}", tuple(f.replace(DRAW, str(i)) for f in run.flags))
                    for i in range(draws)]
        else:
            out.append(run)
    return tuple(out)


def _group_flag(value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip("-"):
        raise UsageError(f"group_by: expected a flag name like --snip-budget, got {value!r}")
    return "--" + value.lstrip("-")


def build_grid(config: dict, cli: dict, extra_runs: list[str]) -> Grid:
    """The grid from a config mapping, the command line's values (None = not given) and
    ``--run`` texts; every check that needs no file system."""
    merged = {**config, **{k: v for k, v in cli.items() if v is not None}}
    if merged.get("seeds") is None:
        raise UsageError("no seeds: give --seeds 1,2,3 or seeds: in the config")
    base = (*parse_flags(config.get("base_flags", ""), "base_flags"),
            *parse_flags(cli.get("base_flags") or "", "--base-flags"))
    _check_flags(base, "base flags")
    entry = merged.get("entry", DEFAULT_ENTRY)
    if not isinstance(entry, str) or not entry:
        raise UsageError(f"entry: expected a script path, got {entry!r}")
    runs = expand_draws(_runs(config.get("runs"), extra_runs), merged.get("random_draws"))
    grid = Grid(runs, parse_seeds(merged["seeds"], "seeds"),
                entry, base, merged.get("reference"), _group_flag(merged.get("group_by")))
    names = [r.name for r in grid.runs]
    if grid.reference is not None and grid.reference not in names:
        raise UsageError(f"reference {grid.reference!r} is not one of the runs "
                         f"({', '.join(names)})")
    if grid.group_by and all(grid.group_of(r) is None for r in grid.runs):
        raise UsageError(f"group_by {grid.group_by}: no run has that flag")
    return grid


def resolve_entry(entry: str, repo: Path) -> Path:
    """The training script: ``entry`` as a path (from the working directory), else relative
    to the repository root."""
    for path in (Path(entry), repo / entry):
        if path.is_file():
            return path.resolve()
    raise UsageError(f"entry {entry!r}: no such file (here or in {repo})")
