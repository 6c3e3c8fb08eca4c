"""llama.cpp as a worker for ``pagedllm bench peers --peer llama.cpp``, run by the llama.cpp venv's Python.

Runs under ``.venv-llamacpp/bin/python`` (``llama-cpp-python`` built for this CPU by ``make
peers``), by path: it imports nothing from pagedllm. It speaks the protocol of
``peer_scripts/vllm_worker.py``: ``{"ready": ...}`` on stdout, then one JSON line per job read from stdin,
``{"prompts": [[token ids], ...], "max_tokens": [...]}`` -> ``{"seconds", "output_tokens",
"prompt_tokens", "token_ids"}``.

llama.cpp at its best for many requests is its batched decode (what its ``batched`` example and
``llama-server --parallel`` do), not one request after another: the low-level API, one context
with a KV stream per sequence (``n_seq_max`` = the most requests of any job, ``kv_unified`` off),
every prompt of a job prefilled in shared batches of up to ``n_batch`` tokens, then one step per
token with every unfinished sequence's next token in one ``llama_decode``. Greedy (the argmax of
each row of logits, as a temperature-0 sampler), EOS ignored, so every request generates exactly
``max_tokens``. Threads: all cores (``n_threads`` and ``n_threads_batch``), llama.cpp's defaults
otherwise (its flash attention on auto, an F16 KV cache).

argv: ``gguf n_seq_max n_ctx_per_seq threads``.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

import numpy as np


def main() -> None:
    path, n_seq_max, n_ctx_per_seq, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    out = os.fdopen(os.dup(1), "w")  # the protocol keeps stdout; llama.cpp's logs go to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import llama_cpp as L

    L.llama_backend_init()
    model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
    if not model:
        raise SystemExit(f"llama.cpp could not load {path}")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    params = L.llama_context_default_params()
    params.n_seq_max = n_seq_max
    params.n_ctx = n_seq_max * n_ctx_per_seq
    params.n_threads = params.n_threads_batch = threads
    params.kv_unified = False
    ctx = L.llama_init_from_model(model, params)
    if not ctx:
        raise SystemExit("llama.cpp could not create its context")
    n_batch = L.llama_n_batch(ctx)
    batch = L.llama_batch_init(max(n_batch, n_seq_max), 0, 1)
    memory = L.llama_get_memory(ctx)

    def decode(items: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) items."""
        batch.n_tokens = len(items)
        for i, (token, pos, seq, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError(f"llama_decode failed on a batch of {len(items)} tokens")

    def argmax(row: int) -> int:
        logits = np.ctypeslib.as_array(ctypes.cast(L.llama_get_logits_ith(ctx, row), ctypes.POINTER(ctypes.c_float)),
                                       shape=(n_vocab,))
        return int(logits.argmax())

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        if len(prompts) > n_seq_max:
            raise ValueError(f"{len(prompts)} prompts, and the context holds {n_seq_max} sequences")
        L.llama_memory_clear(memory, True)
        outputs: list[list[int]] = [[] for _ in prompts]
        # prefill: every prompt's tokens in shared batches, logits for each prompt's last token
        items = [(t, pos, seq, pos == len(p) - 1) for seq, p in enumerate(prompts) for pos, t in enumerate(p)]
        for start in range(0, len(items), n_batch):
            chunk = items[start:start + n_batch]
            decode(chunk)
            for row, (_, _, seq, logits) in enumerate(chunk):
                if logits:
                    outputs[seq].append(argmax(row))
        while True:
            live = [seq for seq, o in enumerate(outputs) if len(o) < max_tokens[seq]]
            if not live:
                return outputs
            decode([(outputs[s][-1], len(prompts[s]) + len(outputs[s]) - 1, s, True) for s in live])
            for row, seq in enumerate(live):
                outputs[seq].append(argmax(row))

    out.write(json.dumps({"ready": True, "system_info": L.llama_print_system_info().decode()}) + "\n")
    out.flush()
    for line in sys.stdin:
        job = json.loads(line)
        start = time.perf_counter()
        token_ids = generate(job["prompts"], job["max_tokens"])
        seconds = time.perf_counter() - start
        out.write(json.dumps({"seconds": seconds, "output_tokens": sum(map(len, token_ids)),
                              "prompt_tokens": sum(map(len, job["prompts"])), "token_ids": token_ids}) + "\n")
        out.flush()
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)


if __name__ == "__main__":
    main()
