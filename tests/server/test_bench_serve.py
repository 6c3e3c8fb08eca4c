"""``pagedllm bench serve``: against the real server (a few short requests), against servers that fail,
and against scripted SSE streams (how chunks, usage and mid-stream errors are counted). No timing is
asserted: only that the report is consistent with what was asked for and what the client saw."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from pagedllm.cli import main as cli_main
from pagedllm.loadgen.serve_bench import ServeBenchConfig, arrival_offsets, format_report, parse_logit_bias, run
from pagedllm.workloads.text import text_workload
from tests.server.conftest import free_port


class CountingTransport(httpx.AsyncBaseTransport):
    """Counts HTTP requests in flight (sent, response body not yet closed), independently of the bench."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.open = self.most = self.total = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.open += 1
        self.total += 1
        self.most = max(self.most, self.open)
        try:
            response = await self.inner.handle_async_request(request)
        except BaseException:
            self.open -= 1
            raise
        return httpx.Response(response.status_code, headers=response.headers, extensions=response.extensions,
                              stream=_Closing(response.stream, self))

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Closing(httpx.AsyncByteStream):
    def __init__(self, inner, owner: CountingTransport) -> None:
        self.inner, self.owner, self.closed = inner, owner, False

    async def __aiter__(self):
        async for part in self.inner:
            yield part

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.owner.open -= 1
        await self.inner.aclose()


def check_distribution(d: dict, count: int) -> None:
    assert d["count"] == count
    if count:
        assert d["p50"] <= d["p90"] <= d["p99"] <= d["max"]
        assert 0 <= d["mean"] <= d["max"]


def check_consistent(report: dict, cfg: ServeBenchConfig) -> None:
    """Everything a correct run must satisfy, whatever the machine's speed."""
    workload = text_workload(cfg.num_prompts, cfg.input_len, cfg.output_len, cfg.seed)
    assert report["completed"] == cfg.num_prompts and report["failed"] == 0, report["errors"]
    assert report["model_error"] is None and report["warmup_errors"] == []
    wanted = sum(r.output_len for r in workload)
    assert report["total_output_tokens"] == report["requested_output_tokens"] == wanted  # ignore_eos honoured
    assert report["streamed_chunks"] == wanted and report["usage_chunk_mismatches"] == 0
    assert report["requests_without_usage"] == 0
    # every word of the synthetic prompts is one SmolLM2 token, and the completions route adds none
    assert report["total_input_tokens"] == sum(r.num_words for r in workload)
    offsets = arrival_offsets(cfg.num_prompts, cfg.request_rate, cfg.seed)
    for req, w, due in zip(report["requests"], workload, offsets, strict=True):
        assert req["error"] is None
        assert req["output_tokens"] == req["streamed_chunks"] == req["requested_output_len"] == w.output_len
        assert req["prompt_tokens"] == req["prompt_words"] == w.num_words
        assert req["scheduled_s"] == round(due, 6) and req["start_s"] >= req["scheduled_s"]
        assert 0 < req["ttft_s"] <= req["e2e_s"] and req["start_s"] + req["e2e_s"] <= report["duration_s"] + 1e-3
        assert len(req["itl_s"]) == w.output_len - 1 and all(gap >= 0 for gap in req["itl_s"])
        if w.output_len > 1:
            expected_tpot = (req["e2e_s"] - req["ttft_s"]) / (w.output_len - 1)
            assert req["tpot_s"] == pytest.approx(expected_tpot, abs=1e-5)
    check_distribution(report["ttft_ms"], cfg.num_prompts)
    check_distribution(report["e2e_ms"], cfg.num_prompts)
    check_distribution(report["itl_ms"], wanted - cfg.num_prompts)
    check_distribution(report["tpot_ms"], sum(w.output_len > 1 for w in workload))
    assert report["output_throughput"] == pytest.approx(wanted / report["duration_s"], rel=1e-3)
    assert report["request_throughput"] == pytest.approx(cfg.num_prompts / report["duration_s"], rel=1e-3)
    assert report["client_cpu"]["process_s"] >= 0 and report["machine"]["cores"] >= 1


def test_cli_run_against_the_server_writes_a_consistent_report(server, tmp_path, capsys):
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--base-url", server.url + "/v1", "--num-prompts", "5", "--input-len", "4:12",
            "--output-len", "2:7", "--seed", "3", "--no-progress", "--json", str(out),
            "--server-pid", str(server.proc.pid)]
    assert cli_main(argv) == 0
    assert "Successful requests:" in capsys.readouterr().out
    report = json.loads(out.read_text())  # plain JSON (no Infinity)
    assert report["model"] == "smollm"  # the first id of GET /models
    assert report["settings"]["request_rate"] == "inf"
    cfg = ServeBenchConfig(num_prompts=5, input_len=(4, 12), output_len=(2, 7), seed=3)
    check_consistent(report, cfg)
    assert report["max_in_flight"] == 5  # no limit and all due at t = 0
    assert report["server_cpu"]["cpu_s"] > 0


def test_max_concurrency_is_never_exceeded(server):
    transport = CountingTransport()
    cfg = ServeBenchConfig(base_url=server.url + "/v1", model="smollm", num_prompts=6, input_len=(3, 8),
                           output_len=(3, 6), max_concurrency=2, seed=5, num_warmups=0, progress=False)
    report = run(cfg, http_client=httpx.AsyncClient(transport=transport))
    check_consistent(report, cfg)
    assert transport.total == 6 and transport.open == 0
    assert transport.most <= 2  # counted at the HTTP layer, apart from the bench's own count
    assert report["max_in_flight"] == 2


def test_request_rate_spaces_arrivals_and_chat_works(server):
    cfg = ServeBenchConfig(base_url=server.url + "/v1", model="smollm", endpoint="chat", num_prompts=4,
                           input_len=(3, 5), output_len=(2, 4), request_rate=40.0, seed=1, progress=False)
    report = run(cfg)
    assert report["completed"] == 4 and report["failed"] == 0, report["errors"]
    assert report["total_output_tokens"] == report["requested_output_tokens"] == report["streamed_chunks"]
    offsets = [r["scheduled_s"] for r in report["requests"]]
    assert offsets == [round(t, 6) for t in arrival_offsets(4, 40.0, 1)]
    assert offsets[0] == 0 and offsets == sorted(offsets) and len(set(offsets)) == 4
    for r in report["requests"]:
        assert r["start_s"] >= r["scheduled_s"] and r["ttft_s"] <= r["e2e_s"]
        assert r["prompt_tokens"] > r["prompt_words"]  # the chat template wraps the words


def test_a_server_without_speculation_reports_no_spec_decode(server):
    cfg = ServeBenchConfig(base_url=server.url + "/v1", model="smollm", num_prompts=2, input_len=(3, 5),
                           output_len=(3, 3), seed=2, num_warmups=0, progress=False)
    report = run(cfg)
    assert report["completed"] == 2 and report["spec_decode"] is None
    assert "Speculative Decoding" not in format_report(report)


def test_a_wrong_model_is_counted_as_failures(server):
    cfg = ServeBenchConfig(base_url=server.url + "/v1", model="no-such-model", num_prompts=3, input_len=(4, 4),
                           output_len=(2, 2), progress=False)
    report = run(cfg)
    assert report["completed"] == 0 and report["failed"] == 3
    [(message, count)] = report["errors"].items()
    assert count == 3 and message.startswith("HTTP 404") and "no-such-model" in message
    assert report["warmup_errors"] == [message]
    assert report["total_output_tokens"] == 0 and report["ttft_ms"]["mean"] is None


def test_an_unreachable_server_is_counted_not_raised(capsys):
    argv = ["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}/v1", "--num-prompts", "4",
            "--no-progress", "--timeout", "5"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "Failed requests:                                       4" in out
    assert "model: GET /models: APIConnectionError" in out


def test_offline_baseline_runs_the_same_workload(server, tmp_path):
    """``bench serve-offline`` generates exactly the tokens ``bench serve`` asks the server for."""
    args = ["--num-prompts", "3", "--input-len", "5:9", "--output-len", "2:4", "--seed", "11", "--no-progress"]
    cli_main(["bench", "serve-offline", *args, "--dtype", "float32", "--json", str(tmp_path / "off.json")])
    cli_main(["bench", "serve", *args, "--base-url", server.url + "/v1", "--json", str(tmp_path / "on.json")])
    off, on = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("off", "on"))
    assert off["completed"] == on["completed"] == 3 and on["failed"] == 0
    for key in ("total_input_tokens", "total_output_tokens", "requested_output_tokens"):
        assert off[key] == on[key], key
    assert off["settings"]["max_num_seqs"] == 64 and off["output_throughput"] > 0


# -- scripted streams: the counting rules, without a server --------------------------------------------

def _sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def _chat_chunk(delta: dict, finish: str | None = None) -> dict:
    return {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


USAGE = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [],
         "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}


def scripted(body: bytes) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "object": "model",
                                                                         "created": 0, "owned_by": "x"}]})
        sent = json.loads(request.content)
        assert sent["stream"] and sent["stream_options"] == {"include_usage": True} and sent["ignore_eos"] is True
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def scripted_run(body: bytes) -> dict:
    cfg = ServeBenchConfig(base_url="http://scripted/v1", endpoint="chat", num_prompts=2, input_len=(3, 3),
                           output_len=(3, 3), num_warmups=0, progress=False)
    return run(cfg, http_client=scripted(body))


def test_chat_role_chunk_is_not_a_token_but_an_empty_delta_is():
    body = _sse(_chat_chunk({"role": "assistant", "content": ""}), _chat_chunk({"content": "a"}),
                _chat_chunk({}), _chat_chunk({"content": "b"}, "length"), USAGE, "[DONE]")
    report = scripted_run(body)
    assert report["model"] == "m" and report["completed"] == 2 and report["failed"] == 0
    assert report["streamed_chunks"] == 6 and report["usage_chunk_mismatches"] == 0
    assert report["total_output_tokens"] == 6 and report["total_input_tokens"] == 14
    assert report["itl_ms"]["count"] == 4


def test_usage_that_disagrees_with_the_chunks_is_flagged():
    body = _sse(_chat_chunk({"content": "a"}), _chat_chunk({"content": "b"}, "length"), USAGE, "[DONE]")
    report = scripted_run(body)
    assert report["completed"] == 2 and report["usage_chunk_mismatches"] == 2
    assert report["total_output_tokens"] == 6 and report["streamed_chunks"] == 4


def test_an_error_chunk_mid_stream_fails_the_request():
    body = _sse(_chat_chunk({"content": "a"}),
                {"error": {"message": "engine step failed", "type": "InternalServerError", "code": 500}}, "[DONE]")
    report = scripted_run(body)
    assert report["completed"] == 0 and report["failed"] == 2
    assert "engine step failed" in next(iter(report["errors"]))


@pytest.mark.parametrize("tokens", [1, 3])
def test_a_stream_cut_before_its_finish_reason_fails_the_request(tokens):
    """With 2 or more chunks before the cut, the report used to crash (TPOT of a request without an end)."""
    report = scripted_run(_sse(*(_chat_chunk({"content": "a"}) for _ in range(tokens))))
    assert report["failed"] == 2 and report["errors"] == {"RuntimeError: the stream ended without a finish reason": 2}


def test_a_server_without_usage_or_ignore_eos_is_counted_by_chunks_and_gets_the_logit_bias():
    """llama.cpp's server: no usage in the stream, no ignore_eos; --logit-bias goes with every request."""
    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "object": "model",
                                                                         "created": 0, "owned_by": "x"}]})
        sent.append(json.loads(request.content))
        # three tokens, then a closing chunk with only the finish reason (llama.cpp's server does so)
        body = _sse(*(_chat_chunk({"content": c}) for c in "abc"), _chat_chunk({"content": ""}, "length"), "[DONE]")
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    cfg = ServeBenchConfig(base_url="http://scripted/v1", endpoint="chat", num_prompts=2, input_len=(3, 3),
                           output_len=(3, 3), num_warmups=0, progress=False,
                           logit_bias=parse_logit_bias('{"0": -100, "2": -100}'))
    report = run(cfg, http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    assert [r["logit_bias"] for r in sent] == [{"0": -100.0, "2": -100.0}] * 2
    assert report["completed"] == 2 and report["total_output_tokens"] == 6 == report["requested_output_tokens"]
    assert report["itl_ms"]["count"] == 4  # two gaps per request: the closing chunk is no token


def test_a_completions_closing_chunk_without_text_is_no_token():
    def chunk(text: str, finish: str | None = None) -> dict:
        return {"id": "c", "object": "text_completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "object": "model",
                                                                         "created": 0, "owned_by": "x"}]})
        body = _sse(chunk("a"), chunk("b"), chunk("c", None), chunk("", "length"), "[DONE]")
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    cfg = ServeBenchConfig(base_url="http://scripted/v1", num_prompts=2, input_len=(3, 3), output_len=(3, 3),
                           num_warmups=0, progress=False)
    report = run(cfg, http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    assert report["completed"] == 2 and report["total_output_tokens"] == 6 and report["streamed_chunks"] == 6


@pytest.mark.parametrize("text, message", [("{2: -100}", "not JSON"),
                                           ('{"eos": -100}', "expected an object of token ids"),
                                           ('[["2", -100]]', "expected an object"),
                                           ('{"2": true}', "expected an object")])
def test_a_bad_logit_bias_is_named(text, message):
    with pytest.raises(ValueError, match=f"--logit-bias: {message}"):
        parse_logit_bias(text)
    assert parse_logit_bias(None) is None


def test_arrivals_are_poisson_or_all_at_once():
    assert arrival_offsets(5, math.inf, 0) == [0.0] * 5
    t = arrival_offsets(4000, 8.0, 2)
    gaps = [b - a for a, b in zip(t, t[1:], strict=False)]
    assert t[0] == 0 and min(gaps) > 0 and t == arrival_offsets(4000, 8.0, 2)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 8.0, rel=0.06)  # exponential gaps of mean 1 / rate
    assert sorted(gaps)[len(gaps) // 2] == pytest.approx(math.log(2) / 8.0, rel=0.08)  # and its median
    assert t != arrival_offsets(4000, 8.0, 3)


@pytest.mark.parametrize("bad", [dict(endpoint="embeddings"), dict(num_prompts=0), dict(request_rate=0.0),
                                 dict(max_concurrency=0)])
def test_bad_settings_raise_before_any_request(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        run(ServeBenchConfig(base_url="http://127.0.0.1:1/v1", progress=False, **bad))


def test_a_trace_sets_the_prompts_lengths_and_arrivals(server, tmp_path):
    """``--trace`` on ``bench serve`` and ``bench serve-offline``: the trace's prompt lengths (one
    word, one token), output lengths and arrival times; shared prefixes are shared words."""
    from pagedllm.workloads.text import trace_text_workload
    from pagedllm.workloads.traces import TraceRequest, write_trace

    trace = [TraceRequest(arrival=0.0, prompt_len=10, output_len=3, prefix_id="p", prefix_len=6),
             TraceRequest(arrival=0.0, prompt_len=12, output_len=2, prefix_id="p", prefix_len=6),
             TraceRequest(arrival=0.3, prompt_len=9, output_len=4, conversation="c", turn=0),
             TraceRequest(arrival=0.5, prompt_len=14, output_len=2, conversation="c", turn=1),
             TraceRequest(arrival=0.5, prompt="hello there", output_len=2)]
    write_trace(tmp_path / "t.jsonl", trace)
    texts = [r.prompt for r in trace_text_workload(trace)]
    assert texts[0].split()[:6] == texts[1].split()[:6] and texts[0].split()[6:] != texts[1].split()[6:]
    assert texts[3].startswith(texts[2] + " ") and texts[4] == "hello there"
    common = ["--trace", str(tmp_path / "t.jsonl"), "--no-progress", "--num-warmups", "0"]
    url = server.url + "/v1"
    assert cli_main(["bench", "serve", *common, "--base-url", url, "--json", str(tmp_path / "on.json")]) == 0
    off_json = str(tmp_path / "off.json")
    assert cli_main(["bench", "serve-offline", *common, "--dtype", "float32", "--json", off_json]) == 0
    on, off = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("on", "off"))
    assert on["completed"] == 5 and on["failed"] == 0, on["errors"]
    assert [r["scheduled_s"] for r in on["requests"]] == [r.arrival for r in trace]
    assert all(r["start_s"] >= r["scheduled_s"] for r in on["requests"])
    assert [r["prompt_tokens"] for r in on["requests"]][:4] == [10, 12, 9, 14]
    assert [r["output_tokens"] for r in on["requests"]] == [r.output_len for r in trace]
    for key in ("total_input_tokens", "total_output_tokens"):
        assert off[key] == on[key], key
