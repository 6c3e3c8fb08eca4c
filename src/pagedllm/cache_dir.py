"""The one folder where pagedllm keeps what it builds or converts once: converted GGUF weights,
tokenizers built from GGUFs, and C++ extensions built on demand.

``$PAGEDLLM_CACHE_DIR`` when set, else ``~/.cache/pagedllm``. A converted GGUF whose file has
changed or gone is removed when another conversion is written (``loader.drop_stale_gguf_caches``).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEDLLM_CACHE_DIR", Path.home() / ".cache" / "pagedllm"))
