"""One definition of the engine options: the CLI flags, ``LLM(...)`` keywords and the docs' option
table all come from (and are checked against) ``pagedllm.config.EngineOptions``."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pagedllm.cli import make_parser
from pagedllm.config import (
    CacheConfig,
    EngineOptions,
    EventsConfig,
    LoadOptions,
    SchedulerConfig,
    SpeculationOptions,
    option_choices,
    option_fields,
)
from pagedllm.errors import ConfigError

DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_cli_flags_are_exactly_the_engine_options(command):
    actions = {a.dest: a for a in subparser(command)._actions}
    for name, info in option_fields().items():
        action = actions[name]
        assert action.option_strings[0] == "--" + name.replace("_", "-")
        assert action.default == info.default
        assert action.help.replace("%%", "%") == info.description  # argparse shows %% as %
        choices = option_choices(info.annotation)
        assert (tuple(action.choices) if action.choices else None) == choices
    engine_group = next(g for g in subparser(command)._action_groups if g.title == "engine")
    assert {a.dest for a in engine_group._group_actions} == set(option_fields())


def test_parsed_flags_build_valid_options():
    from pagedllm.cli import engine_options

    args = make_parser().parse_args(["generate", "hi", "--block-size", "32", "--kv-cache-memory", "1GiB",
                                     "--no-enable-prefix-caching", "--eviction-policy", "lfu"])
    opts = EngineOptions(**engine_options(args))
    assert (opts.block_size, opts.kv_cache_memory, opts.enable_prefix_caching, opts.eviction_policy) == \
        (32, 2**30, False, "lfu")


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_optional_integer_flags_parse_as_integers(command):
    """``PositiveInt | None`` options (``max_model_len``, ``num_kv_blocks``, ``max_num_batched_tokens``)
    were parsed as strings, so ``--max-model-len 2048`` failed validation."""
    from pagedllm.cli import engine_options

    argv = [command, *(["hi"] if command == "generate" else []), "--max-model-len", "2048", "--num-kv-blocks", "64",
            "--max-num-batched-tokens", "4096"]
    opts = EngineOptions(**engine_options(make_parser().parse_args(argv)))
    assert (opts.max_model_len, opts.num_kv_blocks, opts.max_num_batched_tokens) == (2048, 64, 4096)


def test_docs_option_table_is_generated_from_the_options():
    from pagedllm.config import options_markdown

    text = DOCS.read_text()
    start, end = "<!-- options:start -->\n", "<!-- options:end -->"
    table = text[text.index(start) + len(start):text.index(end)]
    assert table == options_markdown(), "regenerate it: python -m pagedllm.config > table, paste into docs/api.md"


def test_every_option_has_one_definition_and_the_component_defaults_agree():
    fields = option_fields()
    parts = [option_fields(c) for c in (LoadOptions, SchedulerConfig, CacheConfig, EventsConfig, SpeculationOptions)]
    assert set(fields) == set().union(*parts) and sum(map(len, parts)) == len(fields)
    for part in parts:
        for name, info in part.items():
            if name not in ("max_model_len", "max_num_batched_tokens"):  # None in the options: resolved per model, CPU
                assert fields[name].default == info.default
    assert all(info.description for info in fields.values())


def test_llm_rejects_an_unknown_option_before_loading_anything():
    from pagedllm import LLM

    with pytest.raises(ConfigError, match="unknown option 'blocksize'"):
        LLM(blocksize=16)
    with pytest.raises(ConfigError, match="block_size: Input should be greater than or equal to 8"):
        LLM(block_size=4)


def test_the_step_budget_is_the_cpu_familys_unless_given():
    opts = EngineOptions()
    assert opts.max_num_batched_tokens is None
    assert opts.scheduler_config(512, step_tokens=2048).max_num_batched_tokens == 2048
    assert opts.scheduler_config(512).max_num_batched_tokens == SchedulerConfig().max_num_batched_tokens == 1024
    given = EngineOptions(max_num_batched_tokens=300)
    assert given.scheduler_config(512, step_tokens=2048).max_num_batched_tokens == 300
