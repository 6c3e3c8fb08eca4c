"""Argument helpers the subcommands share: one flag per engine option, sampling flags, trace sources.

A leaf of the command line: ``cli.py`` (the table of subcommands) and every command module that
declares its own flags (``add_cli_args``) import these; this module imports only ``config``.
"""

from __future__ import annotations

import argparse
import math
import typing


def _flag_type(annotation) -> type:
    """bool, int or str: how a flag of this option's annotation is parsed."""
    from pydantic import ByteSize

    if typing.get_origin(annotation) is typing.Annotated:  # PositiveInt = Annotated[int, Gt(0)]
        return _flag_type(typing.get_args(annotation)[0])
    for a in typing.get_args(annotation) or (annotation,):  # X | None: X's type
        if typing.get_origin(a) is typing.Annotated:
            return _flag_type(a)
        a = typing.get_origin(a) or a
        if isinstance(a, type) and issubclass(a, ByteSize):
            return str  # "512MiB"
        if a in (bool, int):
            return a
    return str


def add_option_args(p: argparse.ArgumentParser, only: tuple[str, ...] | None = None,
                    defaults: dict | None = None) -> None:
    """One flag per engine option (``pagedllm.config.EngineOptions``): ``--block-size`` for
    ``block_size``, with its default, choices and help; booleans as ``--x/--no-x``."""
    from pagedllm.config import option_choices, option_fields

    g = p.add_argument_group("engine")
    for name, info in option_fields().items():
        if only is not None and name not in only:
            continue
        flag = "--" + name.replace("_", "-")
        default = (defaults or {}).get(name, info.default)
        kind = _flag_type(info.annotation)
        text = (info.description or "").replace("%", "%%")  # argparse formats help with %
        if kind is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
        else:
            g.add_argument(flag, type=kind, default=default, choices=option_choices(info.annotation), help=text)


def engine_options(args) -> dict:
    """The engine options a parsed command line carries."""
    from pagedllm.config import option_fields

    return {name: getattr(args, name) for name in option_fields() if hasattr(args, name)}


def add_trace_source(p: argparse.ArgumentParser, workload: str = "sharegpt", num_requests: int = 1000,
                     seed: bool = True) -> None:
    """``--trace FILE``, or a generated ``--workload`` with ``--num-requests``, ``--rate`` (and ``--seed``)."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", default=None, help="a JSONL trace (pagedllm trace writes one)")
    src.add_argument("--workload", default=workload, choices=["sharegpt", "alpaca", "chat", "code"],
                     help="generate the trace instead (with --num-requests, --rate, --seed)")
    p.add_argument("--num-requests", type=int, default=num_requests)
    p.add_argument("--rate", type=float, default=math.inf,
                   help="Poisson arrivals per second (chat: conversations per second; inf: all at t=0)")
    if seed:
        p.add_argument("--seed", type=int, default=0)


def add_shape_presets(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-2-13b", help="a model shape preset (see docs/simulator.md)")
    p.add_argument("--device", default="a100-80gb", help="a device preset (see docs/simulator.md)")


def add_serve_workload_args(p: argparse.ArgumentParser) -> None:
    """The prompts of ``bench serve`` and ``bench serve-offline``: counts, lengths, concurrency, or a trace."""
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", default="128", help="prompt words (one token each in SmolLM2): N or MIN:MAX")
    p.add_argument("--output-len", default="128", help="output tokens (max_tokens + ignore_eos): N or MIN:MAX")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    p.add_argument("--num-warmups", type=int, default=1, help="short untimed requests first")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--trace", default=None, help="a JSONL trace (pagedllm trace): its requests, output lengths "
                                                 "and arrival times instead of the prompts above")
