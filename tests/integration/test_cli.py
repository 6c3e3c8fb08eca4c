"""The command line, run as a user would: real processes, real output (a few cases call ``cli.main``
in this process, where starting an interpreter would be most of their time)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from pagedllm import cpu_features
from pagedllm.cli import main as cli_main
from pagedllm.models.layer_ops import get_layer_ops
from tests.conftest import make_tiny_checkpoint


def run_cli(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedllm.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


def test_generate_streams_text_and_prints_a_summary():
    r = run_cli("generate", "The capital of France is", "--max-tokens", "8", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert "Paris" in r.stdout
    summary = lines[-1]
    assert summary.startswith("[8 tokens in") and "tok/s" in summary and "KV blocks used" in summary
    assert "finish: length" in summary


def test_generate_with_speculation_says_what_the_guesses_gave(capsys):
    """The summary line counts this request's verifying steps and accepted guesses (it had none)."""
    prompt = " ".join(["one two three four five six"] * 6)
    assert cli_main(["generate", prompt, "--max-tokens", "24", "--dtype", "float32", "--ignore-eos",
                     "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    head, spec = summary.split(", speculation: ")
    assert head.startswith("[24 tokens in")
    steps, accepted, guessed = (int(w) for w in (spec.split()[0], spec.split()[3], spec.split()[5]))
    assert spec.startswith(f"{steps} verifying steps, {accepted} of {guessed} guessed tokens accepted")
    assert steps > 0 and 0 < accepted <= guessed <= 4 * steps
    assert spec.endswith(f"({accepted / guessed:.0%}), {1 + accepted / steps:.2f} tokens per verifying step]")


def test_chat_reads_turns_from_stdin_and_keeps_history():
    r = run_cli("chat", "--max-tokens", "12", "--dtype", "float32", "--system", "You are terse.",
                stdin="My name is Ada.\n/history\n/reset\nWhat is 2+2?\n/history\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("assistant> ") == 2
    assert r.stderr.count("tok/s") == 2
    lines = [line.replace("you> ", "") for line in r.stdout.splitlines()]  # input()'s prompt
    histories = [json.loads(line) for line in lines if line.startswith("[")]
    answers = [part.split("\nyou> ", 1)[0] for part in r.stdout.split("assistant> ")[1:]]  # as printed
    # the first history: system, the user turn and exactly the answer that was printed
    assert histories[0] == [{"role": "system", "content": "You are terse."},
                            {"role": "user", "content": "My name is Ada."},
                            {"role": "assistant", "content": answers[0]}]
    # /reset keeps only the system prompt: the second history holds the second exchange alone
    assert [m["content"] for m in histories[1]] == ["You are terse.", "What is 2+2?", answers[1]]


def test_chat_history_holds_the_final_text_without_a_stop_string():
    r = run_cli("chat", "--max-tokens", "24", "--dtype", "float32", "--stop", "2",
                stdin="Count from 1 to 5, separated by commas.\n/history\n/exit\n")
    assert r.returncode == 0, r.stderr
    lines = [line.replace("you> ", "") for line in r.stdout.splitlines()]
    answer = r.stdout.split("assistant> ", 1)[1].split("\nyou> ", 1)[0]  # as printed, newlines included
    history = next(json.loads(line) for line in lines if line.startswith("["))
    assert history[-1] == {"role": "assistant", "content": answer} and "2" not in answer
    assert "finish: stop" in r.stderr


def test_bad_arguments_give_a_message_not_a_traceback(capsys):
    """In this process (``cli.main``, what the console script calls): an exception escaping main
    would fail the test, as a traceback would in a real process."""
    assert cli_main(["generate", "hi", "--block-size", "7"]) == 2
    assert "block_size: Input should be greater than or equal to 8 (got 7)" in capsys.readouterr().err
    assert cli_main(["generate", "hi", "--top-p", "0"]) == 2 and "top_p" in capsys.readouterr().err
    assert cli_main(["generate", "hi", "--model", "/nonexistent/model.gguf"]) == 2
    assert "not found" in capsys.readouterr().err


def test_bench_throughput_compares_against_hf(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    out = tmp_path / "report.json"
    r = run_cli("bench", "throughput", "--model", folder, "--dtype", "float32", "--num-requests", "6",
                "--prompt-len", "4:40", "--output-len", "2:12", "--hf-batch-size", "3", "--json", str(out))
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    systems = {res["system"]: res for res in report["results"]}
    assert set(systems) == {"pagedllm", "hf-transformers"}
    assert systems["pagedllm"]["useful_tokens"] == systems["hf-transformers"]["useful_tokens"]
    assert systems["hf-transformers"]["computed_tokens"] >= systems["hf-transformers"]["useful_tokens"]
    assert "pagedllm / HF transformers" in r.stdout


def test_kv_memory_benchmarks_run_and_report(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    common = ["--model", folder, "--dtype", "float32", "--block-size", "8", "--kv-cache-memory", "4MiB"]
    runs = {
        "prefix-cache": ["--turns", "3", "--system-tokens", "20", "--user-tokens", "12", "--answer-tokens", "4"],
        "sharing": ["--prompt-tokens", "30", "--output-tokens", "6"],
        "fragmentation": ["--num-requests", "6", "--prompt-len", "4:40", "--output-len", "2:10",
                          "--max-model-len", "128"],
        "preemption": ["--num-requests", "6", "--prompt-len", "20:40", "--output-len", "8:16",
                       "--num-kv-blocks", "12", "--swap-space", "1MiB"],
    }
    for name, extra in runs.items():  # in this process (cli.main): four interpreter starts are 20 s here
        out = tmp_path / f"{name}.json"
        assert cli_main(["bench", name, *common, *extra, "--json", str(out)]) == 0, name
        report = json.loads(out.read_text())
        if name == "prefix-cache":
            assert report["on"]["prefix_cache_hits"] > 0 and report["off"]["prefix_cache_hits"] == 0
        elif name == "sharing":
            assert 0 < report["parallel_sampling"]["saved"] < 1 and 0 < report["beam_search"]["saved"] < 1
        elif name == "fragmentation":
            assert report["paged"]["mean_fragmentation"] < report["contiguous"]["mean_fragmentation"]
        else:
            assert report["same_outputs"] and report["swap"]["swapped_out_blocks"] > 0


def test_bench_attention_prefill_checks_each_backend_against_causal_sdpa(tmp_path):
    out = tmp_path / "attention.json"
    r = run_cli("bench", "attention", "--prefill", "--batch", "2", "--context", "40", "--repeats", "1",
                "--json", str(out))
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["mode"] == "prefill" and row["context"] == 40
    assert {"cpu_gflops", "reference_gflops", "sdpa_gflops"} <= set(row) and row["cpu_gflops"] > 0


def test_bench_attention_times_each_backend_over_each_quantized_format(tmp_path):
    out = tmp_path / "attention.json"
    assert cli_main(["bench", "attention", "--batch", "2", "--context", "48", "--repeats", "1", "--dtype", "float32",
                     "--kv-cache-dtypes", "int8,fp8_e5m2,int4", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    for backend in ("cpu", "reference"):
        for fmt in ("int8", "fp8_e5m2", "int4"):
            assert row[f"{backend}_{fmt}_ms"] > 0 and row[f"{backend}_{fmt}_over_float"] > 0


def test_bench_matmul_times_every_projection_with_each_kernel(tmp_path):
    out = tmp_path / "matmul.json"
    r = run_cli("bench", "matmul", "--rows", "1,16", "--repeats", "2", "--json", str(out))
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert set(report["projections"]) == {"qkv", "o", "gate_up", "down", "lm_head"}
    assert report["projections"]["qkv"]["shape"] == [960, 576]
    # every kernel this CPU has is timed; a packing oneDNN refuses here is named, with the reason
    cpu = cpu_features.detect()
    ops = get_layer_ops("cpu")
    packings = {"prepacked": cpu.onednn_packs(torch.bfloat16), "prepacked_fp32": cpu.onednn_packs(torch.float32),
                "panels_fp32": hasattr(ops, "ops") and ops.ops.has_panel_linear()}
    expected = {"dense", "plain_fp32", "gguf_blocks", "int8_channel", "int8_dequant"} | {
        k for k, ok in packings.items() if ok}
    tiles = hasattr(ops, "ops") and ops.ops.has_bf16_tiles()  # AVX-512 BF16 builds
    assert set(report["not_timed"]) == {k for k, ok in packings.items() if not ok} | (
        set() if tiles else {"gguf_blocks_tiles"})
    assert cpu.family in report["cpu"]
    for name, proj in report["projections"].items():
        # the 4-bit layers also time our C++ 4-bit kernel (the LM head is Q8_0 here), and every
        # projection our BF16 tile kernels where the build has them
        kinds = expected | (set() if name == "lm_head" else {"gguf_blocks_cpp"}) | (
            {"gguf_blocks_tiles"} if tiles else set())
        for timings in proj["ms"].values():
            assert set(timings) == kinds and min(timings.values()) > 0
    assert "per layer" in r.stdout


def test_bench_step_splits_the_unprofiled_step_into_parts(tmp_path):
    out = tmp_path / "step.json"
    r = run_cli("bench", "step", "--batch", "2", "--context", "24", "--steps", "3", "--dtype", "float32",
                "--json", str(out))
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    parts = report["parts_ms"]
    assert set(parts) == {"matmul (linear layers, LM head)", "attention (write K/V + paged attention)",
                          "other ops (norms, activations, argmax...)", "Python and glue"}
    assert min(parts.values()) >= 0 and parts["matmul (linear layers, LM head)"] > 0
    # the C++ decoder stack calls the attention from C++: the profiler sees it by its record's name
    assert parts["attention (write K/V + paged attention)"] > 0
    # glue is the unprofiled step less the measured ops, so the parts add up to that step, not more
    assert sum(parts.values()) <= report["step_ms"] + 0.05 or parts["Python and glue"] == 0
    assert abs(sum(report["shares"].values()) - 1) < 0.01 or parts["Python and glue"] == 0
    # the model's forward and LM head, timed in the plain steps, leave the rest of the step to the engine
    assert report["layer_loop"] == "C++ decoder stack"
    assert 0 < report["outside_model_ms"] < report["step_ms"]


def test_trace_writes_a_seeded_jsonl_trace_and_rejects_a_bad_rate(tmp_path):
    out = tmp_path / "code.jsonl"
    r = run_cli("trace", "--workload", "code", "--num-requests", "30", "--rate", "2", "--seed", "4", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "requests=30" in r.stdout and "shared_prefixes=" in r.stdout
    from pagedllm.workloads.traces import make_trace, read_trace

    assert read_trace(out) == make_trace("code", 30, 2.0, 4)
    r = run_cli("trace", "--workload", "code", "--rate", "fast", "--out", str(out))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--rate must be a number or inf, got 'fast'" in r.stderr


def test_every_command_prints_its_help(capsys):
    """``--help`` of every command and benchmark: an option whose description holds a % sign
    ("25%") made argparse raise while formatting ``pagedllm generate --help``."""
    import argparse

    import pytest

    from pagedllm.cli import main, make_parser

    def commands(parser: argparse.ArgumentParser, prefix: list[str]):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield prefix + [name]
                    yield from commands(sub, prefix + [name])

    names = list(commands(make_parser(), []))
    assert ["generate"] in names and ["bench", "compare"] in names and ["plan"] in names
    for argv in names:
        with pytest.raises(SystemExit) as exit_:
            main([*argv, "--help"])
        assert exit_.value.code == 0, argv
        assert "usage: pagedllm" in capsys.readouterr().out


def test_bench_step_timers_count_only_inside_their_block():
    from pagedllm.bench.step_profile import timing

    class Op:
        def run(self, x):
            return x + 1

    op, bucket = Op(), [0.0]
    with timing([(op, "run", bucket)]):
        assert op.run(1) == 2
    inside = bucket[0]
    assert inside > 0 and "run" not in vars(op)  # the class's method again: no wrapper left behind
    assert op.run(2) == 3 and bucket[0] == inside


def test_bench_step_counts_every_matmul_kernel_of_ours_as_matmul():
    """Each of our C++ matmul kernels, as the decoder stack names it for the profiler and as the
    layer ops expose it to Python, is a matmul in bench step's split (the Q8_0 tile kernel of the LM
    head was counted as an other op in the stack and went untimed from Python)."""
    import re
    from pathlib import Path

    from pagedllm.bench.step_profile import CPP_MATMULS, MATMUL_OPS
    from pagedllm.models.layer_ops import CpuLayerOps

    source = (Path(__file__).parents[2] / "src/pagedllm/models/csrc/decoder_stack_cpu.cpp").read_text()
    recorded = set(re.findall(r'RECORD_FUNCTION\("(pagedllm::\w+_linear)"', source))
    assert {"pagedllm::q4_tiles_linear", "pagedllm::q8_0_tiles_linear"} <= recorded
    assert recorded <= set(MATMUL_OPS)
    exposed = {name for name in vars(CpuLayerOps) if name.endswith("_linear")}
    assert "q8_0_tiles_linear" in exposed and exposed <= set(CPP_MATMULS)
