"""Wall-clock timers for benchmark reports: the median of repeated calls, and the time spent inside
one method of an object, summed over calls."""

from __future__ import annotations

import statistics
import time


def median_ms(fn, repeats: int, warmup: bool = True) -> float:
    """Median milliseconds of ``repeats`` calls of ``fn()`` (after one untimed call with ``warmup``)."""
    if warmup:
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return 1000 * statistics.median(samples)


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
