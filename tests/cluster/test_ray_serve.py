"""``pagedllm serve --replicas 2`` on a local Ray cluster: two replicas of a tiny random Llama (with
SmolLM2's tokenizer) behind one OpenAI endpoint, driven with the official ``openai`` client.

One cluster for the module (started as a user would, in a subprocess, Ray's files in a temporary
directory of its own); its last test stops it with SIGINT and checks that no process it started is
left. Routing is checked against the decisions the router logs with the loads it saw (``/cluster``),
never timings; the replicas' cached sets against the router's view, by digest.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.conftest import make_tiny_checkpoint
from tests.server.conftest import ServerProcess

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

BLOCK = 8


def ray_processes(temp_dir: str) -> list[str]:
    """Processes whose command line names the cluster's temporary directory (Ray's own)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if temp_dir in cmd and state != "Z":
            found.append(f"{pid}: {cmd[:120]}")
    return found


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("cluster") / "tiny", "llama", seed=2, with_tokenizer=True)
    temp_dir = tempfile.mkdtemp(prefix="pgr-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    proc = ServerProcess("--replicas", "2", "--replica-cpus", "0.5", "--routing-load-threshold", "1",
                         "--routing-min-match-rate", "0.4",  # not the default: /cluster must show it
                         "--model", str(folder), "--dtype", "float32", "--num-kv-blocks", "128",
                         "--block-size", str(BLOCK), "--max-num-seqs", "4", "--served-model-name", "tiny",
                         env={"RAY_TMPDIR": temp_dir}, timeout=240)
    proc.temp_dir = temp_dir
    proc.folder = folder
    yield proc
    proc.stop(signal.SIGINT, timeout=60)


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=60)


def view(cluster) -> dict:
    return httpx.get(cluster.url + "/cluster", timeout=10).json()


def wait_for(predicate, timeout: float = 20.0, what: str = "the condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} did not hold within {timeout} s")


def decision_of(cluster, response_id: str) -> dict:
    """The router's decision for a request, logged when Ray reports the request routed (on the
    router's own event loop, so it may come just after a short answer)."""
    request_id = f"{response_id}-0"
    return wait_for(lambda: next((d for d in view(cluster)["decisions"] if d["request_id"] == request_id), None),
                    what=f"the router's decision for {request_id}")


def test_every_route_through_the_cluster(cluster, client):
    assert [m.id for m in client.models.list()] == ["tiny"]
    done = client.completions.create(model="tiny", prompt="Paged attention", max_tokens=5, temperature=0)
    assert done.usage.completion_tokens == 5 and done.choices[0].finish_reason == "length"
    again = client.completions.create(model="tiny", prompt="Paged attention", max_tokens=5, temperature=0)
    assert again.choices[0].text == done.choices[0].text  # greedy: the same on either replica
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    assert chat.usage.completion_tokens == 4 and len(chat.choices[0].logprobs.content) == 4
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 4
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    structured = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a number"}], max_tokens=24, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    if structured.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(structured.choices[0].message.content)["n"], int)
    response = client.responses.create(model="tiny", input="hello", max_output_tokens=3, temperature=0)
    assert response.status in ("completed", "incomplete") and response.usage.output_tokens == 3
    # errors are the single server's: precise, before any replica is bothered
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="tiny", prompt=[1] * 600, max_tokens=2)
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as bad_schema:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": "nonsense"}}})
    assert bad_schema.value.code == "invalid_response_format"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=2)
    tokens = httpx.post(cluster.url + "/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    assert httpx.post(cluster.url + "/detokenize", json={"tokens": tokens}).json()["prompt"] == "hello world"
    # /metrics: each replica's series with its label, then the router's
    reported = wait_for(lambda: len(view(cluster)["reported"]) == 2 and view(cluster)["reported"],
                        what="both replicas reporting")

    def served() -> float:  # the replicas report every second
        text = httpx.get(cluster.url + "/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pagedllm:request_success_total{"))

    wait_for(lambda: served() == 6, what="six requests counted across the replicas")
    text = httpx.get(cluster.url + "/metrics").text
    for replica in reported:
        assert f'pagedllm:num_blocks{{replica="{replica}"}} 128.0' in text
        assert f'pagedllm:router_requests_total{{replica="{replica}"}}' in text
    state = httpx.get(cluster.url + "/dashboard/state").json()
    assert sorted(r["replica"] for r in state["replicas"]) == sorted(reported)
    assert all(len(r["states"]) == 128 for r in state["replicas"]) and state["routing"] == "prefix-aware"


def conversation(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "You are a careful assistant who answers in full sentences."}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question {i}: tell me about block number {i * 7} of the pool."})
        if i < turns - 1:
            messages.append({"role": "assistant", "content": f"Block {i * 7} holds eight tokens of keys and values."})
    return messages


def test_a_follow_up_turn_goes_to_the_replica_that_served_the_conversation(cluster, client):
    settings = view(cluster)
    assert (settings["routing"], settings["load_threshold"], settings["min_match_rate"]) == ("prefix-aware", 1, 0.4)
    first = client.chat.completions.create(model="tiny", messages=conversation(1), max_tokens=2, temperature=0)
    replica = view(cluster)["served"][f"{first.id}-0"]
    prompt_blocks = first.usage.prompt_tokens // BLOCK
    wait_for(lambda: next(r for r in view(cluster)["replicas"] if r["replica"] == replica)["cached_blocks"]
             >= prompt_blocks, what="the router's view of the first turn")
    second = client.chat.completions.create(model="tiny", messages=conversation(2), max_tokens=2, temperature=0)
    decision = decision_of(cluster, second.id)
    assert decision["replica"] == replica and decision["reason"] == "prefix"
    assert decision["prefix_blocks"] >= prompt_blocks - 1  # the first turn's blocks, less the generation prompt's
    assert second.usage.prompt_tokens_details.cached_tokens >= (prompt_blocks - 1) * BLOCK
    # another cache_salt hashes apart: the router finds no replica holding any of it
    salted = client.chat.completions.create(model="tiny", messages=conversation(2), max_tokens=2, temperature=0,
                                            extra_body={"cache_salt": "tenant-b"})
    assert decision_of(cluster, salted.id)["reason"] == "no_prefix"
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_every_short_answer_of_a_burst_has_its_decision_and_leaves_nothing_in_flight(cluster):
    """Ray may report a short answer completed before it reports it routed (its router registers the
    completion callback first): one-token answers sixteen at a time did so for 1-4% of them on a
    2-core machine with its cores busy (scripts/router_burst.py), and each such request lost its
    logged decision and stayed in its replica's load."""
    def answered(i: int) -> str:
        r = httpx.post(cluster.url + "/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": f"burst {i} " * 6, "max_tokens": 1})
        assert r.status_code == 200, r.text
        return r.json()["id"] + "-0"

    with ThreadPoolExecutor(16) as pool:
        ids = list(pool.map(answered, range(160)))
    wait_for(lambda: all(r["in_flight"] == 0 for r in view(cluster)["replicas"]),
             what="no request left in flight on any replica")
    logged = {d["request_id"] for d in view(cluster)["decisions"]}
    assert [rid for rid in ids if rid not in logged] == []


def test_a_saturated_prefix_holder_is_passed_over_for_the_least_loaded(cluster, client):
    long = dict(model="tiny", max_tokens=440, temperature=0, stream=True, extra_body={"ignore_eos": True})
    messages = [{"role": "system", "content": "Count the blocks of the pool, one by one, and never stop."},
                {"role": "user", "content": "Go on."}]
    first = client.chat.completions.create(messages=messages, **long)
    head = next(iter(first))
    holder = view(cluster)["served"][f"{head.id}-0"]
    wait_for(lambda: next(r for r in view(cluster)["replicas"] if r["replica"] == holder)["cached_blocks"] >= 3,
             what="the router's view of the first request")
    streams, ids = [first], []
    try:
        for _ in range(6):  # the same prompt again while the earlier ones still run, until one is moved
            stream = client.chat.completions.create(messages=messages, **long)
            streams.append(stream)
            ids.append(f"{next(iter(stream)).id}-0")
            if decision_of(cluster, ids[-1][:-2])["reason"] == "overloaded":
                break
        decisions = [decision_of(cluster, rid[:-2]) for rid in ids]
        assert decisions[-1]["reason"] == "overloaded"
        for d in decisions:  # each choice as the rule says, given the loads the router saw
            over = d["loads"][holder] - min(d["loads"].values())
            if over > 1:
                assert d["reason"] == "overloaded" and d["replica"] != holder
                assert d["loads"][d["replica"]] == min(d["loads"].values())
            else:
                assert d["reason"] == "prefix" and d["replica"] == holder
    finally:
        for s in streams:
            s.close()


def test_a_client_that_hangs_up_frees_the_replicas_blocks(cluster):
    body = {"model": "tiny", "prompt": "hang up " * 20, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=60) as r:
        first = next(r.iter_lines())
    rid = json.loads(first.removeprefix("data: "))["id"] + "-0"
    replica = view(cluster)["served"][rid]

    def idle() -> bool:
        state = next(s for s in httpx.get(cluster.url + "/dashboard/state").json()["replicas"]
                     if s["replica"] == replica)
        return not state["running"] and not state["waiting"] and state["counts"]["used"] == 0

    wait_for(idle, what="the request aborted and its blocks freed")
    assert view(cluster)["decisions"][-1]["request_id"] == rid


def test_kv_events_rebuild_each_replicas_cached_set_after_evictions(cluster, client):
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
    prompt_blocks = 0
    for i, w in enumerate(words * 4):  # 128 blocks a replica: these evict one another
        done = client.completions.create(model="tiny", prompt=f"{w} {i} " * (20 + i % 5), max_tokens=3 + i % 4,
                                         temperature=0.8, seed=i, n=1 + i % 2)
        prompt_blocks += done.usage.prompt_tokens // BLOCK
    metrics = httpx.get(cluster.url + "/metrics").text
    assert any(line.startswith("pagedllm:num_cached_blocks{") for line in metrics.splitlines())

    def same() -> bool:
        v = view(cluster)
        mine = {r["replica"]: r["cached_digest"] for r in v["replicas"]}
        theirs = {r: rep["cached_digest"] for r, rep in v["reported"].items()}
        return len(theirs) == 2 and mine == theirs and all(r["exact"] for r in v["replicas"])

    wait_for(same, what="the router's view equal to each replica's cached set")
    held = [int(r["cached_digest"].split(":")[0]) for r in view(cluster)["replicas"]]
    assert all(held) and sum(held) < prompt_blocks  # blocks were evicted (and the events said so)


def test_a_replica_that_cannot_start_fails_in_one_line(cluster):
    import ray

    from pagedllm.cluster.app import ClusterConfig
    from pagedllm.cluster.ingress import IngressSettings
    from pagedllm.cluster.launch import ClusterStartError, start, stop

    os.environ["RAY_TMPDIR"] = cluster.temp_dir
    try:
        with pytest.raises(ClusterStartError) as failed:
            start({"model": "/nonexistent/model.gguf"}, ClusterConfig(num_replicas=1, num_cpus=0),
                  IngressSettings(), "127.0.0.1", 0, ray_address="auto", app_name="broken", route_prefix="/broken")
        message = str(failed.value)
        assert "\n" not in message and message.startswith("pagedllm replica could not start: ")
        assert "/nonexistent/model.gguf" in message
        assert httpx.get(cluster.url + "/health").status_code == 200  # the serving application is untouched
    finally:
        stop(False, "broken")
        ray.shutdown()
        os.environ.pop("RAY_TMPDIR", None)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed (the Makefile's "
                                                             "install step runs `apt-get install -y chromium`)")
def test_the_dashboard_shows_each_replicas_pool(cluster):
    from playwright.sync_api import sync_playwright

    reported = wait_for(lambda: len(view(cluster)["reported"]) == 2 and sorted(view(cluster)["reported"]),
                        what="both replicas reporting")
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=shutil.which("chromium"), headless=True,
                                     args=["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"])
        try:
            page = browser.new_page()
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{cluster.url}/dashboard?interval=100")
            page.wait_for_function("document.querySelectorAll('#replica option').length === 2", timeout=20000)
            assert sorted(page.eval_on_selector_all("#replica option", "os => os.map(o => o.value)")) == reported
            assert page.is_visible("#replicas")
            for replica in reported:  # each replica's pool, chosen from the selector
                page.select_option("#replica", replica)
                page.wait_for_function(f"window.pagedllmDashboard.state && "
                                       f"window.pagedllmDashboard.state.replica === '{replica}'", timeout=20000)
                shown = page.evaluate("({n: window.pagedllmDashboard.layout.n, "
                                      "blocks: window.pagedllmDashboard.state.states.length})")
                assert shown == {"n": 128, "blocks": 128}
                assert page.inner_text("#pool-info").startswith("128 blocks")
        finally:
            browser.close()
    assert not errors, errors


def test_a_killed_replica_fails_its_streams_and_the_rest_carry_on(cluster, client):
    long = dict(model="tiny", max_tokens=300, temperature=0, stream=True, extra_body={"ignore_eos": True})
    streams, owners = [], {}
    for i in range(6):  # until both replicas hold a stream
        stream = client.completions.create(prompt=f"stream {i} " * 3, **long)
        head = next(iter(stream))
        owners[view(cluster)["served"][f"{head.id}-0"]] = stream
        streams.append(stream)
        if len(owners) == 2:
            break
    assert len(owners) == 2
    victim, survivor = sorted(owners)
    pid = view(cluster)["reported"][victim]["pid"]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(openai.APIError) as lost:
        for _ in owners[victim]:
            pass
    assert "replica" in str(lost.value)
    finished = [c.choices[0].finish_reason for c in owners[survivor] if c.choices]
    assert finished[-1] == "length"
    for s in streams:
        s.close()
    for i in range(4):  # the next requests are served (by the survivor, then by the replacement too)
        done = client.completions.create(model="tiny", prompt=f"after {i}", max_tokens=3, temperature=0)
        assert done.usage.completion_tokens == 3
    # Ray starts a replacement, which reports in; the dead one's reports expire
    wait_for(lambda: len(view(cluster)["reported"]) == 2 and victim not in view(cluster)["reported"],
             timeout=120, what="Ray replacing the killed replica")


def test_ctrl_c_stops_every_replica_and_leaves_no_ray_process(cluster):
    assert ray_processes(cluster.temp_dir)  # the cluster's: raylet, GCS, replicas
    for _ in range(2):  # Ctrl-C three times at once (the handler once deadlocked on a second one)
        cluster.proc.send_signal(signal.SIGINT)
    code, output = cluster.stop(signal.SIGINT, timeout=90)
    assert code == 0, output[-2000:]
    assert "stopping the cluster" in output
    wait_for(lambda: not ray_processes(cluster.temp_dir), timeout=20, what="every Ray process gone")
