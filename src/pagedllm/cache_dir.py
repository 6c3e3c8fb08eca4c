"""The one folder where pagedllm keeps what it builds or converts once: converted GGUF weights,
tokenizers built from GGUFs, and C++ extensions built on demand.

``$PAGEDLLM_CACHE_DIR`` when set, else ``~/.cache/pagedllm``. A converted GGUF whose file has
changed or gone is removed when another conversion is written (``loader.drop_stale_gguf_caches``).
A folder in it is written by ``folder_written_once``: readers see it whole or not at all, and no
half-written folder outlives its writer's failure.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEDLLM_CACHE_DIR", Path.home() / ".cache" / "pagedllm"))


@contextmanager
def folder_written_once(target: Path) -> Iterator[Path]:
    """A folder of this process's own beside ``target`` to write into; on a clean exit it becomes
    ``target``, unless another process made ``target`` first (then theirs stays). The temporary
    folder never outlives the block: a failed write (a full disk) or a lost race removes it."""
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        yield tmp
        if not target.exists():
            try:
                tmp.replace(target)
            except OSError:
                if not target.exists():  # not another process's folder made meanwhile: a real failure
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
