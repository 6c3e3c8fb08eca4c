"""Wall-clock time spent inside one method of an object, summed over calls (for benchmark reports)."""

from __future__ import annotations

import time


def time_calls(obj, name: str, bucket: list[float]) -> None:
    """Replace ``obj.name`` by a wrapper that adds each call's seconds to ``bucket[0]``."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            bucket[0] += time.perf_counter() - t0

    setattr(obj, name, wrapper)
