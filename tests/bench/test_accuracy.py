"""``pagedllm bench accuracy``: perplexity equal to HF transformers' on the same windows for the
reference, zero KL and full agreement against itself, the quantized formats' measured loss, and
the table, JSON and plot it writes."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pagedllm.bench.accuracy import reference_text_ids
from pagedllm.cli import main
from tests.conftest import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("acc") / "llama", "llama", seed=1, with_tokenizer=True)


def hf_perplexity(folder: str, ids: list[int], context: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(ids) - context + 1, context):
            window = torch.tensor([ids[i:i + context]])
            logp = torch.log_softmax(model(window).logits[0, :-1].float(), -1)
            nll -= float(logp.gather(1, window[0, 1:].unsqueeze(1)).sum())
            count += context - 1
    return math.exp(nll / count)


def test_accuracy_measures_each_format_against_float32(tiny_with_tokenizer, tmp_path, capsys):
    rc = main(["bench", "accuracy", "--model", tiny_with_tokenizer, "--kv-cache-dtypes", "float32,int8,int4",
               "--weights", "float32,bfloat16", "--contexts", "64,256", "--text-tokens", "768", "--prompts", "2",
               "--new-tokens", "8", "--chunk", "24", "--block-size", "8", "--quiet",
               "--json", str(tmp_path / "a.json"), "--plot", str(tmp_path / "kl.png")])
    assert rc == 0
    report = json.loads((tmp_path / "a.json").read_text())
    assert report["windows"] == {"64": 12, "256": 3} and report["text_tokens"] == 768
    assert "pydoc_data/topics.py" in report["text_source"]
    rows = {(r["weights"], r["kv_cache_dtype"]): r for r in report["rows"]}
    assert len(rows) == 6
    ref = rows["float32", "float32"]
    # the reference against itself: no divergence, every argmax agrees; its perplexity is HF's
    assert ref["kl_64"] == ref["kl_256"] == 0 and ref["agreement"] == 1.0 and ref["ppl_256_delta_pct"] == 0
    from pagedllm.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(__import__("pathlib").Path(tiny_with_tokenizer), False)
    ids = reference_text_ids(tokenizer, 768)
    for context in (64, 256):
        assert ref[f"ppl_{context}"] == pytest.approx(hf_perplexity(tiny_with_tokenizer, ids, context), rel=1e-4)
    # quantized KV: some divergence, more for 4 bits than 8; the bytes per token as counted
    int8, int4 = rows["float32", "int8"], rows["float32", "int4"]
    assert 0 < int8["kl_256"] < int4["kl_256"]
    assert int8["kv_bytes_per_token"] == 2 * 2 * 2 * (16 + 2) and int4["kv_bytes_per_token"] == 2 * 2 * 2 * (8 + 2)
    assert int8["blocks_vs_bf16"] == pytest.approx(32 / 18) and rows["bfloat16", "float32"]["kl_64"] > 0
    curves = report["kl_by_position"]["curves"]
    assert report["kl_by_position"]["context"] == 256 and len(curves["float32/int8"]) == 64
    assert (tmp_path / "kl.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "| float32 | int4 |" in out and "ppl@256" in out


def test_weight_modes_int8_and_a_requantized_gguf(tmp_path, capsys):
    """int8 weights and Q6_K-re-encoded tensors of the embedded GGUF: each diverges a little from the
    float32 weights, and the report says what was re-encoded."""
    rc = main(["bench", "accuracy", "--configs", "int8/float32,q6_k/float32", "--contexts", "64",
               "--text-tokens", "128", "--prompts", "1", "--new-tokens", "4", "--quiet",
               "--json", str(tmp_path / "w.json")])
    assert rc == 0
    report = json.loads((tmp_path / "w.json").read_text())
    rows = {r["weights"]: r for r in report["rows"]}
    assert 0 < rows["int8"]["kl_64"] < 0.05 and 0 < rows["q6_k"]["kl_64"] < 0.05
    q6 = report["requantized"]["q6_k"]
    assert q6["kind"] == "Q6_K" and q6["tensors"] == 30  # SmolLM2's down projections (rows of 1,536)
    assert 0.2 < q6["share_of_projection_weights"] < 0.3 and 0 < q6["relative_rms_error"] < 0.03
    assert "q6_k: 30 tensors re-encoded as Q6_K" in capsys.readouterr().out


def test_a_requantized_copy_that_fails_leaves_nothing_behind(tmp_path, monkeypatch):
    """A re-encoding that fails part-way (a full disk) leaves no half-written GGUF in the cache (a
    later run would otherwise find no copy and write another beside it, or two runs share one name)."""
    from pagedllm.bench.accuracy import requantized_copy

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))

    def fails_part_way(source, target, kind_of):
        target.write_bytes(b"GGUF" + bytes(1000))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("pagedllm.models.kquant_encode.requantize_gguf", fails_part_way)
    with pytest.raises(OSError, match="No space left"):
        requantized_copy(None, "Q6_K")
    assert [p.name for p in (tmp_path / "requantized").rglob("*")] == []
