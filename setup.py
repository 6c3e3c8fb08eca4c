"""Builds the C++ extensions when the package is installed; the metadata lives in pyproject.toml.

Every ``src/pagedllm/<pkg>/csrc/<name>.cpp`` becomes the module ``pagedllm.<pkg>._<name>``, compiled
by torch's ``CppExtension``/``BuildExtension`` with the flags of ``pagedllm/build_record.py``, and
a ``_<name>.build.json`` next to it records what the build was made for (sources, flags, torch,
CPU); ``pagedllm/cpu_extension.py`` uses the build only where that record fits. Build against the
torch that will run it: ``pip install --no-build-isolation -e .`` after ``pip install
torch==2.13.0`` (as the Makefile does). Without torch in the build environment (an isolated
``pip install .``) nothing is compiled, and a compile that fails (no compiler) is only a warning:
either way the package then builds the extensions on first use, or falls back without them.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent.resolve()
PACKAGE = ROOT / "src" / "pagedllm"


def load_build_record_module():
    """``src/pagedllm/build_record.py`` on its own (standard library only), without importing pagedllm."""
    spec = importlib.util.spec_from_file_location("pagedllm_build_record", PACKAGE / "build_record.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


def extensions_and_commands():
    # pip builds before it installs the dependencies, so numpy may not be there yet: torch says so
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("setup.py: torch is not importable in this build environment, so the C++ extensions are not "
              "built now; pagedllm builds them on first use (install torch first and use "
              "--no-build-isolation to build them here)", file=sys.stderr)
        return [], {}
    records = load_build_record_module()

    class BuildExtensionWithRecords(BuildExtension):
        """torch's BuildExtension, plus a build record next to every extension it builds; a failed
        (optional) extension is reported and skipped."""

        def finalize_options(self) -> None:
            super().finalize_options()
            if self.parallel is None:  # not set with -j: one compiler per extension, up to one per core
                self.parallel = True

        def build_extension(self, ext) -> None:
            try:
                super().build_extension(ext)
            except Exception as e:  # noqa: BLE001 - no compiler, bad flags: the package copes without it
                if not ext.optional:
                    raise
                lines = str(e).strip().splitlines()
                print(f"setup.py: WARNING: {ext.name} was not built ({type(e).__name__}: "
                      f"{lines[-1] if lines else ''}); pagedllm will try again on first use", file=sys.stderr)
                return
            record = records.BuildRecord.here(ROOT / ext.sources[0])
            self._record_path(ext).write_text(record.to_json())

        def copy_extensions_to_source(self) -> None:
            """Editable installs copy the built modules into src/; their records go along."""
            super().copy_extensions_to_source()
            build_py = self.get_finalized_command("build_py")
            for ext in self.extensions:
                built = self._record_path(ext)
                if built.exists():
                    package = self.get_ext_fullname(ext.name).rpartition(".")[0]
                    self.copy_file(str(built), str(Path(build_py.get_package_dir(package)) / built.name))

        def get_outputs(self) -> list[str]:
            built = [self._record_path(ext) for ext in self.extensions]
            return super().get_outputs() + [str(p) for p in built if p.exists()]

        def _record_path(self, ext) -> Path:
            *package, module = self.get_ext_fullname(ext.name).split(".")
            return Path(self.build_lib, *package, module + records.RECORD_SUFFIX)

    sources = sorted(PACKAGE.glob("*/csrc/*.cpp"))
    extensions = [
        CppExtension(records.installed_module_name(source), [source.relative_to(ROOT).as_posix()],
                     include_dirs=[str(records.SHARED_HEADERS)],  # absolute, wherever the compiler runs
                     # -g0: no debug info (distutils adds -g), which only makes the build slower
                     extra_compile_args=[*records.CFLAGS, "-g0"], extra_link_args=list(records.LDFLAGS),
                     optional=True)
        for source in sources]
    # Without ninja each extension is one compiler call, so the extensions can build in parallel
    # (with ninja, torch writes one build.ninja per build folder, which parallel builds would share).
    return extensions, {"build_ext": BuildExtensionWithRecords.with_options(use_ninja=False)}


ext_modules, cmdclass = extensions_and_commands()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
