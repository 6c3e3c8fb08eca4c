"""Which build of a C++ extension is used: the installed one when its record fits this process
(sources, flags, torch, CPU), else one built on demand into the cache. Nothing is compiled here:
tests/conftest.py sets PAGEDLLM_NO_BUILD=1, and the on-demand path runs with the compiler call faked."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import pagedllm
from pagedllm import build_record, cpu_extension
from pagedllm.attention.cpu_kernel import EXTENSION as ATTENTION
from pagedllm.build_record import (
    EMULATED_FAMILIES,
    FAMILY_ENV,
    BuildRecord,
    as_family,
    cache_key,
    cpu_isa_flags,
    emulated_family,
    installed_module_name,
    why_unusable,
)
from pagedllm.cpu_extension import NO_BUILD_ENV, CppExtension, installed_record_path, on_demand_builds_disabled
from pagedllm.cpu_features import CpuFeatures
from pagedllm.models.layer_ops import EXTENSION as LAYER_OPS

EXTENSIONS = {"paged_attention": ATTENTION, "layer_ops": LAYER_OPS}
RECORD = BuildRecord(sources_sha256="ab" * 32, cflags=("-O3", "-march=native"), torch_version="2.13.0+cpu",
                     torch_path="/venv/a/lib/python3.11/site-packages/torch",
                     cpu_flags=frozenset({"avx2", "fma", "f16c", "avx512f", "avx512_bf16"}))
EPYC_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu vme de pse tsc msr hypervisor sse sse2 ssse3 fma cx16 sse4_1 sse4_2 popcnt avx f16c avx2 \
bmi1 bmi2 avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni tsc_known_freq rep_good
processor\t: 1
flags\t\t: fpu sse
"""


def fresh_copy(extension: CppExtension) -> CppExtension:
    """The same extension, not yet loaded (the module-level ones keep what they loaded)."""
    return CppExtension(extension.stem, extension.source, extension.purpose, extension.fallback)


def test_the_suite_never_builds_on_demand():
    assert on_demand_builds_disabled()


# `make test CPU_FAMILY=...` loads builds made into the cache for that family's flags, which the
# installed build (made for this CPU) cannot be
EMULATED = emulated_family()
needs_the_installed_build = pytest.mark.skipif(
    EMULATED is not None, reason=f"{FAMILY_ENV}={EMULATED and EMULATED.name}: the extensions are the cache's "
                                 "builds for that family, not the installed one")


@pytest.mark.skipif(EMULATED is None, reason=f"{FAMILY_ENV} is not set: the installed builds are used")
@pytest.mark.parametrize("name", EXTENSIONS)
def test_an_emulated_family_loads_the_cache_build_for_its_flags(name):
    extension = fresh_copy(EXTENSIONS[name])
    module = extension.load()
    assert module is not None, f"no build for {EMULATED.name} (make test CPU_FAMILY=... builds it): {extension.failure}"
    here = BuildRecord.here(extension.source)
    assert set(EMULATED.compiler_flags) <= set(here.cflags)
    assert not any(f.startswith(EMULATED.drops) for f in here.cpu_flags)
    name, folder = cpu_extension.cached_build(extension.stem, here)
    assert Path(module.__file__) == folder / f"{name}.so" and module.__name__ == name


@needs_the_installed_build
@pytest.mark.parametrize("name", EXTENSIONS)
def test_both_extensions_load_from_the_installed_build(name):
    extension = fresh_copy(EXTENSIONS[name])
    module = extension.load()
    assert module is not None, f"no usable installed build (run `make`): {extension.failure}"
    module_file = Path(module.__file__).resolve()
    assert module_file.is_relative_to(Path(pagedllm.__file__).parent.resolve())
    assert module.__name__ == installed_module_name(extension.source)
    recorded = BuildRecord.from_json(installed_record_path(module_file).read_text())
    assert why_unusable(recorded, BuildRecord.here(extension.source)) is None


def test_installed_module_names_sit_next_to_their_csrc_folder():
    assert installed_module_name(ATTENTION.source) == "pagedllm.attention._paged_attention_cpu"
    assert installed_module_name(LAYER_OPS.source) == "pagedllm.models._layer_ops_cpu"
    assert installed_record_path(Path("/p/_layer_ops_cpu.cpython-311-x86_64-linux-gnu.so")) == Path(
        "/p/_layer_ops_cpu.build.json")


def test_cpu_flags_keep_instruction_sets_only():
    flags = cpu_isa_flags(EPYC_CPUINFO)
    assert {"avx512_bf16", "avx512f", "avx2", "fma", "f16c", "sse4_2", "bmi2", "popcnt"} <= flags
    assert not flags & {"fpu", "vme", "hypervisor", "tsc_known_freq", "rep_good"}
    assert cpu_isa_flags("flags\t: avx amx_tile amx_bf16 amx_int8\n") == {"avx", "amx_tile", "amx_bf16", "amx_int8"}
    assert cpu_isa_flags("no flags line at all") == frozenset()


def test_a_record_matching_this_environment_is_usable():
    assert why_unusable(RECORD, RECORD) is None
    bigger_cpu = dataclasses.replace(RECORD, cpu_flags=RECORD.cpu_flags | {"amx_tile", "amx_bf16"})
    assert why_unusable(RECORD, bigger_cpu) is None


def test_a_cpu_flag_this_cpu_lacks_makes_the_build_unusable():
    without_bf16 = dataclasses.replace(RECORD, cpu_flags=RECORD.cpu_flags - {"avx512_bf16"})
    reason = why_unusable(RECORD, without_bf16)
    assert reason is not None and "avx512_bf16" in reason and "avx2" not in reason


@pytest.mark.parametrize("change", [
    {"sources_sha256": "cd" * 32},
    {"cflags": ("-O2", "-march=native")},
    {"torch_version": "2.14.0+cpu"},
    {"torch_path": "/venv/b/lib/python3.11/site-packages/torch"},
])
def test_other_sources_flags_or_torch_make_the_build_unusable(change):
    assert why_unusable(RECORD, dataclasses.replace(RECORD, **change)) is not None


def test_a_record_survives_its_json_file():
    assert BuildRecord.from_json(RECORD.to_json()) == RECORD


@pytest.mark.parametrize("change", [
    {"sources_sha256": "cd" * 32},
    {"cflags": ("-O2", "-march=native")},
    {"torch_version": "2.14.0+cpu"},
    {"torch_path": "/venv/b/lib/python3.11/site-packages/torch"},
    {"cpu_flags": RECORD.cpu_flags - {"avx512_bf16"}},
    {"cpu_flags": RECORD.cpu_flags | {"amx_tile"}},
])
def test_the_on_demand_cache_key_changes_with_everything_recorded(change):
    assert cache_key(RECORD) == cache_key(dataclasses.replace(RECORD))
    assert cache_key(dataclasses.replace(RECORD, **change)) != cache_key(RECORD)


@pytest.fixture
def cpu_without_a_recorded_flag(monkeypatch):
    """This CPU, minus one instruction set the installed attention build was recorded with."""
    module = fresh_copy(ATTENTION).load()
    assert module is not None, "needs the installed build (run `make`)"
    recorded = BuildRecord.from_json(installed_record_path(Path(module.__file__)).read_text())
    assert recorded.cpu_flags, "the installed build recorded no CPU flags"
    lacking = sorted(recorded.cpu_flags)[-1]
    monkeypatch.setattr(build_record, "this_cpu_isa_flags", lambda: recorded.cpu_flags - {lacking})
    return lacking


@needs_the_installed_build
def test_without_on_demand_builds_load_gives_none_and_says_why(cpu_without_a_recorded_flag, monkeypatch):
    def must_not_build(*args, **kwargs):
        raise AssertionError("on-demand builds are off")

    monkeypatch.setattr(cpu_extension, "build_on_demand", must_not_build)
    extension = fresh_copy(ATTENTION)
    assert extension.load() is None
    assert cpu_without_a_recorded_flag in extension.failure and NO_BUILD_ENV in extension.failure
    assert extension.load() is None  # remembered, not retried


@needs_the_installed_build
def test_with_on_demand_builds_a_mismatch_builds_into_the_cache(cpu_without_a_recorded_flag, monkeypatch,
                                                                tmp_path, capsys):
    from torch.utils import cpp_extension as torch_cpp_extension

    calls = []
    built = object()
    monkeypatch.setenv(NO_BUILD_ENV, "0")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch_cpp_extension, "load", lambda **kwargs: calls.append(kwargs) or built)
    extension = fresh_copy(ATTENTION)
    assert extension.load() is built
    (call,) = calls
    here = BuildRecord.here(ATTENTION.source)
    assert cpu_without_a_recorded_flag not in here.cpu_flags
    assert Path(call["build_directory"]) == tmp_path / "kernels" / cache_key(here)
    assert call["name"].endswith(cache_key(here))
    stderr = capsys.readouterr().err.strip().splitlines()
    assert len(stderr) == 1 and "building the C++ paged-attention kernel" in stderr[0]
    assert cpu_without_a_recorded_flag in stderr[0]


SAPPHIRE_RAPIDS = cpu_isa_flags("flags\t: sse4_2 avx f16c fma avx2 avx_vnni avx512f avx512bw avx512vl avx512dq "
                                "avx512_vnni avx512_bf16 avx512_fp16 amx_tile amx_bf16 amx_int8 bmi2\n")


@pytest.mark.parametrize("name", sorted(EMULATED_FAMILIES))
def test_a_bigger_cpu_passes_for_each_smaller_family(name):
    family = EMULATED_FAMILIES[name]
    flags = as_family(SAPPHIRE_RAPIDS, family)
    assert CpuFeatures("x86_64", flags).family == name
    assert {"sse4_2", "avx2", "fma", "bmi2"} <= flags and not flags & {"amx_tile", "amx_bf16", "avx512_fp16"}
    assert as_family(SAPPHIRE_RAPIDS, None) == SAPPHIRE_RAPIDS


def test_a_cpu_cannot_pass_for_a_family_it_is_below():
    zen3 = cpu_isa_flags("flags\t: sse4_2 avx f16c fma avx2 bmi2\n")
    with pytest.raises(ValueError, match="avx512_bf16"):
        as_family(zen3, EMULATED_FAMILIES["avx512_bf16"])
    assert CpuFeatures("x86_64", as_family(zen3, EMULATED_FAMILIES["avx2"])).family == "avx2"


def test_an_unknown_family_name_is_refused(monkeypatch):
    monkeypatch.setenv(FAMILY_ENV, "avx1024")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_FAMILY must be one of"):
        emulated_family()
    monkeypatch.setenv(FAMILY_ENV, "")
    assert emulated_family() is None
