"""Every CLI flag, given a value, through the real parser (issue 22): the engine options of each
command reach ``EngineOptions`` as the typed value (``--max-model-len 2048`` once failed as the string
'2048'), and every other flag of every command and subcommand parses a value of its declared type.
Both lists are generated from the parser and the options, so a new flag is covered when added."""

from __future__ import annotations

import argparse
import typing

import pytest
from pydantic import ByteSize

from pagedllm.cli import engine_options, make_parser
from pagedllm.config import EngineOptions, SpeculativeConfig, option_choices, option_fields

# values for options whose default says nothing of a valid value (None, or a str with few values)
SAMPLES = {"model": "org/some-model", "device": "cpu", "kv_cache_scales": "kv_scales.json",
           "kv_events_endpoint": "tcp://*:5557", "kv_events_replay_endpoint": "tcp://*:5558", "kv_events_topic": "kv",
           "speculative_config": '{"method": "suffix", "num_speculative_tokens": 3}'}
PARSED = {"speculative_config": SpeculativeConfig(method="suffix", num_speculative_tokens=3)}  # a flag's value read


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, its parser) for every command and subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from commands(sub, (*path, name))


COMMANDS = dict(commands(make_parser()))
WITH_ENGINE_OPTIONS = [path for path, p in COMMANDS.items() if any(g.title == "engine" for g in p._action_groups)]


def positionals(parser: argparse.ArgumentParser) -> list[str]:
    """Values for a command's required arguments: its positionals (subcommands excluded) and any
    required flags (``trace --workload ... --out ...``)."""
    out = []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction) or a.nargs in ("?", "*"):
            continue
        if a.option_strings and not a.required:
            continue
        out += [*a.option_strings[:1], str(a.choices[0]) if a.choices else "x"]
    return out


def parse(path: tuple[str, ...], *flags: str) -> argparse.Namespace:
    return make_parser().parse_args([*path, *positionals(COMMANDS[path]), *flags])


def engine_values(name: str, info) -> list[tuple[list[str], object]]:
    """(flags, the value ``EngineOptions`` should then hold) for one option: each choice, both
    booleans, a size, an integer other than the default."""
    flag = "--" + name.replace("_", "-")
    choices = option_choices(info.annotation)
    if choices:
        return [([flag, str(c)], c) for c in choices]
    if info.annotation is bool:
        return [([flag], True), (["--no-" + name.replace("_", "-")], False)]
    annotated = typing.get_args(info.annotation) or (info.annotation,)
    if any(isinstance(a, type) and issubclass(a, ByteSize) for a in annotated):
        return [([flag, "3MiB"], ByteSize(3 * 2**20))]
    if info.annotation is int or isinstance(info.default, int) or info.default is None and name not in SAMPLES:
        value = info.default * 2 if isinstance(info.default, int) and info.default else 2048
        return [([flag, str(value)], value)]
    return [([flag, SAMPLES[name]], PARSED.get(name, SAMPLES[name]))]


def engine_group(parser: argparse.ArgumentParser) -> set[str]:
    """The options a command takes as engine flags (all of them, or the bench commands' subset)."""
    return {a.dest for g in parser._action_groups if g.title == "engine" for a in g._group_actions}


@pytest.mark.parametrize("path", WITH_ENGINE_OPTIONS, ids=" ".join)
def test_every_engine_option_flag_reaches_the_options_typed(path):
    names = engine_group(COMMANDS[path])
    assert names <= set(option_fields())
    for name in names:
        for flags, expected in engine_values(name, option_fields()[name]):
            given = {k: v for k, v in engine_options(parse(path, *flags)).items() if k in names}
            opts = EngineOptions(**given)
            assert getattr(opts, name) == expected and type(getattr(opts, name)) is type(expected), (path, flags)


def other_flag_values(action: argparse.Action) -> list[tuple[list[str], object]]:
    flag = action.option_strings[0]
    if isinstance(action, argparse._StoreTrueAction):
        return [([flag], True)]
    if isinstance(action, argparse._StoreFalseAction):
        return [([flag], False)]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [([flag], True), ([action.option_strings[1]], False)]
    if action.choices:
        return [([flag, str(c)], c) for c in action.choices]
    kind = action.type or str
    sample = {int: "7", float: "0.5", str: "text"}[kind]
    if isinstance(action, argparse._AppendAction):
        return [([flag, sample, flag, sample], [kind(sample)] * 2)]
    if action.nargs in ("+", "*"):
        return [([flag, sample, sample], [kind(sample)] * 2)]
    return [([flag, sample], kind(sample))]


@pytest.mark.parametrize("path", list(COMMANDS), ids=" ".join)
def test_every_flag_of_every_command_parses_a_value_of_its_type(path):
    parser = COMMANDS[path]
    engine = engine_group(parser)
    flags = [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)
             and a.dest not in engine and not isinstance(a, argparse._SubParsersAction)]
    for action in flags:
        for argv, expected in other_flag_values(action):
            value = getattr(parse(path, *argv), action.dest)
            assert value == expected and type(value) is type(expected), (path, argv, value)
