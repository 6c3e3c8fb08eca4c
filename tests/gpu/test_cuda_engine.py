"""The engine on a CUDA device with the Triton backend (skipped on machines without a GPU;
`scripts/gpu_check.sh` runs these)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.conftest import hf_greedy, make_tiny_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_triton_engine_equals_hf(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    folder = make_tiny_checkpoint(tmp_path / arch, arch)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (1, 8, 9, 40, 70)]
    llm = LLM(model=folder, dtype="float32", device="cuda", block_size=16, num_kv_blocks=64)
    assert llm.engine.runner.backend.name == "triton"
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 16)
    assert llm.kv_cache_stats()["num_free_blocks"] == 64
