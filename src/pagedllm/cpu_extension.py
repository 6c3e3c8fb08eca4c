"""Build-once, load-afterwards for the project's C++ extensions (``torch.utils.cpp_extension``).

Each extension is compiled with ``CFLAGS`` (``-O3 -march=native``, OpenMP) into
``<cache>/kernels/<hash>`` (the hash covers the source and the shared headers, the flags, the
torch version and the machine), then loaded from there. A build that fails (no compiler, no
ninja) is remembered: callers get ``None`` plus the reason, and the reason is logged once per
extension.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)
# -fno-trapping-math lets GCC vectorise floorf (used by the polynomial exp); values are unchanged
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"]
SHARED_HEADERS = Path(__file__).parent / "csrc"  # cpu_vec.h: vectors, hsum, exp shared by the extensions


@dataclass
class CppExtension:
    """One C++ source file built into a Python module on first use."""

    stem: str            # module name prefix, e.g. "pagedllm_cpu"
    source: Path
    purpose: str         # for the one warning: "the C++ paged-attention kernel"
    fallback: str        # what happens instead: "using the reference backend"
    module: object | None = None
    failure: str | None = None

    def load(self):
        """The compiled module, or None if it cannot be built here (the reason is in ``failure``)."""
        if self.module is not None or self.failure is not None:
            return self.module
        from torch.utils import cpp_extension

        from pagedllm.models.tokenizer import cache_dir

        src = self.source.read_bytes() + b"".join(h.read_bytes() for h in sorted(SHARED_HEADERS.glob("*.h")))
        key = hashlib.sha1(src + " ".join(CFLAGS).encode() + torch.__version__.encode()
                           + platform.machine().encode()).hexdigest()[:12]
        build = cache_dir() / "kernels" / key
        build.mkdir(parents=True, exist_ok=True)
        try:
            self.module = cpp_extension.load(
                name=f"{self.stem}_{key}", sources=[str(self.source)], build_directory=str(build),
                extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], extra_include_paths=[str(SHARED_HEADERS)],
                verbose=bool(os.environ.get("PAGEDLLM_VERBOSE_BUILD")))
        except Exception as e:  # noqa: BLE001 - no compiler, no ninja, bad flags: all mean "not here"
            lines = str(e).strip().splitlines()
            self.failure = f"{type(e).__name__}: {lines[-1] if lines else ''}"
            log.warning("%s could not be built (%s); %s", self.purpose, self.failure, self.fallback)
            return None
        return self.module
