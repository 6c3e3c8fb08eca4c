"""Run vLLM's own OpenAI entrypoint tests against ``pagedllm serve`` (an outside check, not in ``make test``).

    make peers                                    # once: vLLM's CPU build in .venv-peers, the HF export
    .venv/bin/python scripts/vllm_entrypoint_tests.py [--vllm-version 0.32.0] [--json FILE] [-k EXPR]

What it does:
1. takes vLLM's source distribution from PyPI (cached in ``.peers/``; ``--sdist`` gives a local one):
   its ``tests/`` folder holds the entrypoint tests;
2. lays out a test tree in ``.peers/vllm-entrypoint-tests/``: the chosen test files and their package
   files from the sdist, and, in place of vLLM's ``tests/utils.py`` and ``tests/conftest.py``, ours
   (``scripts/vllm_shim/``): a ``RemoteOpenAIServer`` that starts ``pagedllm serve`` on the default
   model under the name each test asks for, and hub lookups answered offline;
3. runs pytest with ``.venv-peers``' python (the tests import vLLM's protocol classes and helpers;
   pytest, pytest-asyncio and jsonschema are added to that venv when missing) and reports per test.

The test files (``DEFAULT_TESTS``) are the ones issue 22 names: completions, chat, chat echo,
return_token_ids, tokenization, root path and the basic server checks. The report says which
failed; ``docs/api.md`` ("vLLM's entrypoint tests") explains each failure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHIM = REPO / "scripts" / "vllm_shim"
DEFAULT_TESTS = (
    "entrypoints/openai/completion/test_completion.py",
    "entrypoints/openai/chat_completion/test_chat.py",
    "entrypoints/openai/chat_completion/test_chat_echo.py",
    "entrypoints/openai/test_return_token_ids.py",
    "entrypoints/serve/tokenize/test_tokenization.py",
    "entrypoints/openai/chat_completion/test_root_path.py",
    "entrypoints/serve/instrumentator/test_basic.py",
)
TEST_PACKAGES = ("pytest", "pytest-asyncio", "jsonschema")


def sdist_path(version: str, given: str | None) -> Path:
    """vLLM's source distribution: the one given, or PyPI's (downloaded once into .peers/)."""
    if given:
        return Path(given)
    target = REPO / ".peers" / f"vllm-{version}.tar.gz"
    if not target.exists():
        index = urllib.request.urlopen("https://pypi.org/simple/vllm/", timeout=60).read().decode()
        match = re.search(rf'href="(https://[^"#]*/vllm-{re.escape(version)}\.tar\.gz)', index)
        if not match:
            sys.exit(f"PyPI's index has no source distribution of vllm {version}")
        target.parent.mkdir(parents=True, exist_ok=True)
        print(f"downloading {match.group(1)}")
        urllib.request.urlretrieve(match.group(1), target)
    return target


def lay_out_tests(sdist: Path, version: str, tests: list[str], work: Path) -> None:
    """The chosen tests with their package files and vLLM's ``entrypoints/conftest.py``; our shim for the rest."""
    shutil.rmtree(work, ignore_errors=True)
    prefix = f"vllm-{version}/tests/"
    wanted = set(tests) | {"entrypoints/conftest.py"}
    for test in tests:  # every package on the way down needs its __init__.py
        parts = Path(test).parent.parts
        for depth in range(1, len(parts) + 1):
            wanted.add(str(Path(*parts[:depth]) / "__init__.py"))
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            relative = member.name[len(prefix):] if member.name.startswith(prefix) else None
            if relative in wanted:
                destination = work / "tests" / relative
                destination.parent.mkdir(parents=True, exist_ok=True)
                destination.write_bytes(archive.extractfile(member).read())
                wanted.discard(relative)
    missing = [path for path in wanted if not path.endswith("__init__.py")]
    if missing:
        sys.exit(f"not in vllm {version}'s sdist: {', '.join(sorted(missing))}")
    for path in wanted:  # a package without an __init__.py in the sdist
        (work / "tests" / path).touch()
    (work / "tests" / "__init__.py").touch()
    # our own pytest settings (else pagedllm's pyproject.toml, above this folder, would apply)
    (work / "pytest.ini").write_text("[pytest]\nasyncio_mode = strict\n"
                                     "asyncio_default_fixture_loop_scope = function\n")
    shutil.copy(SHIM / "utils.py", work / "tests" / "utils.py")
    shutil.copy(SHIM / "conftest.py", work / "tests" / "conftest.py")


def ensure_test_packages(python: str) -> None:
    missing = [name for name in TEST_PACKAGES
               if subprocess.run([python, "-c", f"import {name.replace('-', '_')}"], capture_output=True).returncode]
    if missing:
        subprocess.run([python, "-m", "pip", "install", "-q", *missing], check=True)


def summarise(junit: Path) -> dict:
    """Per test: passed / failed / error / skipped, with the first line of the reason."""
    results = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                reason = (node.get("message") or node.text or "").strip().splitlines()[0][:300] if (
                    node.get("message") or node.text) else ""
                break
        results[name] = {"outcome": outcome, "reason": reason}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-version", default="0.32.0")
    parser.add_argument("--sdist", help="a local vllm-<version>.tar.gz (default: PyPI's, cached in .peers/)")
    parser.add_argument("--python", default=str(REPO / ".venv-peers" / "bin" / "python"),
                        help="a python with vLLM installed (default: make peers' venv)")
    parser.add_argument("--hf-dir", default=str(REPO / ".peers" / "SmolLM2-135M-Instruct"),
                        help="the served model's HF export, for the tests' tokenizer (make peers makes it)")
    parser.add_argument("--json", help="write the per-test outcomes here")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("tests", nargs="*", default=list(DEFAULT_TESTS),
                        help="test files, relative to vLLM's tests/ folder")
    args = parser.parse_args()
    if not Path(args.python).exists():
        sys.exit(f"{args.python} does not exist: run `make peers` first")
    work = REPO / ".peers" / "vllm-entrypoint-tests"
    lay_out_tests(sdist_path(args.vllm_version, args.sdist), args.vllm_version, args.tests, work)
    ensure_test_packages(args.python)
    junit = work / "junit.xml"
    env = dict(os.environ, PAGEDLLM_REPO=str(REPO), PAGEDLLM_HF_DIR=args.hf_dir, PYTHONPATH=str(work))
    command = [args.python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE", "-c", str(work / "pytest.ini"),
               "--rootdir", str(work),
               f"--junitxml={junit}", *(["-k", args.keyword] if args.keyword else []),
               *[str(work / "tests" / test) for test in args.tests]]
    status = subprocess.run(command, cwd=work, env=env).returncode
    results = summarise(junit)
    counts: dict[str, int] = {}
    for result in results.values():
        counts[result["outcome"]] = counts.get(result["outcome"], 0) + 1
    print("vLLM", args.vllm_version, "entrypoint tests against pagedllm serve:",
          ", ".join(f"{count} {outcome}" for outcome, count in sorted(counts.items())))
    if args.json:
        Path(args.json).write_text(json.dumps({"vllm_version": args.vllm_version, "counts": counts,
                                               "tests": results}, indent=1) + "\n")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
