"""The peers of ``pagedllm bench peers``: which engines, how each is started, and its worker process.

Owns the peer side of the peer benchmark. A :class:`PeerSpec` names one engine at one setting
(``vllm bfloat16``, ``vllm float32``, ``llama.cpp``) and the command that starts its worker: a
script run by that peer's own venv Python (``make peers``), which imports nothing from pagedllm
and speaks one protocol (``peer_scripts/vllm_worker.py``): ``{"ready": ...}`` on stdout once loaded,
then one JSON result line per JSON job line on stdin. :class:`PeerWorker` runs one such process
in its own process group, paused (SIGSTOP) between its jobs so an idle peer takes no CPU from
the engine being timed, and killed whole when the benchmark ends or is terminated.

A peer whose venv or model is missing is skipped with a message saying how to get it
(:func:`peer_specs` returns the message instead of a spec); nothing here is needed by ``make test``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).parent
WORKERS = {"vllm": HERE / "peer_scripts" / "vllm_worker.py", "llama.cpp": HERE / "peer_scripts" / "llamacpp_worker.py"}
PEERS = tuple(WORKERS)
VLLM_DTYPES = ("bfloat16", "float16", "float32")


def vllm_env(cores: int) -> dict[str, str]:
    """vLLM's CPU settings for a fair run: all cores bound, none reserved, 2 GiB of KV, offline."""
    return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass(frozen=True)
class PeerSpec:
    """One peer engine at one setting, and how to start its worker."""

    peer: str                    # "vllm" or "llama.cpp"
    setting: str                 # vLLM's dtype; llama.cpp's weights ("gguf")
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.peer} {self.setting}"


def parse_peers(peers: str, dtypes: str) -> tuple[list[str], list[str]]:
    """``"vllm,llama.cpp"`` and ``"bfloat16,float32"`` -> lists (raises ValueError naming a bad item)."""
    names = list(dict.fromkeys(filter(None, (s.strip() for s in peers.split(",")))))
    for name in names:
        if name not in PEERS:
            raise ValueError(f"--peer: {name!r} is not one of {', '.join(PEERS)}")
    chosen = list(dict.fromkeys(filter(None, (s.strip() for s in dtypes.split(",")))))
    for dtype in chosen:
        if dtype not in VLLM_DTYPES:
            raise ValueError(f"--peer-dtype: {dtype!r} is not one of {', '.join(VLLM_DTYPES)}")
    if "vllm" in names and not chosen:
        raise ValueError("--peer-dtype: give at least one of " + ", ".join(VLLM_DTYPES))
    return names, chosen


def peer_specs(args, max_num_seqs: int, ctx_per_seq: int, cores: int) -> tuple[list[PeerSpec], list[str]]:
    """The specs of the peers asked for whose venv and model exist, and a message per skipped one."""
    names, dtypes = parse_peers(args.peer, args.peer_dtype)
    worker_override = Path(args.peer_worker) if args.peer_worker else None
    specs: list[PeerSpec] = []
    skipped: list[str] = []
    if "vllm" in names:
        if not Path(args.peer_python).exists():
            skipped.append(f"vLLM part skipped: {args.peer_python} not found (run `make peers` to install vLLM's CPU "
                           "build)")
        elif not Path(args.peer_model).exists():
            skipped.append(f"vLLM part skipped: {args.peer_model} not found (run `make peers` to write the HF folder)")
        else:
            env = vllm_env(cores)
            iomp = sorted(Path(args.peer_python).resolve().parent.parent.glob("lib/libiomp5.so"))
            if iomp:
                env["LD_PRELOAD"] = str(iomp[0])  # vLLM's CPU build expects Intel's OpenMP preloaded
            worker = worker_override or WORKERS["vllm"]
            specs += [PeerSpec("vllm", d, (args.peer_python, str(worker), args.peer_model, d, str(max_num_seqs)), env)
                      for d in dtypes]
    if "llama.cpp" in names:
        gguf = args.llamacpp_model
        if not Path(args.llamacpp_python).exists():
            skipped.append(f"llama.cpp part skipped: {args.llamacpp_python} not found (run `make peers` to build "
                           "llama-cpp-python for this CPU)")
        elif gguf is None or not Path(gguf).exists():
            skipped.append(f"llama.cpp part skipped: it needs a GGUF file (--llamacpp-model), got {gguf}")
        else:
            worker = worker_override or WORKERS["llama.cpp"]
            specs.append(PeerSpec("llama.cpp", "gguf", (args.llamacpp_python, str(worker), str(gguf),
                                                         str(max_num_seqs), str(ctx_per_seq), str(cores))))
    return specs, skipped


class PeerWorker:
    """A peer's worker process: one JSON job per line in, one result per line out."""

    def __init__(self, spec: PeerSpec, timeout_s: float = 1800.0) -> None:
        self.spec = spec
        env = {**os.environ, **spec.env}
        name = spec.label.replace(" ", "-").replace(".", "")
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"pagedllm-peer-{name}-{os.getpid()}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(list(spec.argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=env, start_new_session=True)  # its own group, to pause it whole
        self.timeout_s = timeout_s
        self.ready = self._read()
        if not self.ready.get("ready"):
            raise RuntimeError(f"the {spec.label} worker did not start: {self.ready}")
        self._signal(signal.SIGSTOP)

    def _signal(self, sig: int) -> None:
        """Pause (SIGSTOP) or resume (SIGCONT) the worker and the engine processes it spawned: a
        paused peer takes no CPU while another engine runs (its OpenMP threads and engine loop
        may spin or poll when idle), so each engine has the cores to itself during its own runs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(10)
            raise RuntimeError(f"the {self.spec.label} worker exited with {self.proc.returncode}; its log: "
                               f"{self.log.name}")
        return json.loads(line)

    def run(self, prompts: list[list[int]], max_tokens: int | list[int]) -> dict:
        if isinstance(max_tokens, int):
            max_tokens = [max_tokens] * len(prompts)
        self._signal(signal.SIGCONT)
        try:
            self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
            self.proc.stdin.flush()
            return self._read()
        finally:
            self._signal(signal.SIGSTOP)

    def close(self, graceful: bool = True) -> None:
        """Let the worker exit (its stdin closed) or, when not ``graceful`` or when it does not exit
        within a minute, kill its whole process group: a peer's engine processes must not outlive
        the benchmark (left behind, they would compete with the next run)."""
        if self.proc.poll() is None and graceful:
            self._signal(signal.SIGCONT)
            self.proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(60)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group outlives its leader: kill what is left
        self.proc.wait()
        self.log.close()
