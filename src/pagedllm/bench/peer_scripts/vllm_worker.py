"""vLLM's offline engine as a worker for ``pagedllm bench peers``, run by the peer venv's Python.

Runs under ``.venv-peers/bin/python`` (vLLM's CPU build, its own torch and transformers), by path:
it imports nothing from pagedllm. It builds one ``vllm.LLM`` (the first start compiles for
minutes; later runs are warm), says ``{"ready": ...}`` on stdout, then answers one JSON line per
job read from stdin: ``{"prompts": [[token ids], ...], "max_tokens": [...]}`` ->
``{"seconds": wall time of generate, "output_tokens": n, "prompt_tokens": n, "token_ids": [[...], ...]}``
(each request's generated ids, for the greedy agreement). Greedy, EOS
ignored, so every request generates exactly ``max_tokens``. vLLM spawns processes: everything
runs under ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    model, dtype, max_num_seqs = sys.argv[1], sys.argv[2], int(sys.argv[3])
    # the protocol keeps stdout to itself: everything else written to fd 1 (vLLM's logs and
    # prints, its engine processes, which inherit the fd) goes to stderr
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype=dtype, max_num_seqs=max_num_seqs, seed=0)  # defaults otherwise, as a user would
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        job = json.loads(line)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in job["max_tokens"]]
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        out.write(json.dumps({"seconds": seconds,
                              "output_tokens": sum(len(r.outputs[0].token_ids) for r in results),
                              "prompt_tokens": sum(len(r.prompt_token_ids) for r in results),
                              "token_ids": [list(r.outputs[0].token_ids) for r in results]}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
