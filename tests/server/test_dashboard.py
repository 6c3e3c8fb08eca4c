"""The dashboard in a real browser: Debian's chromium driven by playwright (never a browser build
that playwright downloads), on an in-process server on a real port, while a load runs (streaming
requests, some with n = 3 so blocks are shared, some repeating a prefix so blocks are cached):
- the page updates itself: its engine step (``#step[data-step]``) moves on while requests run;
- its per-state block counts equal ``/metrics`` read at the same engine step, and its block states
  and owners equal the engine's own blocks (ref counts, hashes, tables) read at that step;
- the grid is drawn in the legend's colours, and hovering a block names its owner;
- a screenshot is taken during the load (``PAGEDLLM_DASHBOARD_SCREENSHOT=docs/plots/dashboard.png``
  writes it there: that is how the README's picture is made).

Matching steps: the engine steps every few ms, so a page poll and a /metrics scrape rarely run
between the same two steps by chance. The test holds the engine thread between two steps (an
``AsyncEngine.call`` that waits), lets the page's next poll and its own requests queue up behind
it, and releases it: they then run in one batch of commands, at one step, with the test's own
reading of the blocks (queued there too). It compares only when the steps are equal, and tries
again otherwise.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import sync_playwright

from pagedllm.server.app import build_app
from tests.server.conftest import engine_held, serve_on_thread, tiny_context
from tests.server.test_metrics import samples

CHROMIUM = shutil.which("chromium")
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--no-first-run"]
POLL_MS = 100
NAMES = ("free", "cached", "used", "shared")
SHARED_PREFIX = list(range(1000, 1048))  # 6 full blocks of 8 tokens, hit by every "repeat" request
SIBLING_PROMPT = list(range(2000, 2030))  # n = 3: the siblings share its blocks


def request_body(client: int, i: int) -> dict:
    """The i-th request of a client: n = 3 samples, a repeated prefix, or a fresh prompt."""
    body = {"max_tokens": 40, "ignore_eos": True, "stream": True, "temperature": 0.8, "seed": 1000 * client + i}
    kind = (client + i) % 3
    if kind == 0:
        return {**body, "prompt": SIBLING_PROMPT, "n": 3}
    if kind == 1:
        return {**body, "prompt": SHARED_PREFIX + [3000 + i % 7]}
    rng = random.Random(7919 * client + i)
    return {**body, "prompt": [rng.randrange(5, 49000) for _ in range(rng.randrange(8, 40))]}


def _is_error(line: str) -> bool:
    """An SSE event carrying an error object (not a completion whose text happens to be "error")."""
    return line.startswith("data: ") and "error" in json.loads(line[len("data: "):])


class Load:
    """Streaming completions from ``clients`` threads until ``stop()``, at most ``max_requests``."""

    def __init__(self, url: str, clients: int = 4, max_requests: int = 1500) -> None:
        self.url, self.left = url, max_requests
        self.errors: list[str] = []
        self.completed = 0
        self._lock, self._stopping = threading.Lock(), threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(clients)]
        for t in self.threads:
            t.start()

    def _take(self) -> bool:
        with self._lock:
            if self.left <= 0 or self._stopping.is_set():
                return False
            self.left -= 1
            return True

    def _client(self, k: int) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            i = 0
            while self._take():
                try:
                    with client.stream("POST", "/v1/completions", json=request_body(k, i)) as r:
                        lines = [line for line in r.iter_lines() if line]
                    if r.status_code != 200 or lines[-1] != "data: [DONE]" or any(_is_error(x) for x in lines[:-1]):
                        self.errors.append(f"{r.status_code}: {lines[-3:]}")
                    with self._lock:
                        self.completed += 1
                except Exception as exc:  # noqa: BLE001 - reported by the test
                    self.errors.append(repr(exc))
                    return
                i += 1

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def stop(self) -> None:
        self._stopping.set()
        for t in self.threads:
            t.join(120)


@pytest.fixture
def live_server(tiny_folder):
    """(url, ServerContext): the app over the tiny Llama, served by uvicorn on a thread."""
    ctx = tiny_context(tiny_folder, num_kv_blocks=256, block_size=8, max_num_seqs=8)
    ctx.max_queue = 64
    with serve_on_thread(build_app(ctx)) as url:
        yield url, ctx
    ctx.engine.shutdown()


# What the page shows, read in one go (JavaScript runs one task at a time, so this is one update).
_READ = """() => {
  const text = (id) => document.getElementById(id).textContent;
  const d = window.pagedllmDashboard.state;
  return {step: Number(document.getElementById('step').dataset.step), stepText: text('step'),
          counts: Object.fromEntries(['free', 'cached', 'used', 'shared', 'hashed'].map(n => [n, text('count-' + n)])),
          running: text('num-running'), waiting: text('num-waiting'),
          states: d ? d.states : null, tables: d ? d.tables : null};
}"""
# The same, as soon as the page shows step >= target (a MutationObserver runs right after the update).
READ_AT_STEP = f"""(target) => new Promise((resolve) => {{
  const read = {_READ}, step = document.getElementById('step');
  if (Number(step.dataset.step) >= target) return resolve(read());
  const observer = new MutationObserver(() => {{
    if (Number(step.dataset.step) >= target) {{ observer.disconnect(); resolve(read()); }}
  }});
  observer.observe(step, {{attributes: true, attributeFilter: ['data-step']}});
  setTimeout(() => {{ observer.disconnect(); resolve(null); }}, 20000);
}})"""
READ_NOW = f"() => ({_READ})()"
# Canvas pixels at the centre of the given blocks' cells (CSS px inside the canvas, and the RGB).
PIXELS = """(ids) => {
  const g = document.getElementById('grid'), c = g.getContext('2d');
  const cell = +g.dataset.cell, cols = +g.dataset.cols, s = +g.dataset.scale, half = Math.floor(cell / 2);
  return ids.map((i) => {
    const x = (i % cols) * cell + half, y = Math.floor(i / cols) * cell + half;
    return {x, y, rgb: Array.from(c.getImageData(x * s, y * s, 1, 1).data.slice(0, 3))};
  });
}"""
SWATCHES = """() => Object.fromEntries([...document.querySelectorAll('.swatch')].map(
  (el) => [el.dataset.state, getComputedStyle(el).backgroundColor.match(/\\d+/g).slice(0, 3).map(Number)]))"""


def number(text: str) -> int:
    return int(re.sub(r"\D", "", text))


def first_block_of_each_state(states: str) -> dict[str, int]:
    return {name: states.index(str(code)) for code, name in enumerate(NAMES) if str(code) in states}


def check_grid_and_hover(page) -> dict | None:
    """On a page that does not change (the engine is held): the cells of one block per state are
    drawn in the legend's colours, and hovering a used and a shared block names their holders (the
    pointer stays on the last one, so a screenshot shows its tooltip). Returns the page's reading,
    or None, checking nothing, if the page updated meanwhile (a poll answered just before the hold)."""
    before = page.evaluate(READ_NOW)
    blocks = first_block_of_each_state(before["states"])
    swatches = page.evaluate(SWATCHES)
    pixels = dict(zip(blocks, page.evaluate(PIXELS, list(blocks.values())), strict=True))
    box = page.locator("#grid").bounding_box()
    tips = {}
    for name in ("used", "shared"):
        if name in blocks:
            page.mouse.move(box["x"] + pixels[name]["x"], box["y"] + pixels[name]["y"])
            tips[name] = page.locator("#tooltip").text_content()
    if page.evaluate(READ_NOW)["step"] != before["step"]:
        return None
    assert len({tuple(c) for c in swatches.values()}) == 4, swatches
    for name, px in pixels.items():
        assert px["rgb"] == swatches[name], (name, blocks[name], px, swatches)
    for name, tip in tips.items():
        i = blocks[name]
        holders = [rid for rid, ids in before["tables"].items() if i in ids]
        if name == "used":
            assert holders and tip == f"block {i}: used by {holders[0]} (ref 1)", (tip, holders)
        else:
            assert len(holders) > 1 and tip.startswith(f"block {i}: shared by {len(holders)} requests"), (tip, holders)
            assert holders[0] in tip, (tip, holders)
    return before


def engine_view(engine) -> dict:
    """The pool as the test reads it on the engine thread, independently of ``server/dashboard.py``:
    every block's ref count and hash, every block table."""
    kv = engine.kv_manager
    codes = ["3" if b.ref_count > 1 else "2" if b.ref_count == 1 else "1" if b.block_hash is not None else "0"
             for b in kv.allocator.blocks]
    return {"step": engine.num_steps, "states": "".join(codes),
            "hashed": sum(b.block_hash is not None for b in kv.allocator.blocks),
            "tables": {rid: t.block_ids for rid, t in kv.tables.items()}}


def compare_at_one_step(page_read: dict, metrics: dict, view: dict) -> dict[str, int]:
    """The page at step S against /metrics and the engine's own blocks at step S; its counts."""
    c = {name: number(text) for name, text in page_read["counts"].items()}
    total = metrics["pagedllm:num_blocks"]
    assert c["free"] + c["cached"] + c["used"] + c["shared"] == total == 256
    assert c["free"] + c["cached"] == metrics["pagedllm:num_free_blocks"]
    assert c["used"] + c["shared"] == total - metrics["pagedllm:num_free_blocks"]
    assert c["hashed"] == metrics["pagedllm:num_cached_blocks"] == view["hashed"]
    assert number(page_read["running"]) == metrics["pagedllm:num_requests_running"]
    assert number(page_read["waiting"]) == metrics["pagedllm:num_requests_waiting"]
    assert {name: view["states"].count(str(code)) for code, name in enumerate(NAMES)} == {n: c[n] for n in NAMES}
    assert page_read["states"] == view["states"] and page_read["tables"] == view["tables"]
    assert page_read["stepText"] == f"step {view['step']:,}"
    return c


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (the Makefile's install step "
                                             "runs `apt-get install -y chromium`; it needs apt and root)")
def test_dashboard_in_a_browser_matches_metrics_during_a_load(live_server, tmp_path):
    url, ctx = live_server
    target = os.environ.get("PAGEDLLM_DASHBOARD_SCREENSHOT")
    load = Load(url)
    errors: list[str] = []
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS, headless=True)
            page = browser.new_page(viewport={"width": 1280, "height": 760})
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{url}/dashboard?interval={POLL_MS}")

            # it updates itself while the load runs
            seen = [page.evaluate(READ_AT_STEP, 1)]
            while len(seen) < 3 and seen[-1] is not None:
                seen.append(page.evaluate(READ_AT_STEP, seen[-1]["step"] + 1))
            assert None not in seen, f"the page stopped updating: {seen}"
            assert load.running and not load.errors, load.errors
            assert seen[0]["step"] < seen[1]["step"] < seen[2]["step"]
            assert any(number(r["running"]) > 0 for r in seen)

            matched = drawn = None
            shot = tmp_path / "dashboard.png"
            if target:
                time.sleep(12)  # for the README's picture: let the chart collect some history
            for _ in range(20):
                with concurrent.futures.ThreadPoolExecutor(2) as pool, engine_held(ctx):
                    time.sleep(5 * POLL_MS / 1000)  # the page's next poll is now stuck behind the hold
                    still = check_grid_and_hover(page)
                    if still is not None and len(first_block_of_each_state(still["states"])) == 4:
                        drawn = still
                        page.screenshot(path=str(shot), full_page=True)
                    scrape = pool.submit(httpx.get, url + "/metrics", timeout=60)
                    view = ctx.engine.call(lambda: engine_view(ctx.engine.engine))
                    time.sleep(3 * POLL_MS / 1000)  # let the server queue the scrape behind the hold
                metrics = samples(scrape.result().text)
                step = int(metrics["pagedllm:engine_steps_total"])
                page_read = page.evaluate(READ_AT_STEP, step)
                if page_read is None or not page_read["step"] == view.result(60)["step"] == step:
                    continue  # not the same step: try again
                counts = compare_at_one_step(page_read, metrics, view.result())
                if counts["used"] and counts["shared"] and counts["cached"]:
                    matched = (step, counts)
                if matched and drawn:
                    break
            assert matched, "no page reading at the same engine step as /metrics with used, shared and cached blocks"
            assert drawn, "never saw all four block states drawn at once"
            assert load.running, "the load ended before the checks did"
            browser.close()
    finally:
        load.stop()
    assert not errors, errors
    assert not load.errors, load.errors
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if target:
        shutil.copyfile(shot, Path(target))


def test_the_load_counts_error_events_not_completions_that_say_error():
    assert not _is_error('data: {"object": "text_completion", "choices": [{"index": 0, "text": "error"}]}')
    assert _is_error('data: {"error": {"message": "boom", "type": "server_error", "code": 500}}')
