"""Shared fixtures: the embedded SmolLM2 (ours and HF's), tiny random HF checkpoints."""

from __future__ import annotations

import glob
import os

# Triton kernels run on CPU tensors through the interpreter when there is no GPU; this must be
# set before anything imports triton. (A container may see its one GPU as /dev/nvidia3.)
if not glob.glob("/dev/nvidia[0-9]*"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The suite uses the C++ extensions built when the package was installed (`make` builds them) and
# never compiles them itself; this must be set before anything loads an extension.
os.environ["PAGEDLLM_NO_BUILD"] = "1"

# Under pytest-xdist (`make test`: a worker per core, at most 4; TEST_WORKERS=0 runs one process) the
# cores are shared: each worker's torch, and every process a test starts (servers, CLI runs;
# OMP_NUM_THREADS), takes its share of them, and the kernel tests take them all (``EVERY_CORE``) so
# the kernels' splits of work between threads run too. Run alone, a test has every core.
CORES = os.cpu_count() or 1
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, CORES // WORKERS)
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(THREADS)

PROMPT_TEXT = (
    "The history of computing is full of ideas that were rediscovered. Virtual memory, for "
    "instance, lets every process believe it owns a large contiguous address space, while the "
    "operating system maps fixed-size pages onto physical frames wherever they happen to be free. "
    "Serving large language models has the same problem: each request's key-value cache grows "
    "token by token, and reserving the maximum length up front wastes most of the memory. "
    "PagedAttention splits that cache into blocks, keeps a table per request, and shares blocks "
    "between requests that have the same prefix."
)


@pytest.fixture(scope="session")
def smollm_fp32():
    from pagedllm import LLM

    return LLM(dtype="float32", kv_cache_memory="256MiB", seed=0)


def make_parity_prompts(tok) -> list[list[int]]:
    """Eight token-id prompts: 1 token up to more than five 16-token blocks."""
    ids = tok.encode(PROMPT_TEXT)
    assert len(ids) > 100
    chat = tok.apply_chat_template([{"role": "user", "content": "Name three prime numbers."}])
    return [ids[:1], ids[:7], ids[:15], ids[:16], ids[:17], chat, ids[:64], ids[:97]]


@pytest.fixture(scope="session")
def parity_prompts(smollm_fp32) -> list[list[int]]:
    return make_parity_prompts(smollm_fp32.get_tokenizer())


def pytest_xdist_make_scheduler(config, log):
    """How ``make test`` (``TEST_WORKERS=N``) shares the suite between its xdist workers (``SuiteScheduling``)."""
    from xdist.scheduler import LoadScopeScheduling

    class SuiteScheduling(LoadScopeScheduling):
        """A worker takes a test module whole (its module fixtures are built once), and tests/server
        whole: the session's server starts once, and ``test_zz_every_field_is_sent`` runs after
        every other server test, in the same process. tests/server, the longest unit (about two
        fifths of the suite), goes out first; the rest in collection order, so that the long
        modules (bench, cluster, integration) run early and the many short ones fill the end."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SERVER_TESTS if path.startswith(SERVER_TESTS + "/") else path

        def _assign_work_unit(self, node) -> None:
            if SERVER_TESTS in self.workqueue:
                self.workqueue.move_to_end(SERVER_TESTS, last=False)
            super()._assign_work_unit(node)

    config.option.loadscopereorder = False  # the queue in collection order (xdist's default: by size)
    return SuiteScheduling(config, log)


SERVER_TESTS = "tests/server"


# What runs on every core's thread even beside another worker: the kernel unit tests, and the C++
# layer loop against the Python one (a few seconds).
EVERY_CORE = ("tests/unit/", "tests/integration/test_decoder_stack.py")


@pytest.fixture(autouse=True)
def kernel_threads(request):
    """A test of ``EVERY_CORE`` runs with every core's thread, even beside another worker."""
    if THREADS == CORES or not request.node.nodeid.startswith(EVERY_CORE):
        yield
        return
    torch.set_num_threads(CORES)
    try:
        yield
    finally:
        torch.set_num_threads(THREADS)


def pytest_collection_finish(session):
    """Start HF's side of the parity tests (``tests/hf_reference.py``) in a process of its own when
    a collected test needs it: transformers' GGUF load is slow single-threaded parsing, which then
    runs beside the tests before it instead of in line. Under xdist every worker collects every
    test, so there the fixture starts it when first used (beside the other worker's tests)."""
    if WORKERS == 1 and any("hf_parity_expected" in getattr(item, "fixturenames", ()) for item in session.items):
        session.config.stash[HF_REFERENCE] = HfReferenceProcess()


def pytest_sessionfinish(session):
    """A reference process no test waited for (the run stopped first) ends with the session."""
    proc = session.config.stash.get(HF_REFERENCE, None)
    if proc is not None and proc.proc.poll() is None:
        proc.proc.kill()
        proc.proc.wait()


@pytest.fixture(scope="session")
def hf_parity_expected(request, smollm_fp32, parity_prompts) -> list[list[int]]:
    """HF transformers' greedy continuation (32 tokens, ending at the first of the engine's EOS
    tokens) of each parity prompt, generated alone."""
    proc = request.config.stash.get(HF_REFERENCE, None) or HfReferenceProcess()
    prompts, continuations = proc.result()
    assert prompts == parity_prompts  # both processes tokenized the same text alike
    eos = smollm_fp32.engine.eos_token_ids
    return [c[:next((i + 1 for i, t in enumerate(c) if t in eos), len(c))] for c in continuations]


class HfReferenceProcess:
    """``python -m tests.hf_reference OUT``, started now; ``result`` waits for its JSON."""

    def __init__(self) -> None:
        import subprocess
        import sys
        import tempfile
        from pathlib import Path

        self.folder = tempfile.TemporaryDirectory(prefix="pagedllm-hf-reference-")
        self.out = Path(self.folder.name) / "reference.json"
        self.log = open(Path(self.folder.name) / "log.txt", "w+")  # noqa: SIM115 - read back in result()
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.hf_reference", str(self.out)],
                                     cwd=Path(__file__).parents[1], stdout=self.log, stderr=subprocess.STDOUT)

    def result(self) -> tuple[list[list[int]], list[list[int]]]:
        import json

        code = self.proc.wait(600)
        self.log.seek(0)
        assert code == 0, f"tests/hf_reference.py exited with {code}:\n{self.log.read()[-5000:]}"
        got = json.loads(self.out.read_text())
        return got["prompts"], got["continuations"]


HF_REFERENCE = pytest.StashKey[HfReferenceProcess]()


@pytest.fixture
def without_installed_builds(monkeypatch, tmp_path):
    """As where the package was installed without its C++ builds, with on-demand builds allowed
    (into a temporary cache): loading an extension compiles it, unless the test fakes the compiler."""
    from pagedllm import cpu_extension

    monkeypatch.setenv("PAGEDLLM_NO_BUILD", "0")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_extension, "load_installed", lambda source, here: (None, "there is no installed build"))


def force_cpu_family(monkeypatch, family: str):
    """Make the engine choose its kernels as on a CPU of ``family`` (``cpu_features.for_family``);
    skips, naming both families, where this CPU's oneDNN cannot run what that family would choose."""
    from pagedllm import cpu_features

    forced, real = cpu_features.CpuFeatures.for_family(family), cpu_features.detect()
    if not real.runs_kernels_of(forced):
        pytest.skip(f"this CPU ({real.describe()}) cannot run the oneDNN layouts chosen for {family} CPUs")
    monkeypatch.setattr(cpu_features, "current", lambda: forced)
    return forced


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    """HF transformers greedy generation of one prompt alone; returns only the new token ids."""
    inp = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                             pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def make_tiny_checkpoint(folder, arch: str, seed: int = 0, with_tokenizer: bool = False) -> str:
    """A tiny random Llama or Qwen2 checkpoint saved with save_pretrained; no tokenizer, or with
    ``with_tokenizer`` SmolLM2's own (and its vocabulary size, so every id it makes is valid)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=49152 if with_tokenizer else 512, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        cfg = LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True)
        model = Qwen2ForCausalLM(cfg)
    # random init is small; scale the weights up so greedy choices are decisive
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(8.0) if p.dim() == 2 and "embed" not in name else None
    model.save_pretrained(folder)
    if with_tokenizer:
        from pagedllm.models.loader import default_model_path
        from pagedllm.models.tokenizer import Tokenizer

        Tokenizer.load(default_model_path(), is_gguf=True).hf.save_pretrained(folder)
    return str(folder)
