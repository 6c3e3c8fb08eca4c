"""``pagedllm serve --speculative-config``: a real server (the default model) whose answers, streamed
or not, equal those of requests that opt out of speculation (``speculative_decoding: false``), with
``pagedllm:spec_decode_*`` on /metrics counting only the requests that guess."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from pagedllm.engine.builder import INERT_SPECULATION
from tests.conftest import PROMPT_TEXT
from tests.server.conftest import ServerProcess

MESSAGES = [{"role": "user", "content": "Repeat this text word for word:\n\n" + PROMPT_TEXT}]


@pytest.fixture(scope="module")
def spec_server():
    proc = ServerProcess("--kv-cache-memory", "64MiB", "--served-model-name", "smollm",
                         "--speculative-config", '{"method": "suffix", "num_speculative_tokens": 5}')
    yield proc
    proc.stop()


def inert(server: ServerProcess) -> bool:
    """Whether the server warned at start that it makes no guesses: a CPU family whose small-step
    kernels compute rows alone only one at a time (AVX-512 without BF16: its 1-row bf16 head)."""
    return INERT_SPECULATION in server.read_output()


def metric(text: str, name: str) -> float:
    match = re.search(rf"^pagedllm:{name}(?:_total)? ([0-9.e+-]+)$", text, re.M)
    assert match, name
    return float(match.group(1))


def test_answers_equal_the_opted_out_ones_and_the_metrics_count_the_guesses(spec_server):
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0)

    def scrape() -> str:
        return httpx.get(spec_server.url + "/metrics").text

    start = scrape()
    # each its own cache_salt: every prompt is computed afresh (a prefix-cache hit computes the rest of
    # the prompt as a shorter chunk, whose dense bf16 GEMMs round differently)
    plain = client.chat.completions.create(model="smollm", messages=MESSAGES, max_tokens=60, temperature=0,
                                           extra_body={"speculative_decoding": False, "cache_salt": "a"})
    after_plain = scrape()
    assert metric(after_plain, "spec_decode_num_drafts") == metric(start, "spec_decode_num_drafts")
    guessed = client.chat.completions.create(model="smollm", messages=MESSAGES, max_tokens=60, temperature=0,
                                             extra_body={"cache_salt": "b"})
    stream = client.chat.completions.create(model="smollm", messages=MESSAGES, max_tokens=60, temperature=0,
                                            stream=True, extra_body={"cache_salt": "c"})
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert guessed.choices[0].message.content == plain.choices[0].message.content == streamed
    assert guessed.usage.completion_tokens == plain.usage.completion_tokens
    end = scrape()
    drafts = metric(end, "spec_decode_num_drafts") - metric(after_plain, "spec_decode_num_drafts")
    accepted = metric(end, "spec_decode_num_accepted_tokens") - metric(after_plain, "spec_decode_num_accepted_tokens")
    if inert(spec_server):
        assert drafts == 0 and accepted == 0
        return
    assert drafts > 0 and accepted > 20
    assert 0 < metric(end, "spec_decode_acceptance_rate") <= 1
    assert metric(end, "spec_decode_mean_accepted_length") > 1
    per_pos = re.findall(r'^pagedllm:spec_decode_num_accepted_tokens_per_pos_total\{position="(\d+)"\} ([0-9.e+]+)$',
                         end, re.M)
    assert [int(p) for p, _ in per_pos] == list(range(len(per_pos))) and len(per_pos) <= 5
    assert sum(float(v) for _, v in per_pos) == metric(end, "spec_decode_num_accepted_tokens")


def test_completions_and_batch_take_the_opt_out_too(spec_server):
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0)
    prompt = "Repeat: " + PROMPT_TEXT[:200] + "\nRepeat: "
    texts = [client.completions.create(model="smollm", prompt=prompt, max_tokens=40, temperature=0,
                                       extra_body={"speculative_decoding": flag, "cache_salt": str(flag)}
                                       ).choices[0].text for flag in (False, True)]
    assert texts[0] == texts[1] and texts[0]
    body = {"model": "smollm", "messages": [MESSAGES, MESSAGES], "max_tokens": 20, "temperature": 0,
            "speculative_decoding": False}
    drafts = metric(httpx.get(spec_server.url + "/metrics").text, "spec_decode_num_drafts")
    got = client.post("/chat/completions/batch", body=body, cast_to=openai.types.chat.ChatCompletion)
    assert len(got.choices) == 2 and all(c.message.content for c in got.choices)
    assert metric(httpx.get(spec_server.url + "/metrics").text, "spec_decode_num_drafts") == drafts  # none guessed


def test_bench_serve_reports_the_servers_guesses_over_its_run(spec_server):
    from pagedllm.loadgen.serve_bench import ServeBenchConfig, format_report, run

    before = httpx.get(spec_server.url + "/metrics").text
    cfg = ServeBenchConfig(base_url=spec_server.url + "/v1", model="smollm", endpoint="chat", num_prompts=3,
                           input_len=(40, 60), output_len=(48, 48), seed=4, num_warmups=0, progress=False,
                           max_concurrency=1)  # three at once rarely pay for a guess (the drafter's gain bound)
    report = run(cfg)
    after = httpx.get(spec_server.url + "/metrics").text
    spec = report["spec_decode"]
    assert report["completed"] == 3 and spec is not None
    for key, name in (("drafts", "spec_decode_num_drafts"), ("draft_tokens", "spec_decode_num_draft_tokens"),
                      ("accepted_tokens", "spec_decode_num_accepted_tokens")):
        assert spec[key] == metric(after, name) - metric(before, name)
    if inert(spec_server):
        assert spec["drafts"] == 0
        return
    assert spec["drafts"] > 0  # random words: the small model's continuations repeat themselves
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted_tokens"] / spec["draft_tokens"])
    assert "Acceptance rate (%):" in format_report(report)


def test_a_bad_speculative_config_fails_at_start_in_one_line():
    with pytest.raises(RuntimeError, match="speculative_config") as err:
        ServerProcess("--speculative-config", '{"method": "medusa"}', timeout=60)
    assert "Traceback" not in str(err.value)
