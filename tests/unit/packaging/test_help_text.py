"""Every flag of every entry point and tool has help text, and no help names its default
twice (a written-out default plus argparse's "(default: ...)", or "(default: None)")."""

import argparse
import importlib.util
import re

import pytest

from pretrain_runner import REPO


class _Captured(Exception):
    """Raised instead of parsing: carries the parser the entry point built."""

    def __init__(self, parser):
        super().__init__()
        self.parser = parser


def _capture(monkeypatch, run) -> argparse.ArgumentParser:
    """The parser ``run()`` builds, taken at its first ``parse_args``."""
    def parse_args(self, *args, **kwargs):
        raise _Captured(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    with pytest.raises(_Captured) as info:
        run()
    return info.value.parser


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"tool_{name}", REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pretrain(family):
    from megatron_ext.defaults import default_extensions
    from megatron_ext.training.pretrain import pretrain

    return lambda: pretrain(family, ["--help"], extensions=default_extensions())


ENTRY_POINTS = {
    "pretrain_llama.py": lambda: _pretrain("llama"),
    "pretrain_gpt.py": lambda: _pretrain("gpt"),
    **{f"tools/{name}.py": (lambda n=name: lambda: _tool(n).main(["--help"]))
       for name in ("convert_checkpoint", "preprocess_data", "make_default_corpus",
                    "snip_analyze", "tune_precision", "plot_precision", "gaussws_hint")},
}


def _walk(parser: argparse.ArgumentParser, prefix: str = ""):
    """(where, parser, action) for every action, subcommands included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                yield f"{prefix}{choice.dest}", parser, choice
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{prefix}{name} ")
        elif not isinstance(action, argparse._HelpAction):
            yield prefix + (action.option_strings or [action.dest])[-1], parser, action


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_every_flag_has_help_and_one_default(entry, monkeypatch):
    parser = _capture(monkeypatch, ENTRY_POINTS[entry]())
    problems = []
    for where, owner, action in _walk(parser):
        if action.help == argparse.SUPPRESS:
            continue
        if not (action.help or "").strip():
            problems.append(f"{where}: no help text")
            continue
        text = owner._get_formatter()._expand_help(action)
        if len(re.findall(r"\bdefault\b", text.lower())) > 1 or "(default: None)" in text:
            problems.append(f"{where}: {text!r}")
    assert not problems, "\n".join(problems)
