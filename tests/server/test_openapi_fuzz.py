"""schemathesis against our own /openapi.json (issue 21): every operation, its examples, boundary
values and fuzzed bodies, valid and invalid, through every check schemathesis has (no 5xx; statuses,
content types, headers and error bodies as documented; invalid data refused; the API key not
ignored; undeclared methods 405 with ``Allow``), on a real loopback server with an API key.

One check is adapted (``schemathesis_hooks.py``): a request the schema allows must be accepted
unless it broke a rule no JSON Schema can state. schemathesis's CLI runs it (its pytest plugin does
not run under pytest 9); ``PAGEDLLM_SCHEMATHESIS_EXAMPLES`` sets the fuzzed examples per operation
(default 15; docs/api.md gives the full command)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pagedllm.server.app import build_app
from tests.server.conftest import serve_on_thread, tiny_context

KEY = "sk-fuzz"
EXAMPLES = os.environ.get("PAGEDLLM_SCHEMATHESIS_EXAMPLES", "15")
ST = Path(sys.executable).with_name("st")


def test_the_adapted_check_passes_only_the_rules_no_schema_can_state():
    from tests.server.schemathesis_hooks import broke_a_cross_field_rule

    def error(message: str, code: str | None = None) -> bytes:
        return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": code}}).encode()

    assert broke_a_cross_field_rule(400, error("prompt (9 tokens) + max_tokens (250) = 259 tokens exceeds "
                                               "max_model_len (256)", "context_length_exceeded"))
    assert broke_a_cross_field_rule(400, error("min_tokens (20) must be at most max_tokens (16)"))
    assert not broke_a_cross_field_rule(400, error("top_k: Input should be less than or equal to 2147483647"))
    assert not broke_a_cross_field_rule(400, error("the prompt is empty: it must have at least one token"))
    assert not broke_a_cross_field_rule(413, error("the request body is larger than 8 bytes"))


def test_schemathesis_finds_no_failure_with_every_check(tiny_folder, tmp_path):
    # a short context keeps each generated answer short (the schema's bounds follow it): half the time
    ctx = tiny_context(tiny_folder, num_kv_blocks=64, block_size=8, max_num_seqs=4, max_model_len=64)
    ctx.api_keys = (KEY,)
    try:
        app = build_app(ctx)
        operations = sum(len(methods) for methods in app.openapi()["paths"].values())
        with serve_on_thread(app) as url:
            run = subprocess.run(
                [str(ST), "run", url + "/openapi.json", "--checks", "all", "--exclude-checks",
                 "positive_data_acceptance", "-H", f"Authorization: Bearer {KEY}", "--max-examples", EXAMPLES,
                 # one worker: hypothesis parsing lambdas on two threads trips a CPython 3.11 AST bug
                 "--workers", "1", "--max-response-time", "60", "--continue-on-failure", "--output-sanitize",
                 "false", "--no-color"],
                env={**os.environ, "SCHEMATHESIS_HOOKS": "tests.server.schemathesis_hooks",
                     "PAGEDLLM_ST_TALLY": str(tmp_path / "tally"), "PYTHONPATH": str(Path(__file__).parents[2])},
                capture_output=True, text=True, timeout=600, cwd=tmp_path)  # its cache goes there
    finally:
        ctx.engine.shutdown()
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-20000:]
    assert f"Tested: {operations}" in out and operations >= 10  # every route, GET /v1/models/{id} included
    tally = (tmp_path / "tally").read_text().split()
    assert tally.count("checked") > 100 and "rejected" not in tally  # the adapted check ran, and passed
