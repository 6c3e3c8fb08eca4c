"""Why ``pagedllm serve`` builds its engine on the engine thread: decode speed of the same engine
stepped on the main thread, and on a background thread after the main thread has run torch ops
(``after-main``), or with everything on one background thread (``thread-only``, what the server does).

Usage: .venv/bin/python scripts/engine_thread_check.py [after-main|thread-only] (one mode per process).
"""

from __future__ import annotations

import sys
import threading
import time

TOKENS = 64
PROMPT = "the of and to in is that for it as was with be by on not he this are or his from at which but " * 4


def timed(llm, params, label: str) -> None:
    start, cpu = time.perf_counter(), time.process_time()
    llm.generate([PROMPT], params, use_tqdm=False)
    wall = time.perf_counter() - start
    print(f"{label:<32} {TOKENS / wall:6.1f} tok/s, {(time.process_time() - cpu) / wall:.2f} cores busy", flush=True)


def main(mode: str) -> None:
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    if mode == "after-main":
        llm = LLM(dtype="bfloat16")
        llm.generate([PROMPT], params, use_tqdm=False)  # warm up, on the main thread
        for _ in range(2):
            timed(llm, params, "main thread")
            t = threading.Thread(target=timed, args=(llm, params, "other thread, after main"))
            t.start()
            t.join()
    elif mode == "thread-only":
        def work() -> None:
            llm = LLM(dtype="bfloat16")
            llm.generate([PROMPT], params, use_tqdm=False)
            for _ in range(2):
                timed(llm, params, "one thread: built and stepped")
        t = threading.Thread(target=work)
        t.start()
        t.join()
    else:
        sys.exit(f"unknown mode {mode!r}: after-main or thread-only")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "after-main")
