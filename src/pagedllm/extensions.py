"""Every C++ extension of the package, for ``make``: ``python -m pagedllm.extensions [--build]``.

Without arguments, one line per C++ source: does its installed build fit this machine? With
``--build``, every extension is loaded, and what the installed build does not cover (for
``PAGEDLLM_CPU_FAMILY``'s flags, say) is built into the cache first. Only this tool module knows
the whole list; ``cpu_extension`` (how one extension is loaded) imports none of them.
"""

from __future__ import annotations

import sys

from pagedllm.cpu_extension import installed_builds_report


def build_all() -> list[str]:
    """Load every C++ extension of the package, building into the cache what the installed build
    does not cover (for ``PAGEDLLM_CPU_FAMILY``'s flags, say); one line per extension."""
    from pagedllm.attention.cpu_kernel import EXTENSION as attention
    from pagedllm.models.decoder_stack import EXTENSION as decoder_stack
    from pagedllm.models.layer_ops import EXTENSION as layer_ops

    extensions = (attention, layer_ops, decoder_stack)
    return [f"{e.purpose}: {'loaded' if e.load() is not None else e.failure}" for e in extensions]


if __name__ == "__main__":
    # `python -m pagedllm.extensions`: what the Makefile prints after installing; `--build`: build
    # what does not fit (before `make test CPU_FAMILY=...`, whose suite never compiles)
    if sys.argv[1:] == ["--build"]:
        lines = build_all()
        print("\n".join(lines))
        sys.exit(0 if all(line.endswith(": loaded") for line in lines) else 1)
    print("\n".join(installed_builds_report()))
