"""Load through the real server: 64 concurrent greedy streaming clients with mixed lengths, a
quarter of them hanging up at random points. Every completed stream equals ``LLM.generate`` for its
prompt, with a matching usage; after the load /metrics shows 0 running and every block free."""

from __future__ import annotations

import asyncio
import random
import re
import time

import httpx
import openai

from pagedllm import SamplingParams
from tests.conftest import PROMPT_TEXT

MODEL = "smollm"


def metric(text: str, name: str) -> float:
    return float(re.search(rf"^pagedllm:{name} (\S+)$", text, re.M).group(1))


def wait_idle(url: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url + "/metrics").text
        idle = metric(text, "num_requests_running") == 0 and metric(text, "num_requests_waiting") == 0
        if idle or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


def test_64_concurrent_streams_with_hang_ups(server, smollm_fp32):
    rng = random.Random(7)
    words = PROMPT_TEXT.split()
    prompts = [" ".join(words[rng.randrange(0, 40):][:rng.randrange(3, 60)]) for _ in range(64)]
    max_tokens = [rng.randrange(4, 24) for _ in range(64)]
    cut = set(rng.sample(range(64), 16))
    cut_after = {i: rng.randrange(1, 4) for i in cut}

    async def run() -> dict[int, tuple[str, int | None]]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

        async def one(i: int) -> tuple[str, int | None]:
            stream = await client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=max_tokens[i],
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True})
            text, usage, chunks = "", None, 0
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
                for c in chunk.choices:
                    text += c.text
                chunks += 1
                if i in cut and chunks >= cut_after[i]:
                    await stream.close()  # hang up mid-stream
                    break
            return text, usage

        results = await asyncio.gather(*(one(i) for i in range(64)))
        await client.close()
        return dict(enumerate(results))

    results = asyncio.run(run())
    done = [i for i in range(64) if i not in cut]
    expected = smollm_fp32.generate([prompts[i] for i in done],
                                    [SamplingParams(temperature=0, max_tokens=max_tokens[i]) for i in done],
                                    use_tqdm=False)
    for i, out in zip(done, expected, strict=True):
        assert results[i] == (out.outputs[0].text, len(out.outputs[0].token_ids)), i
    text = wait_idle(server.url)
    assert metric(text, "num_requests_running") == 0 and metric(text, "num_requests_waiting") == 0
    assert metric(text, "num_free_blocks") == metric(text, "num_blocks")


def test_a_client_that_hangs_up_stops_its_request(server):
    before = metric(httpx.get(server.url + "/metrics").text, "generation_tokens_total")
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True,
                            "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    text = wait_idle(server.url)
    assert metric(text, "num_requests_running") == 0
    assert metric(text, "num_free_blocks") == metric(text, "num_blocks")
    assert metric(text, "generation_tokens_total") - before < 500  # stopped long before its 3000 tokens
