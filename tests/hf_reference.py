"""HF transformers' side of the parity tests, in a process of its own (``conftest.py`` starts it when
the suite collects a test that needs it): the embedded SmolLM2 GGUF loaded by transformers in
float32, and its greedy continuation (32 new tokens, no EOS stop: the fixture cuts each at the
engine's first EOS token) of each parity prompt, generated alone. Written as JSON to the path
given: ``python -m tests.hf_reference OUT``."""

from __future__ import annotations

import json
import sys

import torch

from tests.conftest import hf_greedy, make_parity_prompts

NEW_TOKENS = 32


def main(out: str) -> None:
    from transformers import AutoModelForCausalLM

    from pagedllm.models.loader import default_model_path
    from pagedllm.models.tokenizer import Tokenizer

    torch.set_num_threads(1)  # it runs beside the suite's own tests
    path = default_model_path()
    prompts = make_parity_prompts(Tokenizer.load(path, is_gguf=True))
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # generate all 32: the fixture cuts at the engine's EOS set
    continuations = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    with open(out, "w") as f:
        json.dump({"prompts": prompts, "continuations": continuations}, f)


if __name__ == "__main__":
    main(sys.argv[1])
