"""What a compiled C++ extension was built for, and whether such a build fits this environment.

A ``BuildRecord`` names everything a build of one extension depends on: a hash of its source and
the shared headers, the compiler flags, torch's version and install path (the build links
against that torch), and the CPU's instruction-set flags (``-march=native`` may use any of them).
``setup.py`` writes one next to each extension it builds at install time
(``<module>.build.json``); at load, ``why_unusable(recorded, BuildRecord.here(source))`` says
why an installed build cannot run here (None when it can). ``cache_key`` names an on-demand build
in the cache folder. Only the standard library is imported at module level, so ``setup.py``
can load this file on its own.

``PAGEDLLM_CPU_FAMILY`` (``avx2``, ``avx512``, ``avx512_bf16``) makes a bigger x86 CPU pass for one
of a smaller family, so one machine runs the suite as another would (``make test CPU_FAMILY=avx2``):
the flags that family lacks are dropped from what this CPU is said to have (``this_cpu_isa_flags``,
and so ``cpu_features.detect``), and the compiler is told not to emit them (``CFLAGS``). torch's
own kernels are capped to match by ``pagedllm/__init__.py`` (``EMULATION_ENV``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

FAMILY_ENV = "PAGEDLLM_CPU_FAMILY"


@dataclass(frozen=True)
class EmulatedFamily:
    """What a bigger CPU drops to pass for one of ``name``'s family."""

    name: str
    needs: tuple[str, ...]          # /proc/cpuinfo flags the real CPU must have
    drops: tuple[str, ...]          # prefixes of the flags this family lacks
    compiler_flags: tuple[str, ...]  # keep -march=native from emitting them (GCC >= 12)
    torch_env: tuple[tuple[str, str], ...]  # caps for ATen's and oneDNN's own run-time dispatch


_AMX_OFF = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
EMULATED_FAMILIES = {f.name: f for f in (
    EmulatedFamily("avx2", ("avx2", "fma"), ("avx512", "amx", "avx_vnni", "avx_ne_convert", "avx_ifma"),
                   ("-mno-avx512f", "-mno-avxvnni", *_AMX_OFF),
                   (("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2"))),
    EmulatedFamily("avx512", ("avx512f", "avx512bw", "avx512vl", "avx512dq"), ("avx512_bf16", "avx512_fp16", "amx"),
                   ("-mno-avx512bf16", "-mno-avx512fp16", *_AMX_OFF),
                   (("ATEN_CPU_CAPABILITY", "avx512"), ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI"))),
    EmulatedFamily("avx512_bf16", ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
                   ("avx512_fp16", "amx"), ("-mno-avx512fp16", *_AMX_OFF),
                   (("ATEN_CPU_CAPABILITY", "avx512"), ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16"))),
)}


def emulated_family() -> EmulatedFamily | None:
    """The family ``PAGEDLLM_CPU_FAMILY`` asks for, or None; a name not in ``EMULATED_FAMILIES`` raises."""
    name = os.environ.get(FAMILY_ENV, "").strip()
    if not name:
        return None
    if name not in EMULATED_FAMILIES:
        raise ValueError(f"{FAMILY_ENV} must be one of {sorted(EMULATED_FAMILIES)}, got {name!r}")
    return EMULATED_FAMILIES[name]


def as_family(flags: frozenset[str], family: EmulatedFamily | None) -> frozenset[str]:
    """``flags`` less what ``family`` lacks; a CPU without the family's own flags cannot pass for it."""
    if family is None:
        return flags
    missing = [f for f in family.needs if f not in flags]
    if missing:
        raise ValueError(f"{FAMILY_ENV}={family.name} needs a CPU with {', '.join(missing)}, which this one lacks")
    return frozenset(f for f in flags if not f.startswith(family.drops))


# -fno-trapping-math lets GCC vectorise floorf (used by the polynomial exp); values are unchanged
_FAMILY = emulated_family()
CFLAGS = ("-O3", "-march=native", *(_FAMILY.compiler_flags if _FAMILY else ()), "-fopenmp", "-fno-trapping-math")
LDFLAGS = ("-fopenmp",)
PACKAGE_ROOT = Path(__file__).parent
SHARED_HEADERS = PACKAGE_ROOT / "csrc"  # cpu_vec.h: vectors, hsum, exp shared by the extensions
RECORD_SUFFIX = ".build.json"

# /proc/cpuinfo flags that name instructions a compiler can emit under -march=native
# (x86: SSE..AVX-512, AMX, FMA, F16C, BMI, AES, ...; Arm: the "Features" line, e.g. asimd, sve).
# Flags about the machine rather than its instructions (hypervisor, tsc_known_freq, ...) are left
# out, so moving between two VMs of the same CPU does not look like a different CPU.
ISA_FLAG = re.compile(
    r"(mmx|sse\w*|ssse3|avx\w*|amx\w*|fma\w*|f16c|bmi\d|popcnt|lzcnt|abm|movbe|aes|vaes|pclmulqdq|vpclmulqdq"
    r"|gfni|sha\w*|adx|rdrand|rdseed|xsave\w*|fsgsbase|clflushopt|clwb|cx16|lahf_lm|3dnowprefetch|prfchw"
    r"|movdir\w*|serialize|waitpkg|cldemote|rdpid|xop|tbm|clzero|wbnoinvd"
    r"|asimd\w*|sve\w*|fp|fphp|bf16|i8mm|dotprod|atomics|crc32|pmull|sha\d|sm\d|lse)")


def cpu_isa_flags(cpuinfo: str) -> frozenset[str]:
    """The instruction-set flags in the text of /proc/cpuinfo (its first processor's flags line)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(f for f in value.split() if ISA_FLAG.fullmatch(f))
    return frozenset()


def this_cpu_isa_flags() -> frozenset[str]:
    """This CPU's flags, as the family of ``PAGEDLLM_CPU_FAMILY`` has them when that is set."""
    try:
        return as_family(cpu_isa_flags(Path("/proc/cpuinfo").read_text()), _FAMILY)
    except OSError:  # not Linux: nothing recorded, nothing required
        return frozenset()


def sources_sha256(source: Path) -> str:
    """Hash of the extension's source and every shared header it may include."""
    h = hashlib.sha256()
    for path in [source, *sorted(SHARED_HEADERS.glob("*.h"))]:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def installed_module_name(source: Path) -> str:
    """The module an installed build of ``<pkg>/csrc/<name>.cpp`` is: ``pagedllm.<pkg>._<name>``,
    next to the csrc folder it comes from (``setup.py`` builds every such source)."""
    package = source.resolve().parent.parent.relative_to(PACKAGE_ROOT.resolve().parent)
    return ".".join([*package.parts, f"_{source.stem}"])


@dataclass(frozen=True)
class BuildRecord:
    """What one build of an extension was made from and for."""

    sources_sha256: str
    cflags: tuple[str, ...]
    torch_version: str
    torch_path: str
    cpu_flags: frozenset[str]

    @classmethod
    def here(cls, source: Path) -> BuildRecord:
        """What a build of ``source`` made now, in this process, would record."""
        import torch

        return cls(sources_sha256(source), CFLAGS, torch.__version__, str(Path(torch.__file__).parent.resolve()),
                   this_cpu_isa_flags())

    def to_json(self) -> str:
        data = asdict(self)
        data["cflags"], data["cpu_flags"] = list(self.cflags), sorted(self.cpu_flags)
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> BuildRecord:
        data = json.loads(text)
        return cls(data["sources_sha256"], tuple(data["cflags"]), data["torch_version"], data["torch_path"],
                   frozenset(data["cpu_flags"]))


def why_unusable(built: BuildRecord, here: BuildRecord) -> str | None:
    """Why a build recorded as ``built`` cannot be used in the environment ``here`` ("built for
    torch 2.13.0 at /other/venv/...torch"); None if it can.

    Sources, flags and torch must be the same; the CPU may have more instruction sets than the
    one the build was made on, never fewer (an instruction it lacks would crash the process).
    """
    if built.sources_sha256 != here.sources_sha256:
        return "built from other C++ sources"
    if built.cflags != here.cflags:
        return f"built with other flags ({' '.join(built.cflags)})"
    if (built.torch_version, built.torch_path) != (here.torch_version, here.torch_path):
        return f"built for torch {built.torch_version} at {built.torch_path}"
    missing = built.cpu_flags - here.cpu_flags
    if missing:
        return f"built for a CPU with {', '.join(sorted(missing))}, which this CPU lacks"
    return None


def cache_key(record: BuildRecord) -> str:
    """Names an on-demand build in the cache: any change in what the record holds gives a new key."""
    return hashlib.sha256(record.to_json().encode()).hexdigest()[:16]
