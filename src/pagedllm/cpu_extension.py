"""Loading the project's C++ extensions: the installed build when it fits, else one built on demand.

``pip install`` (``setup.py``) builds every ``<pkg>/csrc/<name>.cpp`` into the module
``pagedllm.<pkg>._<name>`` and writes a ``BuildRecord`` next to it. ``CppExtension.load`` uses
that build only when the record matches this process (same sources, flags and torch, and no
instruction set this CPU lacks: ``build_record.why_unusable``). Otherwise it compiles the
source with ``torch.utils.cpp_extension.load`` into ``<cache>/kernels/<key>``, the key covering
everything the record holds (``build_record.cache_key``), after one line on stderr; with
``PAGEDLLM_NO_BUILD=1`` it does not compile, but still imports a build already in the cache
(``python -m pagedllm.extensions --build`` makes them: ``make test CPU_FAMILY=...``). A build
that cannot be had (no compiler, no ninja, builds turned off) is remembered: callers get ``None``
plus the reason, logged once per extension.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from pagedllm.build_record import (
    CFLAGS,
    LDFLAGS,
    PACKAGE_ROOT,
    RECORD_SUFFIX,
    SHARED_HEADERS,
    BuildRecord,
    cache_key,
    installed_module_name,
    why_unusable,
)
from pagedllm.cache_dir import cache_dir

log = logging.getLogger(__name__)
NO_BUILD_ENV = "PAGEDLLM_NO_BUILD"  # "1": never compile at run time, use only an installed build


def on_demand_builds_disabled() -> bool:
    return os.environ.get(NO_BUILD_ENV, "").strip().lower() not in ("", "0", "false", "no")


@dataclass
class CppExtension:
    """One C++ source file, loaded from its installed build or built into the cache on first use."""

    stem: str            # module name prefix of on-demand builds, e.g. "pagedllm_cpu"
    source: Path
    purpose: str         # for the messages: "the C++ paged-attention kernel"
    fallback: str        # what happens instead: "using the reference backend"
    module: object | None = None
    failure: str | None = None

    def load(self):
        """The compiled module, or None if it cannot be had here (the reason is in ``failure``)."""
        if self.module is not None or self.failure is not None:
            return self.module
        here = BuildRecord.here(self.source)
        self.module, why_not_installed = load_installed(self.source, here)
        if self.module is not None:
            return self.module
        if on_demand_builds_disabled():
            self.module = load_cached(self.stem, here)
            if self.module is not None:
                return self.module
            return self._fail("is unavailable", f"{why_not_installed}, and on-demand builds are off ({NO_BUILD_ENV}=1)")
        try:
            self.module = build_on_demand(self.stem, self.source, here, self.purpose, why_not_installed)
        except Exception as e:  # noqa: BLE001 - no compiler, no ninja, bad flags: all mean "not here"
            lines = str(e).strip().splitlines()
            return self._fail("could not be built", f"{type(e).__name__}: {lines[-1] if lines else ''}")
        return self.module

    def _fail(self, what: str, reason: str) -> None:
        self.failure = reason
        log.warning("%s %s (%s); %s", self.purpose, what, reason, self.fallback)
        return None


def installed_record_path(module_file: Path) -> Path:
    """``.../_name.cpython-311-x86_64-linux-gnu.so`` -> ``.../_name.build.json``."""
    return module_file.with_name(module_file.name.split(".")[0] + RECORD_SUFFIX)


def load_installed(source: Path, here: BuildRecord):
    """``(module, None)`` when the installed build of ``source`` fits ``here``, else ``(None, why not)``."""
    name = installed_module_name(source)
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        return None, "there is no installed build"
    record = installed_record_path(Path(spec.origin))
    try:
        built = BuildRecord.from_json(record.read_text())
    except (OSError, ValueError, KeyError) as e:
        return None, f"the installed build has no readable record {record.name} ({type(e).__name__})"
    reason = why_unusable(built, here)
    if reason is not None:
        return None, f"the installed build was {reason}"
    try:
        return importlib.import_module(name), None
    except ImportError as e:
        return None, f"the installed build does not import ({e})"


def cached_build(stem: str, here: BuildRecord) -> tuple[str, Path]:
    """The module name and folder of the on-demand build of ``stem`` for ``here``."""
    key = cache_key(here)
    return f"{stem}_{key}", cache_dir() / "kernels" / key


def load_cached(stem: str, here: BuildRecord):
    """The on-demand build for ``here`` if one was made before (the cache key covers sources,
    flags, torch and CPU), imported without compiling; else None."""
    name, build = cached_build(stem, here)
    library = build / f"{name}.so"
    if not library.exists():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_on_demand(stem: str, source: Path, here: BuildRecord, purpose: str, why: str):
    """Compile ``source`` into the cache, saying so in one line on stderr, or load it from there if
    built before; then import it."""
    from torch.utils import cpp_extension

    name, build = cached_build(stem, here)
    if not (build / f"{name}.so").exists():
        print(f"pagedllm: building {purpose} for this CPU (once, about 30 s; {why})...", file=sys.stderr, flush=True)
    build.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=name, sources=[str(source)], build_directory=str(build),
        extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), extra_include_paths=[str(SHARED_HEADERS)],
        verbose=bool(os.environ.get("PAGEDLLM_VERBOSE_BUILD")))


def installed_builds_report() -> list[str]:
    """One line per C++ source of the package: is its installed build the one that will be used?"""
    lines = []
    for source in sorted(PACKAGE_ROOT.glob("*/csrc/*.cpp")):
        module, why_not = load_installed(source, BuildRecord.here(source))
        lines.append(f"{installed_module_name(source)}: {'installed build fits' if module else why_not}")
    return lines
