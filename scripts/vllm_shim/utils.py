"""Stands in for vLLM's ``tests/utils.py`` when vLLM's entrypoint tests run against pagedllm.

vLLM's tests start their server with ``RemoteOpenAIServer(model, vllm_serve_args, env_dict=...)``
and talk to it through ``url_for``, ``get_client`` and ``get_async_client``. This module is our own
implementation of that interface: it starts ``pagedllm serve`` (the default model, served under
the name the test asks for) with the vLLM flags translated to ours, and stops it on exit.
Used by ``scripts/vllm_entrypoint_tests.py``; never imported by pagedllm itself.

Flag translation: the flags pagedllm has (``--max-model-len``, ``--max-num-seqs``, ``--dtype``,
``--chat-template``, ``--tool-call-parser``, ``--root-path``, ``--seed``, ``--max-logprobs``) pass through; vLLM-only
flags that change nothing observable here (``--enforce-eager``, ``--gpu-memory-utilization``,
``--enable-prompt-tokens-details``, ...) are dropped; ``VLLM_API_KEY`` becomes ``--api-key``.
Every flag dropped is printed, so a test's failure can be traced to a flag we do not honour.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import openai
import requests

REPO = os.environ["PAGEDLLM_REPO"]
PAGEDLLM_PYTHON = os.environ.get("PAGEDLLM_PYTHON", os.path.join(REPO, ".venv", "bin", "python"))

# vLLM flag -> number of values it takes, for the flags we drop.
DROPPED_FLAGS = {
    "--enforce-eager": 0, "--gpu-memory-utilization": 1, "--enable-prompt-tokens-details": 0,
    "--no-enable-prefix-caching": 0, "--enable-auto-tool-choice": 0, "--trust-remote-code": 0,
    "--enable-server-load-tracking": 0, "--enable-tokenizer-info-endpoint": 0,
    "--enable-lora": 0, "--lora-modules": -1, "--max-lora-rank": 1, "--max-cpu-loras": 1,
    "--disable-frontend-multiprocessing": 0, "--load-format": 1, "--tokenizer-mode": 1,
    "--reasoning-parser": 1, "--disable-log-stats": 0, "--enable-force-include-usage": 0,
}
KEPT_FLAGS = {"--max-model-len", "--max-num-seqs", "--dtype", "--chat-template", "--tool-call-parser",
              "--root-path", "--seed", "--max-num-batched-tokens", "--served-model-name", "--max-logprobs"}
DTYPES = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float32": "float32",
          "float": "float32", "auto": "auto"}


def translate_args(vllm_args: list[str]) -> tuple[list[str], list[str]]:
    """(our flags, the vLLM flags dropped) for a vLLM ``serve`` argument list."""
    ours: list[str] = []
    dropped: list[str] = []
    i = 0
    while i < len(vllm_args):
        arg = vllm_args[i]
        name, _, inline = arg.partition("=")
        if name in KEPT_FLAGS:
            value = inline if inline else vllm_args[i + 1]
            i += 1 if inline else 2
            if name == "--dtype":
                value = DTYPES.get(value, value)
            ours += [name, value]
        elif name in DROPPED_FLAGS:
            count = DROPPED_FLAGS[name]
            i += 1
            if count == -1:  # every value up to the next flag
                while i < len(vllm_args) and not vllm_args[i].startswith("--"):
                    i += 1
            elif not inline:
                i += count
            dropped.append(name)
        else:
            raise ValueError(f"vLLM flag {arg!r} has no translation for pagedllm serve: add it to the shim")
    return ours, dropped


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RemoteOpenAIServer:
    """``pagedllm serve`` in a child process, shaped like vLLM's test helper of the same name."""

    DUMMY_API_KEY = "token-abc123"

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict: dict[str, str] | None = None,
                 seed: int | None = 0, auto_port: bool = True, max_wait_seconds: float | None = None,
                 **_ignored) -> None:
        args, dropped = translate_args(list(vllm_serve_args))
        if dropped:
            print(f"[pagedllm shim] vLLM flags without an effect here, dropped: {' '.join(dropped)}")
        env = dict(os.environ)
        env.update(env_dict or {})
        api_key = env.pop("VLLM_API_KEY", None)
        if api_key:
            args += ["--api-key", api_key]
        if seed is not None and "--seed" not in args:
            args += ["--seed", str(seed)]
        if "--served-model-name" not in args:
            args += ["--served-model-name", model]
        self.host = "127.0.0.1"
        self.port = free_port()
        command = [PAGEDLLM_PYTHON, "-m", "pagedllm.cli", "serve", "--host", self.host, "--port", str(self.port),
                   *args]
        print("[pagedllm shim]", " ".join(command))
        self.proc = subprocess.Popen(command, env=env, cwd=REPO, stdout=sys.stdout, stderr=sys.stderr,
                                     start_new_session=True)
        self._wait_until_healthy(max_wait_seconds or 240)

    def _wait_until_healthy(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pagedllm serve exited with status {self.proc.returncode}")
            try:
                if requests.get(self.url_for("health"), timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError("pagedllm serve did not become healthy in time")

    def __enter__(self) -> RemoteOpenAIServer:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        return f"{self.url_root}/" + "/".join(part.strip("/") for part in parts if part)

    def get_client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0,
                                  **kwargs)
