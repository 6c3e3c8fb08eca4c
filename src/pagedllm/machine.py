"""What a benchmark report says about the machine and about CPU time spent.

``machine_info()`` names the CPU (model name, the vector flags from /proc/cpuinfo that decide
the kernels: avx2, fma, avx512*, amx*, avx_vnni, avx_ne_convert, and the family the engine plans
for, which ``PAGEDLLM_CPU_FAMILY`` may have lowered; the core count);
``process_cpu_seconds(pid)`` reads another process's user + system CPU time from /proc/<pid>/stat,
and ``CpuClock`` measures this process's own CPU time over a stretch of code, so a report can
separate a load generator's share of the cores from the server's; it also records
the hypervisor's steal time over the stretch (``machine_steal_seconds``), so a slow run on a
shared machine says why.
"""

from __future__ import annotations

import os
import platform
import resource
import time
from dataclasses import dataclass

THREADING_ENV = ("OMP_", "GOMP_", "KMP_", "MKL_NUM_THREADS")
KERNEL_FLAGS = ("avx2", "fma", "avx512", "amx", "avx_vnni", "avx_ne_convert")  # prefixes


def _cpuinfo_field(text: str, name: str) -> str | None:
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def machine_info() -> dict:
    """CPU model name, logical core count, SIMD flags of interest, Python, and the environment
    variables that change how OpenMP threads wait (they decide figures on a busy machine)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        text = ""
    from pagedllm.cpu_features import detect

    flags = (_cpuinfo_field(text, "flags") or "").split()
    return {"cpu": _cpuinfo_field(text, "model name") or platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "flags": sorted(f for f in set(flags) if f.startswith(KERNEL_FLAGS)),
            "family": detect().describe(),  # as the engine plans for it (PAGEDLLM_CPU_FAMILY included)
            "python": platform.python_version(),
            "load_average_1m": round(os.getloadavg()[0], 2),  # others' work on a shared machine
            "threading_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(THREADING_ENV)}}


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (its threads included), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    # the command name (field 2) may hold spaces; fields after its closing parenthesis are fixed
    fields = stat[stat.rindex(")") + 2:].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def machine_steal_seconds() -> float | None:
    """CPU seconds the hypervisor has taken from this machine's cores so far (``steal`` in
    /proc/stat, all cores together), or None where it is not reported: other tenants' share of a
    shared machine, which slows whatever runs here then."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


@dataclass
class CpuTime:
    """CPU seconds this process used over a stretch of wall time."""

    wall_s: float
    process_s: float  # time.process_time(): user + system, all threads
    user_s: float     # getrusage(RUSAGE_SELF)
    system_s: float
    steal_s: float | None = None  # the hypervisor's steal from the whole machine over the same time

    def as_dict(self) -> dict:
        cores = os.cpu_count() or 1
        return {"wall_s": round(self.wall_s, 3), "process_s": round(self.process_s, 3),
                "user_s": round(self.user_s, 3), "system_s": round(self.system_s, 3),
                "cores_busy": round(self.process_s / self.wall_s, 3) if self.wall_s > 0 else None,
                "share_of_machine": round(self.process_s / self.wall_s / cores, 4) if self.wall_s > 0 else None,
                "machine_steal_s": None if self.steal_s is None else round(self.steal_s, 3)}


class CpuClock:
    """``with CpuClock() as clock: ...`` then ``clock.result``: this process's CPU time over the block."""

    def __enter__(self) -> CpuClock:
        self._wall, self._proc = time.perf_counter(), time.process_time()
        self._usage = resource.getrusage(resource.RUSAGE_SELF)
        self._steal = machine_steal_seconds()
        return self

    def __exit__(self, *exc) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        steal = machine_steal_seconds()
        self.result = CpuTime(time.perf_counter() - self._wall, time.process_time() - self._proc,
                              usage.ru_utime - self._usage.ru_utime, usage.ru_stime - self._usage.ru_stime,
                              None if steal is None or self._steal is None else steal - self._steal)
