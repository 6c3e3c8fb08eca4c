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


def test_cuda_logprobs_equal_hf(tmp_path):
    from tests.integration.test_logprobs import check_logprobs_against_hf

    check_logprobs_against_hf(make_tiny_checkpoint(tmp_path / "llama", "llama", seed=5), "cuda")


def test_cuda_beam_search_and_every_sampling_feature(tmp_path):
    from transformers import AutoModelForCausalLM

    from pagedllm import BeamSearchParams
    from tests.integration.test_beam_search import hf_beam_search

    folder = make_tiny_checkpoint(tmp_path / "llama", "llama", seed=3)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(model=folder, dtype="float32", device="cuda", block_size=8, num_kv_blocks=64)
    prompt = list(range(100, 119))
    got = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True,
                                                                         length_penalty=0.0))[0].sequences
    assert [s.tokens for s in got] == [e[0] for e in hf_beam_search(hf, prompt, 4, 6)]
    params = SamplingParams(n=2, temperature=0.8, top_p=0.9, top_k=20, min_p=0.01, presence_penalty=0.5,
                            frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={5: 2.0}, min_tokens=2,
                            allowed_token_ids=list(range(3, 300)), seed=0, max_tokens=8, logprobs=2)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert all(3 <= t < 300 for c in out.outputs for t in c.token_ids) and len(out.outputs) == 2
    assert llm.kv_cache_stats()["num_free_blocks"] == 64
